package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/fenceproxy/fenceproxy/internal/config"
	"github.com/fenceproxy/fenceproxy/internal/dbsetup"
	"github.com/fenceproxy/fenceproxy/internal/rules"
)

const setupUsage = `usage: fenceproxy setup -c FILE [--dsn DSN] [--database D]... [--add-columns] [--guard | --remove-guard]

Prepares each database the configuration's tables need: installs or
upgrades the fenceproxy schema (lock watermarks and the register
procedure) and, with --add-columns, adds each missing fence column as
bigint NOT NULL DEFAULT 0. One transaction per database; running it again
changes nothing. It never replaces objects of a newer fenceproxy.

With --guard it also installs or updates the database guard: triggers on
the protected tables that apply the same fence inside PostgreSQL to the
writes the proxy does not see (functions, dynamic SQL, cascades, sessions
connected directly) and refuse TRUNCATE, except for sessions of the roles
in guard.exempt_roles. A table gets the guard when its entries are all in
mode enforce, fence it alike and include one for every session; it loses
the guard when that stops being so. Without --guard a guard installed
earlier is left as it is; --remove-guard removes it.

Databases: those named with --database, or else every database in a
tables[].scope.databases, plus, when an entry has no database scope, the
connection's database, with libpq's defaults: that of --dsn (or audit.dsn),
else $PGDATABASE, else the user name. Without --dsn it connects as the
proxy's audit connection does: audit.dsn, or user postgres ($PGUSER if
set) at upstream.address (password from audit.password_env, else
$PGPASSWORD); a file with neither connects from the PG* environment alone,
as psql would. It prints the databases it worked in.

Exit status: 0 done; 1 failed in some database (the others are still set
up); 2 usage error.

flags (each also from $FENCEPROXY_<NAME>, e.g. FENCEPROXY_DSN):
`

const checkUsage = `usage: fenceproxy check -c FILE [--dsn DSN] [--database D]...

Checks, without changing anything, each database the configuration's
tables need (chosen and connected to as by fenceproxy setup): fence columns
(present, bigint, NOT NULL, DEFAULT 0), the fenceproxy objects and their
version, the privileges of the login roles that use protected tables, and
the database guard where it is installed (fenceproxy setup --guard).
Prints each problem with the SQL or command that fixes it.

Exit status: 0 no problems; 1 problems found; 2 usage error; 3 a database
could not be checked (configuration unreadable, connection refused...).

flags (each also from $FENCEPROXY_<NAME>, e.g. FENCEPROXY_DSN):
`

// Exit statuses of check besides exitFailed (problems found).
const exitNotChecked = 3

// dbConnectTimeout bounds connecting to one database.
const dbConnectTimeout = 30 * time.Second

// databasesFlag is a repeatable --database.
type databasesFlag []string

func (d *databasesFlag) String() string { return strings.Join(*d, ",") }

func (d *databasesFlag) Set(s string) error {
	if s == "" {
		return errors.New("must not be empty")
	}
	*d = append(*d, s)
	return nil
}

// dbCommand is what setup and check share: the configuration, the
// databases and how to connect to them.
type dbCommand struct {
	*command
	name      string
	config    *string
	dsn       string
	databases databasesFlag
}

func newDBCommand(name, usage string, stdout, stderr io.Writer) *dbCommand {
	c := &dbCommand{command: newCommand(name, name, stdout, stderr), name: name}
	c.fs.Usage = func() {
		fmt.Fprint(c.fs.Output(), usage)
		c.fs.PrintDefaults()
	}
	c.config = c.configFlag("fenceproxy.yaml", "config file (its tables; upstream.address or audit.dsn unless --dsn)")
	c.fs.StringVar(&c.dsn, "dsn", "", "libpq connection string or URL to connect with (its database is replaced by each database); default: as the proxy's audit connection")
	c.fs.Var(&c.databases, "database", "database to work in (repeatable); default: the databases the tables need")
	return c
}

