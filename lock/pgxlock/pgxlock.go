package pgxlock

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/fenceproxy/fenceproxy/lock"
)

// Configure puts the token and the lock's name into cfg.RuntimeParams
// (Fence.RuntimeParams), so that every connection made from cfg sends them
// in its startup message and PostgreSQL sets them for the whole session:
// the program needs no set_config. The settings belong to this grant; a
// connection made from cfg after the grant ends carries an old token,
// which fenced writes refuse. For a pgxpool.Config, pass its ConnConfig.
// Behind a transaction pooler, which drops or refuses startup parameters
// and moves transactions between server sessions, use BeginTx or Apply
// instead.
func Configure(cfg *pgx.ConnConfig, f lock.Fence) {
	if cfg.RuntimeParams == nil {
		cfg.RuntimeParams = make(map[string]string)
	}
	for k, v := range f.RuntimeParams() {
		cfg.RuntimeParams[k] = v
	}
}

// Execer is what Apply needs: pgx.Tx, *pgx.Conn and *pgxpool.Pool's
// connections have it.
type Execer interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

// Apply sets the token and the lock's name for the rest of the current
// transaction of tx, with set_config(name, value, true) in one statement
// (Fence.SQL); it is Fence.ApplySQL for pgx. Call it first in every
// transaction that writes: the settings end with the transaction, so a
// transaction pooler that hands the server session to another client
// next leaves it nothing. Outside a transaction block the settings last
// only for the statement itself, so Apply is useless there.
func Apply(ctx context.Context, tx Execer, f lock.Fence) error {
	q, args, err := f.SQL()
	if err != nil {
		return err
	}
	if _, err := tx.Exec(ctx, q, args...); err != nil {
		token, name := f.Settings.Names()
		return fmt.Errorf("lock: set %s and %s: %w", token, name, err)
	}
	return nil
}

// Beginner is what BeginTx needs: *pgx.Conn, *pgxpool.Pool and pgx.Tx
// (a savepoint) have it.
type Beginner interface {
	BeginTx(ctx context.Context, opts pgx.TxOptions) (pgx.Tx, error)
}

// BeginTx begins a transaction on conn and applies f in it (Apply). If
// applying fails, the transaction is rolled back and the error returned.
//
//	tx, err := pgxlock.BeginTx(ctx, pool, grant.Fence(lock.Settings{}), pgx.TxOptions{})
//	if err != nil { ... }
//	defer tx.Rollback(ctx)
//	... fenced writes ...
//	err = tx.Commit(ctx)
func BeginTx(ctx context.Context, conn Beginner, f lock.Fence, opts pgx.TxOptions) (pgx.Tx, error) {
	if _, _, err := f.SQL(); err != nil {
		return nil, err
	}
	tx, err := conn.BeginTx(ctx, opts)
	if err != nil {
		return nil, err
	}
	if err := Apply(ctx, tx, f); err != nil {
		_ = tx.Rollback(ctx)
		return nil, err
	}
	return tx, nil
}
