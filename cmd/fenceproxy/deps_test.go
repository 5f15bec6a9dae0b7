package main

import (
	"os/exec"
	"strings"
	"testing"
)

// The production binary must not link the demo's embedded etcd server or
// the throwaway-cluster code the tests and the demo use.
func TestBinaryLinksNoDemoCode(t *testing.T) {
	out, err := exec.Command("go", "list", "-deps", ".").CombinedOutput()
	if err != nil {
		t.Fatalf("go list -deps: %v\n%s", err, out)
	}
	forbidden := []string{
		"go.etcd.io/etcd/server/",
		"github.com/fenceproxy/fenceproxy/internal/demo",
		"github.com/fenceproxy/fenceproxy/internal/pgcluster",
		"github.com/fenceproxy/fenceproxy/internal/etcdcluster",
		"github.com/fenceproxy/fenceproxy/internal/proxytest",
		"github.com/fenceproxy/fenceproxy/internal/testcerts",
		"github.com/fenceproxy/fenceproxy/internal/testutil",
	}
	for _, dep := range strings.Fields(string(out)) {
		for _, f := range forbidden {
			if strings.HasPrefix(dep, f) {
				t.Errorf("fenceproxy links %s", dep)
			}
		}
	}
}