// target is the work of setup or check: the entries, the databases and
// how to connect.
type target struct {
	specs     []rules.TableSpec
	rules     rules.Config
	guard     config.Guard
	databases []string
	connect   func(ctx context.Context, database string) (*pgx.Conn, error)
	// unscoped is the connection's database, where the entries without
	// scope.databases (unscopedTables) are set up or checked when no
	// --database is given; from says where its name came from.
	unscoped       string
	unscopedTables []string
	from           string
}

// prepare loads the configuration and works out the databases. Errors are
// messages for the user (no DSN in them: it may hold a password).
func (c *dbCommand) prepare() (*target, error) {
	if len(c.fs.Args()) > 0 {
		return nil, fmt.Errorf("unexpected argument %q", c.fs.Arg(0))
	}
	// Only the rules and the connection keys are read: the file may be a
	// rules-only file when --dsn is given.
	cfg, err := config.LoadRules(*c.config)
	if err != nil {
		return nil, err
	}
	specs, err := rules.Specs(cfg.RulesConfig())
	if err != nil {
		return nil, fmt.Errorf("config %s: %w", *c.config, err)
	}
	t := &target{specs: specs, rules: cfg.RulesConfig(), guard: cfg.Guard}
	appName := "fenceproxy-" + c.name
	// The connection's database and user, with libpq's defaults for what
	// is not given: PGDATABASE, PGUSER, PGHOST, PGPORT, PGPASSWORD
	// (pgconn.ParseConfig reads them as libpq does), and the database
	// named like the user
	// (https://www.postgresql.org/docs/current/libpq-connect.html#LIBPQ-PARAMKEYWORDS).
	var dsnDatabase string
	switch {
	case c.dsn != "":
		cc, err := pgx.ParseConfig(c.dsn)
		if err != nil {
			return nil, errors.New("--dsn: not a valid connection string")
		}
		dsnDatabase, t.from = defaultDatabase(cc.Database, cc.User, "--dsn")
		t.connect = func(ctx context.Context, database string) (*pgx.Conn, error) {
			cc := cc.Copy()
			cc.Database = database
			if _, ok := cc.RuntimeParams["application_name"]; !ok {
				cc.RuntimeParams["application_name"] = appName
			}
			return connectDB(ctx, cc)
		}
	case cfg.Upstream.Address == "" && cfg.Audit.DSN == "":
		// A rules-only file: connect as psql would, from the PG*
		// environment alone.
		cc, err := pgx.ParseConfig("")
		if err != nil {
			return nil, fmt.Errorf("config %s has no upstream.address or audit.dsn, and the PG* environment variables do not parse: %w", *c.config, err)
		}
		dsnDatabase, t.from = defaultDatabase(cc.Database, cc.User, "the PG* environment")
		t.connect = func(ctx context.Context, database string) (*pgx.Conn, error) {
			cc := cc.Copy()
			cc.Database = database
			cc.RuntimeParams["application_name"] = appName
			return connectDB(ctx, cc)
		}
	default:
		user := ""
		if cfg.Audit.DSN != "" {
			pc, err := pgconn.ParseConfig(cfg.Audit.DSN)
			if err != nil {
				return nil, errors.New("audit.dsn: not a valid connection string")
			}
			dsnDatabase, t.from = defaultDatabase(pc.Database, pc.User, "audit.dsn")
		} else {
			// The audit connection's user postgres, unless PGUSER names
			// another, as it would for psql.
			user = os.Getenv("PGUSER")
			u := user
			if u == "" {
				u = "postgres"
			}
			dsnDatabase, t.from = u, "the user name (libpq's default database)"
			if db := os.Getenv("PGDATABASE"); db != "" {
				dsnDatabase, t.from = db, "from $PGDATABASE"
			}
		}
		t.connect = func(ctx context.Context, database string) (*pgx.Conn, error) {
			pc, err := cfg.AuditConnConfig(database)
			if err != nil {
				return nil, err
			}
			if user != "" {
				pc.User = user
			}
			// A pgx configuration must come from ParseConfig; its
			// connection part is then the audit connection's.
			cc, err := pgx.ParseConfig("")
			if err != nil {
				return nil, fmt.Errorf("PG* environment variables: %w", err)
			}
			cc.Config = *pc
			cc.RuntimeParams["application_name"] = appName
			return connectDB(ctx, cc)
		}
	}

	if len(c.databases) > 0 {
		t.databases = c.databases
		return t, nil
	}
	t.databases = dbsetup.Databases(specs, "")
	if len(t.databases) > 0 && t.databases[0] == "" {
		// Entries without scope.databases apply in every database: the
		// connection's is the one a single-database deployment means.
		t.databases = dbsetup.Databases(specs, dsnDatabase)
		t.unscoped = dsnDatabase
		for _, s := range specs {
			if s.Mode != rules.ModeOff && len(s.Scope.Databases) == 0 && !slices.Contains(t.unscopedTables, s.Display) {
				t.unscopedTables = append(t.unscopedTables, s.Display)
			}
		}
	}
	return t, nil
}

