package pgtest_test

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"testing"

	"github.com/fenceproxy/fenceproxy/internal/pgcluster"
	"github.com/fenceproxy/fenceproxy/internal/pgcluster/pgtest"
	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// shared is started by TestMain through StartMain.
var shared *pgcluster.Cluster

func TestMain(m *testing.M) {
	c, stop := pgtest.StartMain(pgcluster.Options{})
	shared = c
	code := m.Run()
	stop()
	testutil.ReportSkips()
	if c == nil { // -short
		os.Exit(code)
	}
	if _, err := os.Stat(c.DataDir()); !errors.Is(err, fs.ErrNotExist) {
		fmt.Fprintf(os.Stderr, "StartMain's stop left %s: %v\n", c.DataDir(), err)
		code = 1
	}
	os.Exit(code)
}

func TestStartMain(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	if err := shared.Exec(t.Context(), "SELECT 1"); err != nil {
		t.Fatal(err)
	}
}

func TestStartStopsOnCleanup(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	var root string
	t.Run("cluster", func(t *testing.T) {
		c := pgtest.Start(t, pgcluster.Options{})
		root = filepath.Dir(c.DataDir())
		if err := c.Exec(t.Context(), "CREATE TABLE t (); DROP TABLE t"); err != nil {
			t.Fatal(err)
		}
	})
	if _, err := os.Stat(root); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("cluster directory %s after the test: %v", root, err)
	}
}
