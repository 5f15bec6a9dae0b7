package lock_test

import (
	"context"
	"database/sql"
	"fmt"
	"os"
	"time"

	"github.com/redis/go-redis/v9"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/fenceproxy/fenceproxy/lock"
	"github.com/fenceproxy/fenceproxy/lock/etcdlock"
	"github.com/fenceproxy/fenceproxy/lock/redislock"
)

// The program picks the lock service by configuration; the code that
// uses the grant stays the same.
func ExampleLocker() {
	ctx := context.Background()
	var locker lock.Locker
	if url := os.Getenv("REDIS_URL"); url != "" {
		opt, err := redis.ParseURL(url)
		if err != nil {
			return
		}
		rdb := redis.NewClient(opt)
		defer rdb.Close()
		locker = redislock.New(rdb, redislock.Options{})
	} else {
		cli, err := clientv3.New(clientv3.Config{Endpoints: []string{"127.0.0.1:2379"}})
		if err != nil {
			return
		}
		defer cli.Close()
		locker = etcdlock.New(cli)
	}
	wait, cancel := context.WithTimeout(ctx, 5*time.Second) // the wait bound
	defer cancel()
	g, err := locker.Acquire(wait, "locks/config/1", lock.Options{TTL: 10 * time.Second})
	if err != nil {
		return
	}
	defer g.Release(ctx)
	_ = g.Fence(lock.Settings{}) // the token and the lock's name, for PostgreSQL
}

// Behind a transaction pooler in front of fenceproxy, session settings
// leak between clients: BeginSQL sets both inside the transaction. Any
// database/sql driver works (lib/pq, pgx's stdlib).
func ExampleBeginSQL() {
	ctx := context.Background()
	var db *sql.DB // sql.Open("postgres", …)
	var g lock.Grant
	if db == nil || g == nil {
		return
	}
	tx, err := lock.BeginSQL(ctx, db, g.Fence(lock.Settings{}), nil)
	if err != nil {
		return
	}
	defer tx.Rollback()
	_, _ = tx.ExecContext(ctx, "UPDATE config SET payload = $1 WHERE id = 1", "new")
	_ = tx.Commit()
}

// A grant's settings as startup parameters, for a driver that takes
// them as a map.
func ExampleFence_RuntimeParams() {
	f := lock.Fence{Token: 42, Lock: "locks/config/1"}
	fmt.Println(f.RuntimeParams())
	// Output: map[fence.lock:locks/config/1 fence.token:42]
}

// A grant's settings for libpq's PGOPTIONS (psql, lib/pq, any libpq
// program), added to what the environment had.
func ExampleFence_PGOptions() {
	f := lock.Fence{Token: 42, Lock: "locks/tenant 7"}
	fmt.Println(lock.AppendPGOptions("-c work_mem=64MB", f.PGOptions()))
	// Output: -c work_mem=64MB -c fence.token=42 -c fence.lock=locks/tenant\ 7
}

// The statement that sets both settings for one transaction, for a driver
// without a helper here.
func ExampleFence_SQL() {
	f := lock.Fence{Token: 42, Lock: "locks/config/1", Settings: lock.Settings{Token: "app.token", Lock: "app.lock"}}
	q, args, err := f.SQL()
	if err != nil {
		return
	}
	fmt.Println(q)
	fmt.Println(args...)
	// Output:
	// SELECT set_config('app.token', $1, true), set_config('app.lock', $2, true)
	// 42 locks/config/1
}
