package policy

import (
	"context"
	"fmt"
	"slices"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"go.uber.org/zap"

	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/rules"
)

// Migrations run at application start-up through the proxy. Two kinds of
// DDL on protected tables that the rules refuse are forwarded here: DDL
// that changes nothing, judged against the catalog on a connection of the
// policy's own (ORMs that "sync" a model send it at every start), and any
// DDL of a session whose user is a migrations role (ddl.allow_roles). After
// the second, after a CREATE TABLE of a protected name, and after DDL on
// a table whose check failed, writes to the tables it names are refused
// until its transaction has ended and the database has been checked again
// (fence column, guard, paths; migrations_commit.go); then the check's
// results decide them. Every forwarded migration is logged with the user,
// database, statement kind and tables. See docs/protecting-tables.md,
// "Migrations at start-up".

// CatalogConnect opens a connection to database for the catalog lookups
// (the database check's connection settings).
type CatalogConnect func(ctx context.Context, database string) (*pgx.Conn, error)

// MigrationOptions configure the migrations at start-up.
type MigrationOptions struct {
	// AllowRoles may run any DDL on protected tables through the proxy
	// (user names as sent in the startup packet). Default: none.
	AllowRoles []string
	// Catalog, when set, judges DDL that changes nothing; without it such
	// DDL is refused like any other.
	Catalog CatalogConnect
}

// migrations is the policy's state for them.
type migrations struct {
	allow   atomic.Pointer[[]string] // see SetMigrationRoles
	catalog CatalogConnect
	timeout time.Duration
	running runningMigrations // migrations_commit.go
}

// SetMigrations configures the migrations at start-up; call it once,
// before the policy decides statements (SetMigrationRoles changes the
// roles later).
func (p *Policy) SetMigrations(o MigrationOptions) {
	m := &migrations{catalog: o.Catalog, timeout: p.checkWait}
	roles := slices.Clone(o.AllowRoles)
	m.allow.Store(&roles)
	p.migrations = m
}

// SetMigrationRoles replaces the migrations roles (ddl.allow_roles, on a
// reload): statements decided after it returns use them. Statements
// already forwarded stay forwarded, and migrations already running are
// still checked again when they end. Without SetMigrations first it does
// nothing.
func (p *Policy) SetMigrationRoles(roles []string) {
	if p.migrations == nil {
		return
	}
	r := slices.Clone(roles)
	p.migrations.allow.Store(&r)
}

// allowed reports whether user is a migrations role.
func (m *migrations) allowed(user string) bool {
	return slices.Contains(*m.allow.Load(), user)
}

// migration applies the migrations at start-up to d, the rules' decision
// on sql: a refused text of DDL that changes nothing, or of a migrations
// role, becomes a forward, and a forwarded CREATE TABLE of a protected
// name has the database checked again. Quick, it reports false instead of
// parsing. Judged: the text's decision depends on the migrations (they
// apply to it, or may).
func (p *Policy) migration(info *proxy.SessionInfo, rs *rules.Rules, sql string, d *rules.Decision, quick bool) (ok, judged bool) {
	m := p.migrations
	if m == nil {
		return true, false
	}
	if d.Action == rules.Rewrite {
		// A write to a table of a migration that has not been checked
		// since it ended is refused (migrations_commit.go).
		if e := m.running.refusal(info.Database, d.Tables); e != nil {
			*d = rules.Decision{Action: rules.Refuse, Err: e, Tables: d.Tables}
		}
		return true, true
	}
	if !rules.MayBeMigration(sql) {
		return true, false
	}
	if d.Action == rules.Forward && !rs.MayTouch(sql) {
		return true, true
	}
	if quick {
		return false, true
	}
	stmts, ok := rs.Migration(sql)
	if !ok {
		return true, true
	}
	if d.Action == rules.Forward {
		// DDL the rules let through (the allow-list) is checked again
		// after it when it creates a protected table, or when it names a
		// table whose last check failed (the migration that fixes it:
		// writes are allowed again as soon as the check after it passes).
		// Other allow-listed DDL (CREATE INDEX CONCURRENTLY, say) holds
		// up no write.
		for _, s := range stmts {
			if s.CreatesProtected {
				p.migrated(info, stmts, "created a protected table")
				return true, true
			}
		}
		if p.failedCheck(info.Database, stmts) {
			p.migrated(info, stmts, "DDL on a table whose check failed")
		}
		return true, true
	}
	if m.allowed(info.User) {
		*d = rules.Decision{Action: rules.Forward, Tables: d.Tables}
		p.migrated(info, stmts, "migrations role")
		return true, true
	}
	if m.catalog == nil {
		return true, true
	}
	same, err := m.changesNothing(info.Database, stmts)
	if err != nil {
		// Fail closed: the refusal stands.
		p.log.Warn("migration: cannot read the catalog to judge DDL; refused", zap.String("database", info.Database),
			zap.Uint64("conn-id", info.ID), zap.Error(err))
		return true, true
	}
	if same {
		*d = rules.Decision{Action: rules.Forward, Tables: d.Tables}
		for _, s := range stmts {
			p.log.Info("migration: DDL that changes nothing forwarded", zap.String("user", info.User), zap.String("database", info.Database),
				zap.String("statement", s.Kind), zap.Strings("tables", tableDisplays(s.Tables)), zap.Uint64("conn-id", info.ID))
		}
	}
	return true, true
}

