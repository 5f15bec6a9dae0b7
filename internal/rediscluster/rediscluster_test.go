package rediscluster_test

import (
	"testing"

	"github.com/redis/go-redis/v9"

	"github.com/fenceproxy/fenceproxy/internal/rediscluster"
	"github.com/fenceproxy/fenceproxy/internal/rediscluster/redistest"
)

func client(t *testing.T, s *rediscluster.Server) *redis.Client {
	t.Helper()
	opt, err := redis.ParseURL(s.URL())
	if err != nil {
		t.Fatal(err)
	}
	c := redis.NewClient(opt)
	t.Cleanup(func() { c.Close() })
	return c
}

// TestCrashLosesDataWithoutAOF: the harness's two persistence modes, as
// the lock tests rely on them.
func TestCrashLosesDataWithoutAOF(t *testing.T) {
	ctx := t.Context()
	for _, tc := range []struct {
		fsync string
		kept  bool
	}{{"", false}, {"always", true}} {
		t.Run("appendfsync="+tc.fsync, func(t *testing.T) {
			s := redistest.Start(t, rediscluster.Options{AppendFsync: tc.fsync})
			c := client(t, s)
			if err := c.Incr(ctx, "n").Err(); err != nil {
				t.Fatal(err)
			}
			addr := s.Addr()
			s.Crash()
			if s.PID() != 0 {
				t.Fatal("PID after Crash")
			}
			if err := s.Restart(ctx); err != nil {
				t.Fatal(err)
			}
			if s.Addr() != addr {
				t.Fatalf("Addr %s after restart, was %s", s.Addr(), addr)
			}
			n, err := c.Get(ctx, "n").Int()
			if tc.kept && (err != nil || n != 1) {
				t.Errorf("with AOF always: n = %d, %v; want 1", n, err)
			}
			if !tc.kept && err != redis.Nil {
				t.Errorf("without persistence: n = %d, %v; want nil", n, err)
			}
		})
	}
}
