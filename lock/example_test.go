package lock_test

import (
	"context"
	"database/sql"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/fenceproxy/fenceproxy/lock"
)

// A read-modify-write under a lock from etcd, through fenceproxy: the
// token and the lock's name go into the connection's settings, and the
// proxy fences every statement with them.
func Example() {
	ctx := context.Background()
	cli, err := clientv3.New(clientv3.Config{Endpoints: []string{"127.0.0.1:2379"}})
	if err != nil {
		return
	}
	defer cli.Close()
	l, err := lock.Acquire(ctx, cli, "locks/config/1", lock.Options{TTL: 10 * time.Second})
	if err != nil {
		return
	}
	defer l.Release(ctx)
	cfg, err := pgx.ParseConfig("postgres://app@fenceproxy:6432/app")
	if err != nil {
		return
	}
	l.ConfigurePgx(cfg, lock.Settings{}) // fence.token and fence.lock as startup parameters
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
	var g lock.Grant // from a Locker: lock.Etcd(cli) or lock.NewRedis(rdb, …)
	if g == nil {
		return
	}
	tx, err := lock.BeginTx(ctx, pool, g.Fence(lock.Settings{}), pgx.TxOptions{})
	if err != nil {
		return
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, "UPDATE config SET payload = $1 WHERE id = 1", "new"); err != nil {
		return
	}
	_ = tx.Commit(ctx)
}

// The same with database/sql.
func ExampleBeginSQL() {
	ctx := context.Background()
	var db *sql.DB // sql.Open("pgx", …) or lib/pq
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

// Redis instead of etcd: the program picks the service, the code that
// uses the grant stays the same.
func ExampleNewRedis() {
	ctx := context.Background()
	rdb := redis.NewClient(&redis.Options{Addr: "127.0.0.1:6379"})
	defer rdb.Close()
	var locker lock.Locker = lock.NewRedis(rdb, lock.RedisOptions{})
	wait, cancel := context.WithTimeout(ctx, 5*time.Second) // the wait bound
	defer cancel()
	g, err := locker.Acquire(wait, "config:1", lock.Options{TTL: 10 * time.Second})
	if err != nil {
		return
	}
	defer g.Release(ctx)
	_ = g.Token() // the fencing token, strictly increasing across holders
}
