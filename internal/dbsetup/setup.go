package dbsetup

import (
	"context"
	"errors"
	"fmt"
	"slices"

	"github.com/jackc/pgx/v5"

	"github.com/fenceproxy/fenceproxy/internal/catalog"
	"github.com/fenceproxy/fenceproxy/internal/guard"
	"github.com/fenceproxy/fenceproxy/internal/rules"
)

// SetupOptions says what Setup may change besides the fenceproxy objects.
// The zero value installs the objects only.
type SetupOptions struct {
	// AddColumns adds each missing fence column, as bigint NOT NULL
	// DEFAULT 0, to the protected tables that exist in the database.
	// Since PostgreSQL 11 this rewrites no rows, but ALTER TABLE waits for
	// every transaction using the table, and holds up those that come
	// after it meanwhile.
	AddColumns bool

	// Guard installs or updates the database guard: row triggers on the
	// protected tables that apply their fence inside PostgreSQL, so that
	// writes the proxy does not see (functions, dynamic SQL, cascades,
	// sessions connected directly) are fenced too, and TRUNCATE triggers
	// that refuse TRUNCATE. It goes on each table whose entries in this
	// database are all in mode enforce, fence it alike and include one for
	// every session; it is removed from tables that no longer qualify.
	// Without Guard, a guard installed earlier is left as it is.
	Guard bool
	// RemoveGuard removes the database guard: its triggers, functions and
	// table of exempt roles. It cannot be combined with Guard.
	RemoveGuard bool
	// ExemptRoles are the roles whose sessions the guard lets write
	// without a token or a lock name (migrations, maintenance): a session
	// is exempt when its login role is one of them or a member of one.
	// Each must exist. Used with Guard.
	ExemptRoles []string
	// TokenSetting and LockSetting are the session settings that carry the
	// token and the lock name, as the configuration's token_setting and
	// lock_setting. Default rules.DefaultTokenSetting and
	// rules.DefaultLockSetting. Used with Guard.
	TokenSetting, LockSetting string
	// Tables are the configuration's entries (rules.Config.Tables), which
	// TableSpec.Index indexes: the guard takes their on_stale, strict and
	// missing_token. nil takes the defaults for every entry. Used with
	// Guard.
	Tables []rules.Table
}

// setupLockKey is the advisory lock that serialises setups of a database:
// without it two setups would both try to create the schema, and one would
// fail on the other's row in pg_namespace. Keys of one bigint are a key
// space apart from the register procedure's keys of two integers (pg_locks
// tells them apart by objsubid), so the two cannot collide.
const setupLockKey int64 = 0x4650_5345_5455_5031 // "FPSETUP1"

// NewerError is Setup's refusal to replace fenceproxy objects of a newer
// version than Version with older ones.
type NewerError struct {
	Database string
	Found    int // the version in the database
}

func (e *NewerError) Error() string {
	return fmt.Sprintf("dbsetup: database %q has fenceproxy objects of version %d, newer than this fenceproxy's version %d: not downgrading them (use a fenceproxy release that knows version %d)",
		e.Database, e.Found, Version, e.Found)
}

// Setup prepares the database conn is connected to for specs, in one
// transaction: it installs or upgrades the fenceproxy objects (objects.sql)
// and, as a superuser, the catalog watch (watch.sql), and, with opts.AddColumns, adds the missing fence columns of the entries
// that apply in this database (mode not off, scope.databases empty or
// naming it) whose table exists here; with opts.Guard it installs or
// updates the database guard (see SetupOptions.Guard), with
// opts.RemoveGuard it removes it. Running it again changes nothing and
// reports no actions. Concurrent setups of one database wait for each
// other. It returns a *NewerError, and changes nothing, when the database
// has objects of a newer version.
//
// The connecting role must be able to create the schema (CREATE on the
// database) and own, or be a superuser over, the tables it alters (with
// Guard: the tables it guards, and their partitions). The guard's
// functions run as that role (SECURITY DEFINER), which must therefore
// keep its privileges on the fenceproxy objects.
func Setup(ctx context.Context, conn *pgx.Conn, specs []rules.TableSpec, opts SetupOptions) (Report, error) {
	var rep Report
	if opts.Guard && opts.RemoveGuard {
		return rep, errors.New("dbsetup: Guard and RemoveGuard together")
	}
	// READ COMMITTED: after waiting for another setup, each statement must
	// see what that setup committed.
	tx, err := conn.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.ReadCommitted})
	if err != nil {
		return rep, fmt.Errorf("dbsetup: begin: %w", err)
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	if _, err := tx.Exec(ctx, "SELECT pg_catalog.pg_advisory_xact_lock($1)", setupLockKey); err != nil {
		return rep, fmt.Errorf("dbsetup: wait for other setups: %w", err)
	}
	if err := tx.QueryRow(ctx, "SELECT pg_catalog.current_database()").Scan(&rep.Database); err != nil {
		return rep, fmt.Errorf("dbsetup: %w", err)
	}
	// On failure nothing was done: the report keeps only what was found.
	fail := func(err error) (Report, error) {
		return Report{Database: rep.Database, Version: rep.Version}, fmt.Errorf("dbsetup: database %q: %w", rep.Database, err)
	}

	if err := installObjects(ctx, tx, &rep); err != nil {
		var newer *NewerError
		if errors.As(err, &newer) {
			return Report{Database: rep.Database, Version: rep.Version}, err
		}
		return fail(err)
	}
	if err := installWatch(ctx, tx, &rep); err != nil {
		return fail(err)
	}
	if err := addColumns(ctx, tx, specs, opts, &rep); err != nil {
		return fail(err)
	}
	var g guard.Result
	switch {
	case opts.Guard:
		g, err = guard.Install(ctx, tx, applying(specs, rep.Database), guard.Config{
			TokenSetting: opts.TokenSetting, LockSetting: opts.LockSetting, Tables: opts.Tables, ExemptRoles: opts.ExemptRoles})
	case opts.RemoveGuard:
		g, err = guard.Remove(ctx, tx)
	default:
		g, err = guard.Leave(ctx, tx)
	}
	if err != nil {
		return fail(err)
	}
	rep.Actions = append(rep.Actions, g.Actions...)
	for _, n := range g.Notes {
		rep.Notes = append(rep.Notes, Note(n))
	}
	if err := tx.Commit(ctx); err != nil {
		return fail(fmt.Errorf("commit: %w", err))
	}
	return rep, nil
}

