package main

import (
	"os/exec"
	"testing"

	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// TestComposeFileValidates checks docker-compose.yml with docker-compose's
// own validator ('config' needs no Docker engine).
func TestComposeFileValidates(t *testing.T) {
	testutil.SkipSystem(t, "docker-compose")
	bin, err := exec.LookPath("docker-compose")
	if err != nil {
		t.Fatal("docker-compose not found: install it (Debian: apt-get install docker-compose) or run scripts/install-deps.sh")
	}
	out, err := exec.Command(bin, "-f", "../../docker-compose.yml", "config", "-q").CombinedOutput()
	if err != nil {
		t.Fatalf("docker-compose config: %v\n%s", err, out)
	}
}
