package service_test

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/fenceproxy/fenceproxy/internal/rules"
	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// configMapDir lays out dir as the kubelet lays out a mounted ConfigMap
// volume: the file is a symlink to ..data/<name>, ..data a symlink to a
// timestamped directory holding the data
// (k8s.io/kubernetes/pkg/volume/util/atomic_writer.go).
type configMapDir struct {
	t    *testing.T
	dir  string
	name string
	gen  int
}

func newConfigMapDir(t *testing.T, name, text string) *configMapDir {
	d := &configMapDir{t: t, dir: t.TempDir(), name: name}
	d.write(text)
	if err := os.Symlink(filepath.Join("..data", name), filepath.Join(d.dir, name)); err != nil {
		t.Fatal(err)
	}
	return d
}

func (d *configMapDir) path() string { return filepath.Join(d.dir, d.name) }

// write makes a new timestamped directory with text and swaps ..data to
// it as the kubelet does: a new symlink ..data_tmp renamed over ..data,
// then the old directory removed.
func (d *configMapDir) write(text string) {
	t := d.t
	t.Helper()
	d.gen++
	ts := fmt.Sprintf("..2026_01_02_15_04_05.%09d", d.gen)
	if err := os.Mkdir(filepath.Join(d.dir, ts), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(d.dir, ts, d.name), []byte(text), 0o644); err != nil {
		t.Fatal(err)
	}
	old, _ := os.Readlink(filepath.Join(d.dir, "..data"))
	tmp := filepath.Join(d.dir, "..data_tmp")
	if err := os.Symlink(ts, tmp); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, filepath.Join(d.dir, "..data")); err != nil {
		t.Fatal(err)
	}
	if old != "" {
		if err := os.RemoveAll(filepath.Join(d.dir, old)); err != nil {
			t.Fatal(err)
		}
	}
}

// TestConfigMapSymlinkSwapReloads: a configuration mounted the way
// Kubernetes mounts a ConfigMap is reloaded when the kubelet swaps ..data,
// and the new rules fence writes (issue 31).
func TestConfigMapSymlinkSwapReloads(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	createTable(t, "public.watch_a")
	createTable(t, "public.watch_b")
	t.Run("mounted directory", func(t *testing.T) { testSymlinkSwap(t, false) })
	// The file is a symlink from another directory to the mounted file
	// (-c /etc/fenceproxy.yaml, the volume at /config): the swap happens
	// in a directory the file is not in.
	t.Run("symlink from elsewhere", func(t *testing.T) { testSymlinkSwap(t, true) })
}

func testSymlinkSwap(t *testing.T, elsewhere bool) {
	base := fmt.Sprintf("listen: 127.0.0.1:0\nupstream:\n  address: %s\nadmin:\n  listen: 127.0.0.1:0\n", cluster.Addr())
	cm := newConfigMapDir(t, "fenceproxy.yaml", base+"tables:\n  - table: public.watch_a\n")
	path := cm.path()
	if elsewhere {
		path = filepath.Join(t.TempDir(), "fenceproxy.yaml")
		if err := os.Symlink(cm.path(), path); err != nil {
			t.Fatal(err)
		}
	}
	in, _ := startInstance(t, path)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); in.WatchReloads(ctx) }()
	t.Cleanup(func() { cancel(); <-done })

	ok := func() float64 {
		return metric(t, in, `fenceproxy_config_reloads_total{result="ok"}`)
	}
	c := connect(t, in.Addr(), "")
	// watch_b is not protected yet: a write without a token runs.
	if _, err := c.Exec(context.Background(), "UPDATE watch_b SET v = 'a' WHERE id = 1"); err != nil {
		t.Fatalf("before the swap: %v", err)
	}
	for i, want := range []string{"public.watch_b", "public.watch_a"} {
		before := ok()
		cm.write(base + "tables:\n  - table: " + want + "\n")
		waitFor(t, func() bool { return ok() > before })
		body := get(t, "http://"+in.AdminAddr()+"/rules", http.StatusOK)
		if !strings.Contains(body, `"table": "`+want+`"`) {
			t.Fatalf("swap %d: /rules after the reload:\n%s\nwant table %s", i+1, body, want)
		}
		_, err := c.Exec(context.Background(), "UPDATE "+want+" SET v = 'b' WHERE id = 1")
		if sqlstate(err) != rules.CodeMissingToken {
			t.Fatalf("swap %d: a write to %s without a token: %v, want %s", i+1, want, err, rules.CodeMissingToken)
		}
	}
	if n := metric(t, in, `fenceproxy_config_reloads_total{result="failed"}`); n != 0 {
		t.Errorf("failed reloads = %v, want 0", n)
	}
}
