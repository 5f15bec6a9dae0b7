// Package etcdtest starts an embedded etcd cluster for a test and stops it
// when the test ends. Under -short (the fast lane) Start skips the test
// instead.
package etcdtest

import (
	"context"
	"fmt"
	"os"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/fenceproxy/fenceproxy/internal/etcdcluster"
	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// startTimeout bounds cluster start-up; a healthy cluster is ready in about a
// second.
const startTimeout = 30 * time.Second

// Start starts a cluster of members (1 or 3) with its data in t.TempDir and
// registers its Close with t.Cleanup. It fails the test if the cluster does
// not come up.
func Start(t testing.TB, members int) *etcdcluster.Cluster {
	t.Helper()
	testutil.SkipSystem(t, "etcd")
	ctx, cancel := context.WithTimeout(context.Background(), startTimeout)
	defer cancel()
	c, err := etcdcluster.Start(ctx, etcdcluster.Options{Members: members, Dir: t.TempDir()})
	if err != nil {
		t.Fatalf("start etcd: %v", err)
	}
	t.Cleanup(c.Close)
	return c
}

// leakGrace is how long VerifyTestMain waits for goroutines to finish. etcd's
// peer HTTP connections outlive a stopped member until their 5s read
// timeout (rafthttp.ConnReadTimeout) fires; nothing can close them sooner.
const leakGrace = 10 * time.Second

// VerifyTestMain runs the tests and then fails the binary if goroutines are
// left behind, like goleak.VerifyTestMain, but gives goroutines of stopped
// etcd members time to finish. Use it as the body of TestMain. Under
// -short it reports the system tests skipped (testutil.ReportSkips).
func VerifyTestMain(m *testing.M, opts ...goleak.Option) {
	code := m.Run()
	testutil.ReportSkips()
	if code == 0 {
		if err := findLeaks(opts...); err != nil {
			fmt.Fprintf(os.Stderr, "goleak: errors on successful test run: %v\n", err)
			code = 1
		}
	}
	os.Exit(code)
}

func findLeaks(opts ...goleak.Option) error {
	deadline := time.Now().Add(leakGrace)
	for {
		err := goleak.Find(opts...) // retries briefly by itself
		if err == nil || time.Now().After(deadline) {
			return err
		}
	}
}
