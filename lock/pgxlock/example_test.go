package pgxlock_test

import (
	"context"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/fenceproxy/fenceproxy/lock"
	"github.com/fenceproxy/fenceproxy/lock/pgxlock"
)

// A read-modify-write through fenceproxy: the token and the lock's name
// go into the connection's startup parameters, and the proxy fences every
// statement with them.
func ExampleConfigure() {
	ctx := context.Background()
	var g lock.Grant // from a lock.Locker: etcdlock.New(cli) or redislock.New(rdb, …)
	if g == nil {
		return
	}
	cfg, err := pgx.ParseConfig("postgres://app@fenceproxy:6432/app")
	if err != nil {
		return
	}
	pgxlock.Configure(cfg, g.Fence(lock.Settings{})) // fence.token and fence.lock as startup parameters
	conn, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		return
	}
	defer conn.Close(ctx)
	_, _ = conn.Exec(ctx, "UPDATE config SET payload = payload || 'x' WHERE id = 1")
}

// Behind a transaction pooler in front of fenceproxy, session settings
// leak between clients: BeginTx sets both inside the transaction.
func ExampleBeginTx() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, "postgres://app@pgbouncer:6432/app")
	if err != nil {
		return
	}
	defer pool.Close()
	var g lock.Grant // from a lock.Locker
	if g == nil {
		return
	}
	tx, err := pgxlock.BeginTx(ctx, pool, g.Fence(lock.Settings{}), pgx.TxOptions{})
	if err != nil {
		return
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, "UPDATE config SET payload = $1 WHERE id = 1", "new"); err != nil {
		return
	}
	_ = tx.Commit(ctx)
}
