package lock_test

import (
	"os/exec"
	"strings"
	"testing"
)

// TestStandardLibraryOnly: lock imports nothing outside the standard
// library, so that an application that imports it compiles no client of
// a lock service or driver it does not use; those live in etcdlock,
// redislock and pgxlock.
func TestStandardLibraryOnly(t *testing.T) {
	t.Parallel()
	goTool, err := exec.LookPath("go")
	if err != nil {
		t.Skipf("no go command: %v", err)
	}
	const pkg = "github.com/fenceproxy/fenceproxy/lock"
	out, err := exec.Command(goTool, "list", "-deps", "-f", "{{if not .Standard}}{{.ImportPath}}{{end}}", pkg).CombinedOutput()
	if err != nil {
		t.Fatalf("go list -deps %s: %v\n%s", pkg, err, out)
	}
	var others []string
	self := false
	for _, p := range strings.Fields(string(out)) {
		if p == pkg {
			self = true
		} else {
			others = append(others, p)
		}
	}
	if !self {
		t.Fatalf("go list -deps %s did not list the package itself: %q", pkg, out)
	}
	if len(others) > 0 {
		t.Errorf("lock depends on packages outside the standard library: %s", strings.Join(others, ", "))
	}
}
