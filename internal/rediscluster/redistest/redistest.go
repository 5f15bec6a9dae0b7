// Package redistest starts a rediscluster server for a test and stops it
// when the test ends. A missing redis-server fails the test; it never
// skips, but under -short (the fast lane) Start skips the test without
// starting anything.
package redistest

import (
	"context"
	"testing"
	"time"

	"github.com/fenceproxy/fenceproxy/internal/rediscluster"
	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// Start starts a server for t and stops it, removing its directory, when
// t and its subtests finish. A nil opts.Logf is replaced by t.Logf.
func Start(t testing.TB, opts rediscluster.Options) *rediscluster.Server {
	t.Helper()
	testutil.SkipSystem(t, "redis-server")
	if opts.Logf == nil {
		opts.Logf = t.Logf
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	s, err := rediscluster.Start(ctx, opts)
	if err != nil {
		t.Fatalf("%v", err)
	}
	t.Cleanup(func() {
		if err := s.Stop(); err != nil {
			t.Errorf("stop redis: %v", err)
		}
	})
	return s
}
