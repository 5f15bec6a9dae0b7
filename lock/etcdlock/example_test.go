package etcdlock_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/fenceproxy/fenceproxy/lock"
	"github.com/fenceproxy/fenceproxy/lock/etcdlock"
)

// A job under a lock from etcd, through fenceproxy: the token and the
// lock's name go into PGOPTIONS, so every libpq program the job starts
// (psql, pg_dump, lib/pq) carries them, and the proxy fences its writes.
func Example() {
	ctx := context.Background()
	cli, err := clientv3.New(clientv3.Config{Endpoints: []string{"127.0.0.1:2379"}})
	if err != nil {
		return
	}
	defer cli.Close()
	l, err := etcdlock.Acquire(ctx, cli, "locks/config/1", lock.Options{TTL: 10 * time.Second, KeepAlive: true})
	if err != nil {
		return
	}
	defer l.Release(ctx)
	os.Setenv("PGOPTIONS", lock.AppendPGOptions(os.Getenv("PGOPTIONS"), l.PGOptions(lock.Settings{})))
	select {
	case <-l.Done(): // lost: stop writing; the proxy refuses the old token anyway
	case <-time.After(time.Second): // the job
	}
}

// TryAcquire reports the holder when the lock is taken.
func ExampleTryAcquire() {
	ctx := context.Background()
	cli, err := clientv3.New(clientv3.Config{Endpoints: []string{"127.0.0.1:2379"}})
	if err != nil {
		return
	}
	defer cli.Close()
	l, err := etcdlock.TryAcquire(ctx, cli, "locks/report", lock.Options{Holder: "report-job"})
	if locked := (*lock.LockedError)(nil); errors.As(err, &locked) {
		fmt.Printf("held by %s with token %d\n", locked.Holder, locked.Token)
		return
	}
	if err != nil {
		return
	}
	defer l.Release(ctx)
}

// The holder key is the one etcdctl lock creates for the same lease.
func ExampleHolderKey() {
	fmt.Println(etcdlock.HolderKey("locks/config", 0x694d8f1b2c3a4e5f))
	// Output: locks/config/694d8f1b2c3a4e5f
}