// installObjects runs objects.sql. When that changes nothing (same version,
// same definitions and grants), it is rolled back to a savepoint, so that a
// second setup leaves even the catalog rows' versions alone.
func installObjects(ctx context.Context, tx pgx.Tx, rep *Report) error {
	before, err := readObjects(ctx, tx)
	if err != nil {
		return err
	}
	rep.Version = before.version
	if before.version > Version {
		return &NewerError{Database: rep.Database, Found: before.version}
	}
	fpBefore, err := fingerprint(ctx, tx)
	if err != nil {
		return err
	}
	if _, err := tx.Exec(ctx, "SAVEPOINT fenceproxy_objects"); err != nil {
		return err
	}
	// Without arguments pgx sends objects.sql as one simple Query, which
	// may hold many statements; they run in this transaction.
	if _, err := tx.Exec(ctx, objectsSQL); err != nil {
		return fmt.Errorf("install the fenceproxy objects: %w", err)
	}
	fpAfter, err := fingerprint(ctx, tx)
	if err != nil {
		return err
	}
	if slices.Equal(fpBefore, fpAfter) {
		_, err := tx.Exec(ctx, "ROLLBACK TO SAVEPOINT fenceproxy_objects")
		return err
	}
	if _, err := tx.Exec(ctx, "RELEASE SAVEPOINT fenceproxy_objects"); err != nil {
		return err
	}
	switch {
	case !before.schema:
		rep.Actions = append(rep.Actions, fmt.Sprintf("created the fenceproxy schema and objects (version %d)", Version))
	case !before.hasVersion:
		rep.Actions = append(rep.Actions, fmt.Sprintf("completed the fenceproxy objects (version %d)", Version))
	case before.version < Version:
		rep.Actions = append(rep.Actions, fmt.Sprintf("upgraded the fenceproxy objects from version %d to %d", before.version, Version))
	default:
		rep.Actions = append(rep.Actions, fmt.Sprintf("restored the fenceproxy objects' definitions and privileges (version %d)", Version))
	}
	return nil
}

// addColumns adds the missing fence columns (opts.AddColumns) or notes them.
func addColumns(ctx context.Context, tx pgx.Tx, specs []rules.TableSpec, opts SetupOptions, rep *Report) error {
	type key struct{ schema, table, column string }
	seen := map[key]bool{}
	rels := map[[2]string]*catalog.Relation{}
	for _, s := range specs {
		if !appliesIn(s, rep.Database) {
			continue
		}
		k := key{s.Schema, s.Table, s.Column}
		if seen[k] {
			continue
		}
		seen[k] = true
		rel, ok := rels[[2]string{s.Schema, s.Table}]
		if !ok {
			var err error
			if rel, err = catalog.LookupTable(ctx, tx, s.Schema, s.Table); err != nil {
				return err
			}
			rels[[2]string{s.Schema, s.Table}] = rel
			if rel == nil {
				rep.Notes = append(rep.Notes, Note{Table: s.Display, Text: "not present in this database"})
			}
		}
		if rel == nil || s.Column == "" {
			continue
		}
		if !rel.IsTable() || rel.IsPartition {
			continue // Check reports it
		}
		col, err := catalog.LookupColumn(ctx, tx, rel, s.Column)
		if err != nil {
			return err
		}
		if col.Exists {
			continue
		}
		if !opts.AddColumns {
			rep.Notes = append(rep.Notes, Note{Table: s.Display,
				Text: fmt.Sprintf("fence column %s is missing: setup adds it with --add-columns", col.Quoted)})
			continue
		}
		if _, err := tx.Exec(ctx, addColumnSQL(rel, col)); err != nil {
			return fmt.Errorf("add column %s to %s: %w", col.Quoted, rel.Qualified, err)
		}
		rep.Actions = append(rep.Actions, fmt.Sprintf("added column %s bigint NOT NULL DEFAULT 0 to %s", col.Quoted, rel.Qualified))
	}
	return nil
}

func addColumnSQL(rel *catalog.Relation, col *catalog.Column) string {
	return "ALTER TABLE " + rel.Qualified + " ADD COLUMN " + col.Quoted + " bigint NOT NULL DEFAULT 0"
}
