package lock_test

import (
	"context"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/fenceproxy/fenceproxy/internal/etcdcluster/etcdtest"
	"github.com/fenceproxy/fenceproxy/internal/pgcluster"
	"github.com/fenceproxy/fenceproxy/internal/pgcluster/pgtest"
	"github.com/fenceproxy/fenceproxy/internal/rediscluster"
)

func TestMain(m *testing.M) {
	etcdtest.VerifyTestMain(m)
}

func testContext(t *testing.T) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// newClient starts a one-member etcd cluster for the test and returns a
// client for it; both go away when the test ends.
func newClient(t *testing.T) *clientv3.Client {
	t.Helper()
	cli, err := etcdtest.Start(t, 1).Client()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cli.Close() })
	return cli
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

// startPG starts a throwaway PostgreSQL cluster for t.
func startPG(t *testing.T) *pgcluster.Cluster {
	t.Helper()
	return pgtest.Start(t, pgcluster.Options{})
}
