package lock

import (
	"context"
	"database/sql"
	"fmt"
	"strconv"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// Fence is what a grant carries to PostgreSQL: the fencing token and the
// lock's name, and the settings that carry them. Get one from a grant's
// Fence method; the zero Settings uses the default setting names.
type Fence struct {
	Token    int64
	Lock     string
	Settings Settings
}

// held is what a grant of every backend has: the lock's name and the
// token, and the ways to carry them to PostgreSQL.
type held struct {
	name  string
	token int64
}

// Key returns the lock's name, as passed to Acquire; the value for the
// fence.lock setting.
func (h *held) Key() string { return h.name }

// Token returns the fencing token: positive, and larger than every earlier
// holder's token of the same lock on the same service.
func (h *held) Token() int64 { return h.token }

// Fence returns the token and the lock's name with the setting names s.
func (h *held) Fence(s Settings) Fence { return Fence{Token: h.token, Lock: h.name, Settings: s} }

// RuntimeParams returns the token and the lock's name keyed by the setting
// names in s, for a connection's startup parameters.
func (h *held) RuntimeParams(s Settings) map[string]string { return h.Fence(s).RuntimeParams() }

// ConfigurePgx puts the token and the lock's name into cfg.RuntimeParams,
// so that every connection made from cfg sends them in its startup message
// and PostgreSQL sets them for the whole session: the program needs no
// set_config. The settings belong to this grant; a connection made from cfg
// after the lease ends carries an old token, which fenced writes refuse.
// For a pgxpool.Config, pass its ConnConfig. Behind a transaction pooler,
// which drops or refuses startup parameters and moves transactions between
// server sessions, use BeginTx or Fence.Apply instead.
func (h *held) ConfigurePgx(cfg *pgx.ConnConfig, s Settings) { h.Fence(s).ConfigurePgx(cfg) }

// PGOptions returns the token and the lock's name as libpq command-line
// options, "-c TOKEN_SETTING=<token> -c LOCK_SETTING=<name>", escaped for
// the PGOPTIONS environment variable or the options connection parameter.
func (h *held) PGOptions(s Settings) string { return h.Fence(s).PGOptions() }

// RuntimeParams returns the token and the lock's name keyed by the setting
// names, for a connection's startup parameters.
func (f Fence) RuntimeParams() map[string]string {
	return map[string]string{
		f.Settings.token(): strconv.FormatInt(f.Token, 10),
		f.Settings.lock():  f.Lock,
	}
}

// ConfigurePgx puts both settings into cfg.RuntimeParams; see
// Lease.ConfigurePgx.
func (f Fence) ConfigurePgx(cfg *pgx.ConnConfig) {
	if cfg.RuntimeParams == nil {
		cfg.RuntimeParams = make(map[string]string)
	}
	for k, v := range f.RuntimeParams() {
		cfg.RuntimeParams[k] = v
	}
}

// PGOptions returns both settings as libpq command-line options; see
// Lease.PGOptions.
func (f Fence) PGOptions() string {
	return "-c " + escapeOption(f.Settings.token()+"="+strconv.FormatInt(f.Token, 10)) +
		" -c " + escapeOption(f.Settings.lock()+"="+f.Lock)
}

// applySQL sets both settings for the current transaction only
// (set_config's third argument, is_local). The setting names are in the
// text, not parameters, so that a proxy reading the statement sees which
// settings it sets; Validate allows only letters, digits, "_", "$" and
// dots in them, so they need no quoting. The values are parameters.
func (f Fence) applySQL() (string, error) {
	if err := f.Settings.Validate(); err != nil {
		return "", err
	}
	return fmt.Sprintf("SELECT set_config('%s', $1, true), set_config('%s', $2, true)",
		f.Settings.token(), f.Settings.lock()), nil
}

// PgxExecer is what Apply needs: pgx.Tx, *pgx.Conn and *pgxpool.Pool's
// connections have it.
type PgxExecer interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

// Apply sets the token and the lock's name for the rest of the current
// transaction of tx, with set_config(name, value, true) in one statement.
// Call it first in every transaction that writes: the settings end with
// the transaction (COMMIT or ROLLBACK), so a transaction pooler
// (PgBouncer in transaction mode) that hands the server session to
// another client next leaves it nothing, and the next transaction of
// this client, on whichever server session, gets its own. Outside a
// transaction block PostgreSQL warns and the settings last only for the
// statement itself, so Apply is useless there.
func (f Fence) Apply(ctx context.Context, tx PgxExecer) error {
	q, err := f.applySQL()
	if err != nil {
		return err
	}
	if _, err := tx.Exec(ctx, q, strconv.FormatInt(f.Token, 10), f.Lock); err != nil {
		return fmt.Errorf("lock: set %s and %s: %w", f.Settings.token(), f.Settings.lock(), err)
	}
	return nil
}

// SQLExecer is what ApplySQL needs: *sql.Tx and *sql.Conn have it.
type SQLExecer interface {
	ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error)
}

// ApplySQL is Apply for database/sql; pass the *sql.Tx (a *sql.DB would
// run it on any pooled connection, outside the transaction).
func (f Fence) ApplySQL(ctx context.Context, tx SQLExecer) error {
	q, err := f.applySQL()
	if err != nil {
		return err
	}
	if _, err := tx.ExecContext(ctx, q, strconv.FormatInt(f.Token, 10), f.Lock); err != nil {
		return fmt.Errorf("lock: set %s and %s: %w", f.Settings.token(), f.Settings.lock(), err)
	}
	return nil
}

// PgxBeginner is what BeginTx needs: *pgx.Conn, *pgxpool.Pool and pgx.Tx
// (a savepoint) have it.
type PgxBeginner interface {
	BeginTx(ctx context.Context, opts pgx.TxOptions) (pgx.Tx, error)
}

// BeginTx begins a transaction on conn and applies f in it (Fence.Apply).
// If applying fails, the transaction is rolled back and the error
// returned.
//
//	tx, err := lock.BeginTx(ctx, pool, lease.Fence(lock.Settings{}), pgx.TxOptions{})
//	if err != nil { ... }
//	defer tx.Rollback(ctx)
//	... fenced writes ...
//	err = tx.Commit(ctx)
func BeginTx(ctx context.Context, conn PgxBeginner, f Fence, opts pgx.TxOptions) (pgx.Tx, error) {
	if _, err := f.applySQL(); err != nil {
		return nil, err
	}
	tx, err := conn.BeginTx(ctx, opts)
	if err != nil {
		return nil, err
	}
	if err := f.Apply(ctx, tx); err != nil {
		_ = tx.Rollback(ctx)
		return nil, err
	}
	return tx, nil
}

// SQLBeginner is what BeginSQL needs: *sql.DB and *sql.Conn have it.
type SQLBeginner interface {
	BeginTx(ctx context.Context, opts *sql.TxOptions) (*sql.Tx, error)
}

// BeginSQL is BeginTx for database/sql: it begins a transaction on db
// (opts may be nil) and applies f in it.
func BeginSQL(ctx context.Context, db SQLBeginner, f Fence, opts *sql.TxOptions) (*sql.Tx, error) {
	if _, err := f.applySQL(); err != nil {
		return nil, err
	}
	tx, err := db.BeginTx(ctx, opts)
	if err != nil {
		return nil, err
	}
	if err := f.ApplySQL(ctx, tx); err != nil {
		_ = tx.Rollback()
		return nil, err
	}
	return tx, nil
}
