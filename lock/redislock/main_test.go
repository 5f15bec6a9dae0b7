package redislock_test

import (
	"context"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/fenceproxy/fenceproxy/internal/etcdcluster/etcdtest"
	"github.com/fenceproxy/fenceproxy/internal/rediscluster"
	"github.com/fenceproxy/fenceproxy/lock"
)

// TestMain checks for leaked goroutines (a grant's monitor, a waiter's
// subscription) with the harness's grace period for clients that are
// still closing.
func TestMain(m *testing.M) {
	etcdtest.VerifyTestMain(m)
}

func testContext(t *testing.T) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return ctx
}

func redisClient(t *testing.T, s *rediscluster.Server) *redis.Client {
	t.Helper()
	opt, err := redis.ParseURL(s.URL())
	if err != nil {
		t.Fatal(err)
	}
	c := redis.NewClient(opt)
	t.Cleanup(func() { c.Close() })
	return c
}

func mustReleaseGrant(t *testing.T, ctx context.Context, g lock.Grant) {
	t.Helper()
	if err := g.Release(ctx); err != nil {
		t.Fatalf("Release(%q, token %d): %v", g.Key(), g.Token(), err)
	}
	select {
	case <-g.Done():
	case <-time.After(time.Second):
		t.Fatal("Done not closed by Release")
	}
}
