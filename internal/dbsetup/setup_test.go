package dbsetup_test

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/fenceproxy/fenceproxy/internal/dbsetup"
	"github.com/fenceproxy/fenceproxy/internal/rules"
	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// objectsState reads what setup installs, with the transaction IDs that
// wrote the catalog rows, so that a setup that rewrote a row with the same
// contents shows too.
func objectsState(t *testing.T, conn *pgx.Conn) []string {
	t.Helper()
	state := testutil.QueryStrings(t, conn, `
		SELECT format('schema %s %s', n.xmin, n.nspacl) FROM pg_namespace n WHERE nspname = 'fenceproxy'
		UNION ALL
		SELECT format('relation %s %s %s', c.relname, c.xmin, c.relacl) FROM pg_class c
		WHERE c.relnamespace = 'fenceproxy'::regnamespace
		UNION ALL
		SELECT format('routine %s %s %s', p.xmin, p.proacl, pg_get_functiondef(p.oid)) FROM pg_proc p
		WHERE p.pronamespace = 'fenceproxy'::regnamespace
		UNION ALL
		SELECT format('meta %s %s=%s', m.xmin, m.key, m.value) FROM fenceproxy.meta m
		UNION ALL
		SELECT format('column %s %s %s %s', a.attrelid::regclass, a.attname, a.xmin, format_type(a.atttypid, a.atttypmod))
		FROM pg_attribute a WHERE a.attrelid = 'public.config'::regclass AND a.attnum > 0
		ORDER BY 1`)
	return state
}

// TestSetupTwice: the first setup installs the objects and adds the column;
// the second reports nothing to do and leaves every catalog row as it was;
// check passes after either.
func TestSetupTwice(t *testing.T) {
	db := newDatabase(t)
	conn := connect(t, db)
	execSQL(t, conn, "CREATE TABLE config (id int PRIMARY KEY, payload text)")
	sp := specs(t, rules.Table{Table: "public.config"})

	rep, err := dbsetup.Setup(t.Context(), conn, sp, dbsetup.SetupOptions{AddColumns: true})
	if err != nil {
		t.Fatal(err)
	}
	want := []string{
		"created the fenceproxy schema and objects (version 10)",
		"installed the catalog watch (event triggers fenceproxy_catalog_ddl and fenceproxy_catalog_drop)",
		"added column last_fence bigint NOT NULL DEFAULT 0 to public.config",
	}
	if rep.Database != db || rep.Version != 0 || !slices.Equal(rep.Actions, want) {
		t.Fatalf("first setup: %+v, want actions %q in %s", rep, want, db)
	}
	before := objectsState(t, conn)

	rep, err = dbsetup.Setup(t.Context(), conn, sp, dbsetup.SetupOptions{AddColumns: true})
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.Actions) != 0 || rep.Version != dbsetup.Version {
		t.Errorf("second setup: %+v, want no actions", rep)
	}
	if after := objectsState(t, conn); !slices.Equal(before, after) {
		t.Errorf("second setup changed the objects:\nbefore %q\nafter  %q", before, after)
	}
	check, err := dbsetup.Check(t.Context(), conn, sp)
	if err != nil {
		t.Fatal(err)
	}
	if !check.OK() || check.Version != dbsetup.Version {
		t.Errorf("check after setup: %+v", check)
	}
	if !check.Hold || !check.Enter || !check.HoldAt || !check.ReholdAt {
		t.Errorf("check after setup: hold %t, enter %t, hold_at %t, rehold_at %t; want all callable", check.Hold, check.Enter, check.HoldAt, check.ReholdAt)
	}
}

// TestSetupWithoutAddColumns installs the objects only and notes the
// missing column, which check reports until setup --add-columns adds it.
func TestSetupWithoutAddColumns(t *testing.T) {
	db := newDatabase(t)
	conn := connect(t, db)
	execSQL(t, conn, "CREATE TABLE config (id int PRIMARY KEY)")
	sp := specs(t, rules.Table{Table: "public.config"}, rules.Table{Table: "public.elsewhere"})

	rep, err := dbsetup.Setup(t.Context(), conn, sp, dbsetup.SetupOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.Actions) != 2 || len(rep.Notes) != 2 ||
		rep.Notes[0] != (dbsetup.Note{Table: "public.config", Text: "fence column last_fence is missing: setup adds it with --add-columns"}) ||
		rep.Notes[1].Table != "public.elsewhere" {
		t.Errorf("setup: %+v", rep)
	}
	check, err := dbsetup.Check(t.Context(), conn, sp)
	if err != nil {
		t.Fatal(err)
	}
	if len(check.Problems) != 1 || !strings.Contains(check.Problems[0].Description, "last_fence is missing") {
		t.Fatalf("check: %+v", check)
	}
	if _, err := dbsetup.Setup(t.Context(), conn, sp, dbsetup.SetupOptions{AddColumns: true}); err != nil {
		t.Fatal(err)
	}
	if check, err = dbsetup.Check(t.Context(), conn, sp); err != nil || !check.OK() {
		t.Errorf("check after --add-columns: %+v, %v", check, err)
	}
}

