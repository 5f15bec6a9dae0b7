// Package pgtest starts pgcluster clusters for tests. A missing PostgreSQL
// installation fails the test with pgcluster's explanation; it never skips,
// so a test run without a server cannot pass by accident. Under -short
// (the fast lane) no cluster starts: Start skips the test, StartMain
// returns none.
package pgtest

import (
	"context"
	"fmt"
	"os"
	"testing"
	"time"

	"github.com/fenceproxy/fenceproxy/internal/pgcluster"
	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// mainStartTimeout bounds StartMain, which has no test context.
const mainStartTimeout = 2 * time.Minute

// Start starts a cluster for t and stops it, removing its directory, when t
// and its subtests finish. A nil opts.Logf is replaced by t.Logf. Under
// -short it skips t (testutil.SkipSystem).
func Start(t testing.TB, opts pgcluster.Options) *pgcluster.Cluster {
	t.Helper()
	testutil.SkipSystem(t, "PostgreSQL")
	if opts.Logf == nil {
		opts.Logf = t.Logf
	}
	c, err := pgcluster.Start(t.Context(), opts)
	if err != nil {
		t.Fatalf("%v", err)
	}
	t.Cleanup(func() {
		if err := c.Stop(); err != nil {
			t.Errorf("stop cluster: %v", err)
		}
	})
	return c
}

// StartMain starts a cluster from TestMain, where there is no testing.TB.
// On failure it prints the error and exits with status 1. Call stop after
// m.Run and before os.Exit (which skips deferred calls):
//
//	func TestMain(m *testing.M) {
//		c, stop := pgtest.StartMain(pgcluster.Options{})
//		cluster = c
//		code := m.Run()
//		stop()
//		os.Exit(code)
//	}
//
// Under -short it starts nothing and returns a nil cluster (and a stop that
// does nothing): every test that uses the cluster must skip first, with
// testutil.SkipSystem.
func StartMain(opts pgcluster.Options) (c *pgcluster.Cluster, stop func()) {
	if testutil.Short() {
		return nil, func() {}
	}
	ctx, cancel := context.WithTimeout(context.Background(), mainStartTimeout)
	defer cancel()
	c, err := pgcluster.Start(ctx, opts)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	return c, func() {
		if err := c.Stop(); err != nil {
			fmt.Fprintln(os.Stderr, err)
		}
	}
}