// migrated logs DDL forwarded that may change protected tables and has
// the database checked again.
func (p *Policy) migrated(info *proxy.SessionInfo, stmts []rules.MigrationStmt, why string) {
	for _, s := range stmts {
		p.log.Warn("migration: DDL on protected tables forwarded", zap.String("reason", why), zap.String("user", info.User),
			zap.String("database", info.Database), zap.String("statement", s.Kind), zap.Strings("tables", tableDisplays(s.Tables)),
			zap.Uint64("conn-id", info.ID), zap.String("application-name", info.ApplicationName))
	}
	if p.checks == nil {
		return
	}
	// The statement has not run yet, and its transaction may end much
	// later: writes to its tables are refused from now until the
	// database has been checked after the transaction ended
	// (migrations_commit.go). The results are read again at the next
	// statement, and writes elsewhere wait for a stamp read.
	p.catalogMoved(info.Database)
	var tables []string
	for _, s := range stmts {
		tables = append(tables, tableDisplays(s.Tables)...)
	}
	p.migrations.running.begin(p, info, tables)
}

// failedCheck reports whether the last check of database found a problem
// with a table stmts name.
func (p *Policy) failedCheck(database string, stmts []rules.MigrationStmt) bool {
	if p.checks == nil {
		return false
	}
	res, known := p.checks.Result(database)
	if !known {
		return false
	}
	for _, s := range stmts {
		for _, t := range s.Tables {
			if len(res.Problems[t.Display]) > 0 {
				return true
			}
		}
	}
	return false
}

func tableDisplays(ts []rules.TableName) []string {
	out := make([]string, len(ts))
	for i, t := range ts {
		out[i] = t.Display
	}
	return out
}

// changesNothing reports whether every statement of stmts is an ALTER
// TABLE whose subcommands change nothing on every protected table it may
// name, judged against database's catalog.
func (m *migrations) changesNothing(database string, stmts []rules.MigrationStmt) (bool, error) {
	for _, s := range stmts {
		if !s.Judged || len(s.Tables) == 0 {
			return false, nil
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), m.timeout)
	defer cancel()
	conn, err := m.catalog(ctx, database)
	if err != nil {
		return false, err
	}
	defer func() { _ = conn.Close(context.Background()) }()
	for _, s := range stmts {
		for _, t := range s.Tables {
			for _, c := range s.Cmds {
				same, err := cmdChangesNothing(ctx, conn, t, c)
				if err != nil || !same {
					return false, err
				}
			}
		}
	}
	return true, nil
}

// columnQuery reads a column of a table without children (ALTER TABLE
// recurses into them, which the lookup does not judge).
const columnQuery = `SELECT a.attnotnull, a.atttypid, a.atttypmod, pg_get_expr(d.adbin, d.adrelid), a.attidentity::text, a.attgenerated::text
FROM pg_catalog.pg_attribute a LEFT JOIN pg_catalog.pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
WHERE a.attrelid = pg_catalog.to_regclass($1) AND a.attname = $2 AND a.attnum > 0 AND NOT a.attisdropped
  AND NOT EXISTS (SELECT FROM pg_catalog.pg_inherits i WHERE i.inhparent = a.attrelid)`

func cmdChangesNothing(ctx context.Context, conn *pgx.Conn, t rules.TableName, c rules.NoopCmd) (bool, error) {
	if c.Kind == rules.NoopAllowed {
		return true, nil
	}
	var (
		notNull            bool
		typ                uint32
		typmod             int32
		def                *string
		identity, generate string
	)
	err := conn.QueryRow(ctx, columnQuery, pgx.Identifier{t.Schema, t.Table}.Sanitize(), c.Column).
		Scan(&notNull, &typ, &typmod, &def, &identity, &generate)
	if err == pgx.ErrNoRows {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("catalog lookup of %s: %w", t.Display, err)
	}
	plain := identity == "" && generate == ""
	switch c.Kind {
	case rules.NoopSetNotNull:
		return notNull, nil
	case rules.NoopDropNotNull:
		return !notNull && plain, nil
	case rules.NoopDropDefault:
		return def == nil && plain, nil
	case rules.NoopSetDefault:
		return def != nil && plain && rules.SameExpression(c.Expr, *def), nil
	case rules.NoopColumnExists:
		return true, nil
	case rules.NoopType:
		// The server resolves the type and its modifier: the
		// description of a statement casting to it (never executed; the
		// text is the rewriter's deparse of a type name).
		sd, err := conn.Prepare(ctx, "", "SELECT NULL::"+c.Type)
		if err != nil {
			return false, nil // an unknown type: the ALTER fails or is refused
		}
		if len(sd.Fields) != 1 {
			return false, nil
		}
		return sd.Fields[0].DataTypeOID == typ && sd.Fields[0].TypeModifier == typmod, nil
	}
	return false, nil
}