// TestSetupRefusesDowngrade: objects of a newer version stay as they are.
func TestSetupRefusesDowngrade(t *testing.T) {
	db := newDatabase(t)
	conn := connect(t, db)
	execSQL(t, conn, "CREATE TABLE config (id int PRIMARY KEY)")
	sp := specs(t, rules.Table{Table: "public.config"})
	if _, err := dbsetup.Setup(t.Context(), conn, sp, dbsetup.SetupOptions{}); err != nil {
		t.Fatal(err)
	}
	execSQL(t, conn, "UPDATE fenceproxy.meta SET value = '11' WHERE key = 'version'")

	rep, err := dbsetup.Setup(t.Context(), conn, sp, dbsetup.SetupOptions{AddColumns: true})
	var newer *dbsetup.NewerError
	if !errors.As(err, &newer) || newer.Found != 11 {
		t.Fatalf("setup over version 11: %+v, %v; want a NewerError", rep, err)
	}
	if msg := err.Error(); !strings.Contains(msg, "version 11") || !strings.Contains(msg, "version 10") {
		t.Errorf("error %q does not name both versions", msg)
	}
	var version string
	var columns int
	if err := conn.QueryRow(t.Context(), `SELECT (SELECT value FROM fenceproxy.meta WHERE key = 'version'),
		(SELECT count(*) FROM pg_attribute WHERE attrelid = 'config'::regclass AND attname = 'last_fence')`).Scan(&version, &columns); err != nil {
		t.Fatal(err)
	}
	if version != "11" || columns != 0 {
		t.Errorf("after the refused setup: version %s, %d fence columns; want 11 and 0", version, columns)
	}
}

// TestConcurrentSetups: two setups that start while a third holds the
// setup lock both succeed, one after the other; exactly one installs.
func TestConcurrentSetups(t *testing.T) {
	db := newDatabase(t)
	admin := connect(t, db)
	execSQL(t, admin, "CREATE TABLE config (id int PRIMARY KEY)")
	sp := specs(t, rules.Table{Table: "public.config"})

	// Hold the setup lock so that both setups are sure to contend for it.
	holder := connect(t, db)
	execSQL(t, holder, "BEGIN")
	if _, err := holder.Exec(t.Context(), "SELECT pg_advisory_xact_lock($1)", setupLockKey); err != nil {
		t.Fatal(err)
	}

	type result struct {
		rep dbsetup.Report
		err error
	}
	results := make(chan result, 2)
	var pids []uint32
	for range 2 {
		conn := connect(t, db)
		pids = append(pids, conn.PgConn().PID())
		go func() {
			rep, err := dbsetup.Setup(t.Context(), conn, sp, dbsetup.SetupOptions{AddColumns: true})
			results <- result{rep, err}
		}()
	}
	waitForLockWait(t, admin, pids...)
	execSQL(t, holder, "COMMIT")

	var actions [][]string
	for range 2 {
		r := <-results
		if r.err != nil {
			t.Fatal(r.err)
		}
		actions = append(actions, r.rep.Actions)
	}
	slices.SortFunc(actions, func(a, b []string) int { return len(b) - len(a) })
	if len(actions[0]) != 3 || len(actions[1]) != 0 {
		t.Errorf("actions %q; want one setup to do everything and the other nothing", actions)
	}
}

// setupLockKey is the advisory lock key Setup takes ("FPSETUP1").
const setupLockKey int64 = 0x4650_5345_5455_5031

// waitForLockWait waits until each backend in pids waits for a lock, as
// pg_locks shows.
func waitForLockWait(t *testing.T, conn *pgx.Conn, pids ...uint32) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	for {
		var n int
		err := conn.QueryRow(ctx, "SELECT count(DISTINCT pid) FROM pg_locks WHERE NOT granted AND pid = ANY($1)", pids).Scan(&n)
		if err != nil {
			t.Fatalf("waiting for backends %v to wait for a lock: %v", pids, err)
		}
		if n == len(pids) {
			return
		}
		select {
		case <-ctx.Done():
			t.Fatalf("backends %v never waited for a lock", pids)
		case <-time.After(10 * time.Millisecond):
		}
	}
}

func TestDatabases(t *testing.T) {
	tbl := func(name, mode string, dbs ...string) rules.Table {
		return rules.Table{Table: name, Mode: mode, Scope: rules.Scope{Databases: dbs}}
	}
	for _, tc := range []struct {
		name   string
		tables []rules.Table
		dsn    string
		want   []string
	}{
		{"unscoped", []rules.Table{tbl("public.a", "")}, "app", []string{"app"}},
		{"scoped", []rules.Table{tbl("public.a", "", "x", "y"), tbl("public.b", "", "y", "z")}, "app", []string{"x", "y", "z"}},
		{"both", []rules.Table{tbl("public.a", "", "x"), tbl("public.b", "")}, "app", []string{"app", "x"}},
		{"off entries need nothing", []rules.Table{tbl("public.a", "off"), tbl("public.b", "off", "x"), tbl("public.c", "", "y")}, "app", []string{"y"}},
		{"no dsn database", []rules.Table{tbl("public.a", "")}, "", []string{""}},
		{"none", nil, "app", nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := dbsetup.Databases(specs(t, tc.tables...), tc.dsn); !slices.Equal(got, tc.want) {
				t.Errorf("Databases = %q, want %q", got, tc.want)
			}
		})
	}
}