// defaultDatabase returns database, or libpq's default for it: the user
// name; and where it came from, for the message saying so.
func defaultDatabase(database, user, from string) (string, string) {
	if database != "" {
		return database, "the database of " + from
	}
	return user, "the user name of " + from + " (libpq's default database)"
}

// printDatabases says which databases the command works in, and why the
// connection's database is one of them.
func printDatabases(w io.Writer, t *target) {
	if t.unscoped == "" {
		return
	}
	fmt.Fprintf(w, "tables without scope.databases (%s): database %s, %s; name others with --database\n",
		strings.Join(t.unscopedTables, ", "), t.unscoped, t.from)
}

func connectDB(ctx context.Context, cc *pgx.ConnConfig) (*pgx.Conn, error) {
	ctx, cancel := context.WithTimeout(ctx, dbConnectTimeout)
	defer cancel()
	conn, err := pgx.ConnectConfig(ctx, cc)
	if err != nil {
		// pgconn's error names host, user and database, not the password.
		return nil, fmt.Errorf("cannot connect: %w", err)
	}
	return conn, nil
}

func closeConn(conn *pgx.Conn) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_ = conn.Close(ctx)
}

// setupMain implements `fenceproxy setup`.
func setupMain(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	c := newDBCommand("setup", setupUsage, stdout, stderr)
	var opts dbsetup.SetupOptions
	c.fs.BoolVar(&opts.AddColumns, "add-columns", false, "add missing fence columns (bigint NOT NULL DEFAULT 0) to the protected tables")
	c.fs.BoolVar(&opts.Guard, "guard", false, "install or update the database guard (triggers that fence the writes the proxy does not see)")
	c.fs.BoolVar(&opts.RemoveGuard, "remove-guard", false, "remove the database guard")
	if code, ok := c.parse(args); !ok {
		return code
	}
	if opts.Guard && opts.RemoveGuard {
		fmt.Fprintln(stderr, "fenceproxy setup: --guard and --remove-guard exclude each other")
		return exitUsage
	}
	t, err := c.prepare()
	if err != nil {
		fmt.Fprintf(stderr, "fenceproxy setup: %v\n", err)
		return exitFailed
	}
	opts.TokenSetting, opts.LockSetting, opts.Tables = t.rules.TokenSetting, t.rules.LockSetting, t.rules.Tables
	opts.ExemptRoles = t.guard.ExemptRoles
	if len(t.databases) == 0 {
		fmt.Fprintf(stdout, "no protected tables in %s (every entry is off): nothing to set up\n", *c.config)
		return 0
	}
	printDatabases(stdout, t)
	code := 0
	for _, db := range t.databases {
		rep, err := setupOne(ctx, t, db, opts)
		if err != nil {
			fmt.Fprintf(stderr, "fenceproxy setup: database %q: %v\n", db, err)
			code = exitFailed
			continue
		}
		if len(rep.Actions) == 0 {
			fmt.Fprintf(stdout, "database %s: nothing to do\n", db)
		} else {
			fmt.Fprintf(stdout, "database %s:\n", db)
			for _, a := range rep.Actions {
				fmt.Fprintf(stdout, "  %s\n", a)
			}
		}
		printNotes(stdout, rep.Notes)
	}
	return code
}

