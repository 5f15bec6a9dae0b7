package lock

import (
	"context"
	"database/sql"
	"fmt"
	"strconv"
)

// Fence is what a grant carries to PostgreSQL: the fencing token and the
// lock's name, and the settings that carry them. Get one from a grant's
// Fence method; the zero Settings uses the default setting names.
type Fence struct {
	Token    int64
	Lock     string
	Settings Settings
}

// RuntimeParams returns the token and the lock's name keyed by the setting
// names, for a connection's startup parameters: every connection made with
// them gets both settings for the whole session, so the program needs no
// set_config. The settings belong to this grant; a connection made with
// them after the grant ends carries an old token, which fenced writes
// refuse. Behind a transaction pooler, which drops or refuses startup
// parameters and moves transactions between server sessions, use BeginSQL
// or ApplySQL instead.
func (f Fence) RuntimeParams() map[string]string {
	return map[string]string{
		f.Settings.token(): strconv.FormatInt(f.Token, 10),
		f.Settings.lock():  f.Lock,
	}
}

// PGOptions returns the token and the lock's name as libpq command-line
// options, "-c TOKEN_SETTING=<token> -c LOCK_SETTING=<name>", escaped for
// the PGOPTIONS environment variable or the options connection parameter.
func (f Fence) PGOptions() string {
	return "-c " + escapeOption(f.Settings.token()+"="+strconv.FormatInt(f.Token, 10)) +
		" -c " + escapeOption(f.Settings.lock()+"="+f.Lock)
}

// SQL returns the statement that sets the token and the lock's name for
// the current transaction only (set_config's third argument, is_local),
// and its two arguments, for a driver that ApplySQL does not serve. The
// setting names are in the text, not parameters, so that a proxy reading
// the statement sees which settings it sets; Validate allows only
// letters, digits, "_", "$" and dots in them, so they need no quoting. It
// returns Validate's error for names PostgreSQL would not accept.
func (f Fence) SQL() (query string, args []any, err error) {
	if err := f.Settings.Validate(); err != nil {
		return "", nil, err
	}
	return fmt.Sprintf("SELECT set_config('%s', $1, true), set_config('%s', $2, true)",
		f.Settings.token(), f.Settings.lock()), []any{strconv.FormatInt(f.Token, 10), f.Lock}, nil
}

// SQLExecer is what ApplySQL needs: *sql.Tx and *sql.Conn have it.
type SQLExecer interface {
	ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error)
}

// ApplySQL sets the token and the lock's name for the rest of the current
// transaction of tx, with set_config(name, value, true) in one statement
// (SQL). Call it first in every transaction that writes: the settings end
// with the transaction (COMMIT or ROLLBACK), so a transaction pooler
// (PgBouncer in transaction mode) that hands the server session to
// another client next leaves it nothing, and the next transaction of this
// client, on whichever server session, gets its own. Outside a
// transaction block PostgreSQL warns and the settings last only for the
// statement itself, so pass the *sql.Tx: a *sql.DB would run it on any
// pooled connection, outside the transaction.
func (f Fence) ApplySQL(ctx context.Context, tx SQLExecer) error {
	q, args, err := f.SQL()
	if err != nil {
		return err
	}
	if _, err := tx.ExecContext(ctx, q, args...); err != nil {
		return fmt.Errorf("lock: set %s and %s: %w", f.Settings.token(), f.Settings.lock(), err)
	}
	return nil
}

// SQLBeginner is what BeginSQL needs: *sql.DB and *sql.Conn have it.
type SQLBeginner interface {
	BeginTx(ctx context.Context, opts *sql.TxOptions) (*sql.Tx, error)
}

// BeginSQL begins a transaction on db (opts may be nil) and applies f in
// it (Fence.ApplySQL). If applying fails, the transaction is rolled back
// and the error returned.
//
//	tx, err := lock.BeginSQL(ctx, db, grant.Fence(lock.Settings{}), nil)
//	if err != nil { ... }
//	defer tx.Rollback()
//	... fenced writes ...
//	err = tx.Commit()
func BeginSQL(ctx context.Context, db SQLBeginner, f Fence, opts *sql.TxOptions) (*sql.Tx, error) {
	if _, _, err := f.SQL(); err != nil {
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
