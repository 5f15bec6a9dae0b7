package etcdcluster_test

import (
	"context"
	"os"
	"testing"
	"time"

	"github.com/fenceproxy/fenceproxy/internal/etcdcluster"
	"github.com/fenceproxy/fenceproxy/internal/etcdcluster/etcdtest"
	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

func TestMain(m *testing.M) {
	etcdtest.VerifyTestMain(m)
}

func TestSingleMember(t *testing.T) {
	testutil.SkipSystem(t, "etcd")
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c, err := etcdcluster.Start(ctx, etcdcluster.Options{})
	if err != nil {
		t.Fatal(err)
	}
	if n := len(c.Endpoints()); n != 1 {
		t.Fatalf("endpoints: got %d, want 1", n)
	}
	cli, err := c.Client()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := cli.Put(ctx, "k", "v"); err != nil {
		t.Fatal(err)
	}
	resp, err := cli.Get(ctx, "k")
	if err != nil {
		t.Fatal(err)
	}
	if len(resp.Kvs) != 1 || string(resp.Kvs[0].Value) != "v" {
		t.Fatalf("get: %v", resp.Kvs)
	}
	if i, err := c.LeaderIndex(ctx); err != nil || i != 0 {
		t.Fatalf("LeaderIndex = %d, %v; want 0", i, err)
	}
	cli.Close()

	dir := c.Dir()
	if _, err := os.Stat(dir); err != nil {
		t.Fatalf("data dir: %v", err)
	}
	c.Close()
	c.Close() // idempotent
	if _, err := os.Stat(dir); !os.IsNotExist(err) {
		t.Errorf("temp dir %s still exists after Close", dir)
	}
}

func TestRejectsBadSize(t *testing.T) {
	if _, err := etcdcluster.Start(context.Background(), etcdcluster.Options{Members: 2}); err == nil {
		t.Fatal("Start with 2 members: want error")
	}
}

func TestThreeMembersLeaderStop(t *testing.T) {
	for _, tc := range []struct {
		name string
		stop func(c *etcdcluster.Cluster, i int)
	}{
		{"graceful", (*etcdcluster.Cluster).StopMember},
		{"kill", (*etcdcluster.Cluster).KillMember},
	} {
		t.Run(tc.name, func(t *testing.T) {
			testLeaderStop(t, tc.stop)
		})
	}
}

func testLeaderStop(t *testing.T, stop func(c *etcdcluster.Cluster, i int)) {
	c := etcdtest.Start(t, 3)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if n := len(c.Endpoints()); n != 3 {
		t.Fatalf("endpoints: got %d, want 3", n)
	}
	cli, err := c.Client()
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()

	leader, err := c.LeaderIndex(ctx)
	if err != nil {
		t.Fatal(err)
	}
	stop(c, leader)
	next, err := c.LeaderIndex(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if next == leader {
		t.Fatalf("leader still %d after stopping it", leader)
	}
	if _, err := cli.Put(ctx, "k", "after-stop"); err != nil {
		t.Fatalf("put with one member down: %v", err)
	}
	if err := c.RestartMember(ctx, leader); err != nil {
		t.Fatal(err)
	}
	// The restarted member catches up and serves linearizable reads.
	one, err := c.Client()
	if err != nil {
		t.Fatal(err)
	}
	defer one.Close()
	one.SetEndpoints(c.Endpoints()[leader])
	resp, err := one.Get(ctx, "k")
	if err != nil {
		t.Fatal(err)
	}
	if len(resp.Kvs) != 1 || string(resp.Kvs[0].Value) != "after-stop" {
		t.Fatalf("get from restarted member: %v", resp.Kvs)
	}
}