// printNotes prints notes, each under its table or the database's.
func printNotes(w io.Writer, notes []dbsetup.Note) {
	for _, n := range notes {
		if n.Table == "" {
			fmt.Fprintf(w, "  note: %s\n", n.Text)
		} else {
			fmt.Fprintf(w, "  note: %s: %s\n", n.Table, n.Text)
		}
	}
}

func setupOne(ctx context.Context, t *target, db string, opts dbsetup.SetupOptions) (dbsetup.Report, error) {
	conn, err := t.connect(ctx, db)
	if err != nil {
		return dbsetup.Report{}, err
	}
	defer closeConn(conn)
	return dbsetup.Setup(ctx, conn, t.specs, opts)
}

// checkMain implements `fenceproxy check`.
func checkMain(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	c := newDBCommand("check", checkUsage, stdout, stderr)
	if code, ok := c.parse(args); !ok {
		return code
	}
	t, err := c.prepare()
	if err != nil {
		fmt.Fprintf(stderr, "fenceproxy check: %v\n", err)
		return exitNotChecked
	}
	if len(t.databases) == 0 {
		fmt.Fprintf(stdout, "no protected tables in %s (every entry is off): nothing to check\n", *c.config)
		return 0
	}
	printDatabases(stdout, t)
	code := 0
	for _, db := range t.databases {
		rep, err := checkOne(ctx, t, db)
		if err != nil {
			fmt.Fprintf(stderr, "fenceproxy check: database %q: %v\n", db, err)
			code = exitNotChecked
			continue
		}
		switch n := len(rep.Problems); n {
		case 0:
			fmt.Fprintf(stdout, "database %s: ok\n", db)
		case 1:
			fmt.Fprintf(stdout, "database %s: 1 problem\n", db)
		default:
			fmt.Fprintf(stdout, "database %s: %d problems\n", db, n)
		}
		for _, p := range rep.Problems {
			where := p.Table
			if where == "" {
				where = "(database)"
			}
			fmt.Fprintf(stdout, "  %s: %s\n    fix: %s\n", where, p.Description, p.FixFor(*c.config))
		}
		printNotes(stdout, rep.Notes)
		if len(rep.Guarded) > 0 {
			fmt.Fprintf(stdout, "  guarded: %s\n", strings.Join(rep.Guarded, ", "))
		}
		if rep.Raisers {
			fmt.Fprintln(stdout, "  error raisers: in place (the proxy's fenced writes call them)")
		} else {
			fmt.Fprintln(stdout, "  error raisers: not usable (missing, changed, not callable by all, or changeable by other roles): fenceproxy setup installs them, and fenced writes then cost the server less")
		}
		if !rep.OK() && code == 0 {
			code = exitFailed
		}
	}
	return code
}

func checkOne(ctx context.Context, t *target, db string) (dbsetup.Report, error) {
	conn, err := t.connect(ctx, db)
	if err != nil {
		return dbsetup.Report{}, err
	}
	defer closeConn(conn)
	return dbsetup.CheckWith(ctx, conn, t.specs, dbsetup.CheckOptions{
		TokenSetting: t.rules.TokenSetting, LockSetting: t.rules.LockSetting, Tables: t.rules.Tables, ExemptRoles: t.guard.ExemptRoles})
}
