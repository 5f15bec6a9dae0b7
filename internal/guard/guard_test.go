package guard_test

import (
	"fmt"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/fenceproxy/fenceproxy/internal/dbsetup"
	"github.com/fenceproxy/fenceproxy/internal/rules"
	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// The database guard, exercised by sessions connected directly to
// PostgreSQL, as sessions that bypass the proxy are. They log in as
// guard_app, which may read and write the tables and nothing else.

const guardApp = "guard_app"

// guardDB creates a database with the tables of create (granted to
// guardApp) and runs setup --guard for tables.
func guardDB(t *testing.T, create string, tables []rules.Table, exempt ...string) (db string, admin *pgx.Conn) {
	t.Helper()
	db = newDatabase(t)
	admin = connect(t, db)
	createRole(t, admin, guardApp)
	execSQL(t, admin, create)
	execSQL(t, admin, "GRANT SELECT, INSERT, UPDATE, DELETE, TRUNCATE ON ALL TABLES IN SCHEMA public TO "+guardApp)
	guardSetup(t, admin, tables, exempt...)
	return db, admin
}

func guardSetup(t *testing.T, conn *pgx.Conn, tables []rules.Table, exempt ...string) dbsetup.Report {
	t.Helper()
	rep, err := dbsetup.Setup(t.Context(), conn, specs(t, tables...), dbsetup.SetupOptions{Guard: true, Tables: tables, ExemptRoles: exempt})
	if err != nil {
		t.Fatal(err)
	}
	return rep
}

func guardCheck(t *testing.T, conn *pgx.Conn, tables []rules.Table, exempt ...string) dbsetup.Report {
	t.Helper()
	rep, err := dbsetup.CheckWith(t.Context(), conn, specs(t, tables...), dbsetup.CheckOptions{Tables: tables, ExemptRoles: exempt})
	if err != nil {
		t.Fatal(err)
	}
	return rep
}

// wantState runs sql on conn and checks the SQLSTATE of its error ("" for
// success).
func wantState(t *testing.T, conn *pgx.Conn, sql, state string) {
	t.Helper()
	_, err := conn.Exec(t.Context(), sql)
	if got := sqlState(err); got != state {
		t.Errorf("%s: %v, want SQLSTATE %q", sql, err, state)
	}
}

// fences returns the fence column by id, as "id=fence" pairs.
func fences(t *testing.T, conn *pgx.Conn, table string) string {
	t.Helper()
	return strings.Join(testutil.QueryStrings(t, conn, "SELECT format('%s=%s', id, last_fence) FROM "+table+" ORDER BY id"), " ")
}

const configTable = "CREATE TABLE config (id int PRIMARY KEY, payload text NOT NULL DEFAULT '', last_fence bigint NOT NULL DEFAULT 0)"

// seed inserts rows into table with the given fences, in a session with
// each row's fence as token.
func seed(t *testing.T, db, table string, fences ...int64) {
	t.Helper()
	conn := connect(t, db, guardApp)
	for i, f := range fences {
		execSQL(t, conn, "SELECT set_config('fence.token', '"+strconv.FormatInt(f, 10)+"', false)")
		execSQL(t, conn, fmt.Sprintf("INSERT INTO %s (id) VALUES (%d)", table, i+1))
	}
}

// TestGuardRowFencing: without a token every write fails with FP002; a
// valid token stamps the row; an older one than the row's fence fails with
// FP001, also when the write comes from dynamic SQL in a function.
func TestGuardRowFencing(t *testing.T) {
	tables := []rules.Table{{Table: "public.config"}}
	db, admin := guardDB(t, configTable+`;
		CREATE FUNCTION set_payload(i int, p text) RETURNS void LANGUAGE plpgsql AS $$
		BEGIN EXECUTE format('UPDATE %I SET payload = $2 WHERE id = $1', 'config') USING i, p; END $$`, tables)
	seed(t, db, "config", 7)

	none := session(t, db, guardApp, "", "")
	for _, sql := range []string{
		"INSERT INTO config (id) VALUES (2)",
		"UPDATE config SET payload = 'x'",
		"DELETE FROM config",
		"SELECT set_payload(1, 'x')",
	} {
		wantState(t, none, sql, "FP002")
	}
	// Superusers are not exempt unless listed (pg_has_role would count
	// them as members of every role).
	wantState(t, admin, "UPDATE config SET payload = 'x'", "FP002")
	// Neither is a token that is not one.
	for _, tok := range []string{"abc", "0", "-1", "9223372036854775808"} {
		wantState(t, session(t, db, guardApp, "", tok), "UPDATE config SET payload = 'x'", "FP002")
	}

	stale := session(t, db, guardApp, "", "6")
	wantState(t, stale, "UPDATE config SET payload = 'stale'", "FP001")
	wantState(t, stale, "SELECT set_payload(1, 'stale')", "FP001")
	wantState(t, stale, "DELETE FROM config WHERE id = 1", "FP001")
	wantState(t, stale, "INSERT INTO config (id) VALUES (1) ON CONFLICT (id) DO UPDATE SET payload = 'stale'", "FP001")

	fresh := session(t, db, guardApp, "", "8")
	wantState(t, fresh, "SELECT set_payload(1, 'fresh')", "")
	wantState(t, fresh, "INSERT INTO config (id, last_fence) VALUES (2, 100)", "")
	if got := fences(t, admin, "config"); got != "1=8 2=8" {
		t.Errorf("fences %s, want both rows stamped with 8 (an INSERT cannot set the fence)", got)
	}
	wantState(t, fresh, "DELETE FROM config WHERE id = 2", "")

	var payload string
	if err := admin.QueryRow(t.Context(), "SELECT payload FROM config WHERE id = 1").Scan(&payload); err != nil || payload != "fresh" {
		t.Errorf("payload %q (%v), want fresh", payload, err)
	}

	// The largest token, zero-padded, is valid.
	wantState(t, session(t, db, guardApp, "", "09223372036854775807"), "INSERT INTO config (id) VALUES (3)", "")
	if got := fences(t, admin, "config"); got != "1=8 3=9223372036854775807" {
		t.Errorf("fences %s, want row 3 stamped with the largest token", got)
	}
}

// TestGuardStrict: with strict, a token writes a row once.
func TestGuardStrict(t *testing.T) {
	tables := []rules.Table{{Table: "public.config", Strict: true}}
	db, _ := guardDB(t, configTable, tables)
	seed(t, db, "config", 5)
	conn := session(t, db, guardApp, "", "5")
	wantState(t, conn, "UPDATE config SET payload = 'again'", "FP001")
	conn = session(t, db, guardApp, "", "6")
	wantState(t, conn, "UPDATE config SET payload = 'once'", "")
	wantState(t, conn, "UPDATE config SET payload = 'twice'", "FP001")
}

// TestGuardOnStaleSkip: with on_stale: skip, stale rows are left alone
// and not counted; the others are written.
func TestGuardOnStaleSkip(t *testing.T) {
	tables := []rules.Table{{Table: "public.config", OnStale: rules.OnStaleSkip}}
	db, admin := guardDB(t, configTable, tables)
	seed(t, db, "config", 10, 3, 10)
	conn := session(t, db, guardApp, "", "5")
	tag, err := conn.Exec(t.Context(), "UPDATE config SET payload = 'new'")
	if err != nil || tag.RowsAffected() != 1 {
		t.Fatalf("update: %v, %v; want 1 row", tag, err)
	}
	tag, err = conn.Exec(t.Context(), "DELETE FROM config WHERE id <> 2")
	if err != nil || tag.RowsAffected() != 0 {
		t.Fatalf("delete of the stale rows: %v, %v; want 0 rows", tag, err)
	}
	rows, err := admin.Query(t.Context(), "SELECT format('%s=%s:%s', id, last_fence, payload) FROM config ORDER BY id")
	if err != nil {
		t.Fatal(err)
	}
	got, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if want := []string{"1=10:", "2=5:new", "3=10:"}; err != nil || !slices.Equal(got, want) {
		t.Errorf("rows %q (%v), want %q", got, err, want)
	}
}

// TestGuardMissingTokenAllow: with missing_token: allow, a write without
// a token passes unfenced and cannot move the fence column.
func TestGuardMissingTokenAllow(t *testing.T) {
	tables := []rules.Table{{Table: "public.config", MissingToken: rules.MissingTokenAllow}}
	db, admin := guardDB(t, configTable, tables)
	seed(t, db, "config", 10)
	conn := session(t, db, guardApp, "", "")
	wantState(t, conn, "UPDATE config SET payload = 'x', last_fence = 99", "")
	wantState(t, conn, "INSERT INTO config (id, last_fence) VALUES (2, 99)", "")
	if got := fences(t, admin, "config"); got != "1=10 2=0" {
		t.Errorf("fences %s, want 1=10 2=0", got)
	}
	// A token still counts.
	wantState(t, session(t, db, guardApp, "", "9"), "UPDATE config SET payload = 'y' WHERE id = 1", "FP001")
}

// TestGuardCascade: a foreign key's ON DELETE CASCADE from an unprotected
// table into a protected one is fenced: the parent's delete fails when a
// child row's fence is newer than the token, and deletes both otherwise;
// TRUNCATE ... CASCADE is refused.
func TestGuardCascade(t *testing.T) {
	tables := []rules.Table{{Table: "public.child"}}
	db, admin := guardDB(t, `CREATE TABLE parent (id int PRIMARY KEY);
		CREATE TABLE child (id int PRIMARY KEY, parent int NOT NULL REFERENCES parent ON DELETE CASCADE,
			last_fence bigint NOT NULL DEFAULT 0);
		INSERT INTO parent VALUES (1)`, tables)
	conn := session(t, db, guardApp, "", "10")
	execSQL(t, conn, "INSERT INTO child (id, parent) VALUES (1, 1)")

	stale := session(t, db, guardApp, "", "9")
	wantState(t, stale, "DELETE FROM parent WHERE id = 1", "FP001")
	wantState(t, session(t, db, guardApp, "", ""), "DELETE FROM parent WHERE id = 1", "FP002")
	wantState(t, stale, "TRUNCATE parent CASCADE", "FP003")
	var n int
	if err := admin.QueryRow(t.Context(), "SELECT (SELECT count(*) FROM parent) + (SELECT count(*) FROM child)").Scan(&n); err != nil || n != 2 {
		t.Fatalf("%d rows (%v) after the refused deletes, want 2", n, err)
	}
	wantState(t, conn, "DELETE FROM parent WHERE id = 1", "")
	if err := admin.QueryRow(t.Context(), "SELECT (SELECT count(*) FROM parent) + (SELECT count(*) FROM child)").Scan(&n); err != nil || n != 0 {
		t.Errorf("%d rows (%v) after the fresh delete, want 0", n, err)
	}
}

// TestGuardLockRequired: a lock: required table without a fence column
// needs a lock name and a token; the guard registers the token for the
// lock (once per transaction), and a stale one fails with FP001.
func TestGuardLockRequired(t *testing.T) {
	tables := []rules.Table{{Table: "public.jobs", Lock: rules.LockRequired}}
	db, admin := guardDB(t, "CREATE TABLE jobs (id int PRIMARY KEY, state text)", tables)

	wantState(t, session(t, db, guardApp, "", "5"), "INSERT INTO jobs VALUES (1, 'new')", "FP002")
	wantState(t, session(t, db, guardApp, "locks/jobs", ""), "INSERT INTO jobs VALUES (1, 'new')", "FP002")
	if w := watermark(t, db, "locks/jobs"); w != 0 {
		t.Fatalf("watermark %d after refused writes, want none", w)
	}

	conn := session(t, db, guardApp, "locks/jobs", "5")
	execSQL(t, conn, "BEGIN")
	execSQL(t, conn, "INSERT INTO jobs SELECT g, 'new' FROM generate_series(1, 3) g")
	var memo string
	if err := conn.QueryRow(t.Context(), "SELECT current_setting('fenceproxy.guard_registered', true)").Scan(&memo); err != nil || memo != "locks/jobs\n5" {
		t.Errorf("registration memo %q (%v), want the lock and token", memo, err)
	}
	execSQL(t, conn, "COMMIT")
	if w := watermark(t, db, "locks/jobs"); w != 5 {
		t.Errorf("watermark %d, want 5", w)
	}

	wantState(t, session(t, db, guardApp, "locks/jobs", "4"), "UPDATE jobs SET state = 'stale'", "FP001")
	wantState(t, session(t, db, guardApp, "locks/jobs", "6"), "UPDATE jobs SET state = 'done'", "")
	if w := watermark(t, db, "locks/jobs"); w != 6 {
		t.Errorf("watermark %d, want 6", w)
	}
	var n int
	if err := admin.QueryRow(t.Context(), "SELECT count(*) FROM jobs WHERE state = 'done'").Scan(&n); err != nil || n != 3 {
		t.Errorf("%d rows done (%v), want 3", n, err)
	}
}

// TestGuardLockOptional: with a fence column and lock: optional, a
// session that names a lock is fenced by the lock as well as the row.
func TestGuardLockOptional(t *testing.T) {
	tables := []rules.Table{{Table: "public.config"}}
	db, _ := guardDB(t, configTable, tables)
	seed(t, db, "config", 1)
	wantState(t, session(t, db, guardApp, "locks/config", "8"), "UPDATE config SET payload = 'a'", "")
	// Fresh for the row (fence 8 is not newer than... 8), stale for the lock.
	wantState(t, session(t, db, guardApp, "locks/config", "7"), "INSERT INTO config (id) VALUES (2)", "FP001")
	if w := watermark(t, db, "locks/config"); w != 8 {
		t.Errorf("watermark %d, want 8", w)
	}
}

// TestGuardExempt: a login role that is a member of an exempt role writes
// without a token, and may TRUNCATE; others may not TRUNCATE.
func TestGuardExempt(t *testing.T) {
	tables := []rules.Table{{Table: "public.config", Lock: rules.LockRequired}}
	db, admin := guardDB(t, configTable, tables)
	execSQL(t, admin, `DO $$ BEGIN CREATE ROLE guard_migrations NOLOGIN; EXCEPTION WHEN duplicate_object THEN NULL; END $$;
		DO $$ BEGIN CREATE ROLE guard_migrator LOGIN; EXCEPTION WHEN duplicate_object THEN NULL; END $$;
		GRANT guard_migrations TO guard_migrator;
		GRANT ALL ON config TO guard_migrations`)
	rep := guardSetup(t, admin, tables, "guard_migrations")
	if !slices.Equal(rep.Actions, []string{"set the roles the guard exempts to guard_migrations"}) {
		t.Errorf("setup actions %q", rep.Actions)
	}

	m := session(t, db, "guard_migrator", "", "")
	wantState(t, m, "INSERT INTO config (id, last_fence) VALUES (1, 42)", "")
	wantState(t, m, "UPDATE config SET payload = 'migrated'", "")
	if got := fences(t, admin, "config"); got != "1=42" {
		t.Errorf("fences %s, want the exempt session's own value 1=42", got)
	}
	wantState(t, session(t, db, guardApp, "", ""), "TRUNCATE config", "FP003")
	wantState(t, admin, "TRUNCATE config", "FP003")
	wantState(t, m, "DELETE FROM config", "")
	wantState(t, m, "TRUNCATE config", "")
}

// TestGuardPartitioned: the guard of a partitioned table covers writes and
// TRUNCATE on its partitions named directly, including a partition
// attached later once setup has run again.
func TestGuardPartitioned(t *testing.T) {
	tables := []rules.Table{{Table: "public.events"}}
	db, admin := guardDB(t, `CREATE TABLE events (id int, last_fence bigint NOT NULL DEFAULT 0) PARTITION BY RANGE (id);
		CREATE TABLE events_1 PARTITION OF events FOR VALUES FROM (0) TO (100);
		CREATE TABLE events_2 PARTITION OF events FOR VALUES FROM (100) TO (200) PARTITION BY RANGE (id);
		CREATE TABLE events_2a PARTITION OF events_2 FOR VALUES FROM (100) TO (200)`, tables)
	execSQL(t, admin, "GRANT SELECT, INSERT, UPDATE, DELETE, TRUNCATE ON ALL TABLES IN SCHEMA public TO "+guardApp)
	if rep := guardCheck(t, admin, tables); !rep.OK() || !slices.Equal(rep.Guarded, []string{"public.events"}) {
		t.Fatalf("check: %+v", rep)
	}
	none := session(t, db, guardApp, "", "")
	wantState(t, none, "INSERT INTO events_1 (id) VALUES (1)", "FP002")
	wantState(t, none, "INSERT INTO events_2a (id) VALUES (101)", "FP002")
	wantState(t, session(t, db, guardApp, "", "3"), "INSERT INTO events_2a (id) VALUES (101)", "")
	for _, rel := range []string{"events", "events_1", "events_2", "events_2a"} {
		wantState(t, none, "TRUNCATE "+rel, "FP003")
	}
	wantState(t, session(t, db, guardApp, "", "2"), "UPDATE events_2a SET id = 5", "FP001")
	// A superuser the guard does not exempt can neither drop nor detach a
	// partition: either takes rows out of the guarded table.
	dba := connect(t, db, superRole(t, admin, "guard_dba"))
	for _, sql := range []string{"DROP TABLE events_1", "ALTER TABLE events DETACH PARTITION events_1", "DROP TABLE events_2a",
		"ALTER TABLE events_2a DISABLE TRIGGER fenceproxy_guard", "DROP TABLE events CASCADE"} {
		wantState(t, dba, sql, "FP003")
	}
	// DETACH ... CONCURRENTLY commits its first step before the event
	// trigger runs: refused, it leaves the partition detach-pending (out
	// of the parent's statements), still guarded, and FINALIZE is refused
	// too, until an exempt role or setup's finishes it.
	wantState(t, dba, "ALTER TABLE events DETACH PARTITION events_1 CONCURRENTLY", "FP003")
	wantState(t, dba, "ALTER TABLE events DETACH PARTITION events_1 FINALIZE", "FP003")
	wantState(t, none, "INSERT INTO events_1 (id) VALUES (2)", "FP002")
	execSQL(t, admin, "ALTER TABLE events DETACH PARTITION events_1 FINALIZE; ALTER TABLE events ATTACH PARTITION events_1 FOR VALUES FROM (0) TO (100)")
	if rep := guardCheck(t, admin, tables); !rep.OK() {
		t.Fatalf("check after events_1 came back: %+v", rep)
	}

	execSQL(t, admin, "CREATE TABLE events_3 (id int, last_fence bigint NOT NULL DEFAULT 0); ALTER TABLE events ATTACH PARTITION events_3 FOR VALUES FROM (200) TO (300)")
	rep := guardCheck(t, admin, tables)
	if len(rep.Problems) != 1 || !strings.Contains(rep.Problems[0].Description, "fenceproxy_guard_truncate of partition public.events_3 is missing") || len(rep.Guarded) != 0 {
		t.Fatalf("check after attaching a partition: %+v", rep)
	}
	if rep := guardSetup(t, admin, tables); !slices.Equal(rep.Actions, []string{"updated the guard on public.events"}) {
		t.Errorf("setup actions %q", rep.Actions)
	}
	if rep := guardCheck(t, admin, tables); !rep.OK() {
		t.Errorf("check after setup: %+v", rep)
	}
}

// TestGuardSetupAndCheck: a second setup --guard changes nothing; check
// finds the guard current, then reports it when the configuration
// changes, until setup --guard brings it in line; setup without --guard
// leaves it and says so; --remove-guard removes it all.
func TestGuardSetupAndCheck(t *testing.T) {
	tables := []rules.Table{{Table: "public.config"}, {Table: "public.jobs", Lock: rules.LockRequired}}
	db := newDatabase(t)
	admin := connect(t, db)
	execSQL(t, admin, configTable+"; CREATE TABLE jobs (id int PRIMARY KEY)")
	sp := specs(t, tables...)
	rep, err := dbsetup.Setup(t.Context(), admin, sp, dbsetup.SetupOptions{Guard: true, Tables: tables})
	if err != nil {
		t.Fatal(err)
	}
	want := []string{
		"created the fenceproxy schema and objects (version 10)",
		"installed the catalog watch (event triggers fenceproxy_catalog_ddl and fenceproxy_catalog_drop)",
		"installed the database guard (its functions and table fenceproxy.guard_exempt)",
		"installed the guard on public.config",
		"installed the guard on public.jobs",
		"installed the guard's event triggers (fenceproxy_guard_ddl, fenceproxy_guard_rewrite), which refuse DDL that drops a guarded table or weakens its guard",
	}
	if !slices.Equal(rep.Actions, want) {
		t.Errorf("first setup: %q, want %q", rep.Actions, want)
	}
	before := guardState(t, admin)
	if rep := guardSetup(t, admin, tables); len(rep.Actions) != 0 {
		t.Errorf("second setup: %q, want no actions", rep.Actions)
	}
	if after := guardState(t, admin); !slices.Equal(before, after) {
		t.Errorf("second setup changed the catalog:\nbefore %q\nafter  %q", before, after)
	}
	check := guardCheck(t, admin, tables)
	if !check.OK() || !slices.Equal(check.Guarded, []string{"public.config", "public.jobs"}) {
		t.Errorf("check: %+v", check)
	}
	// Check without options compares with the defaults, which these are.
	if check, err := dbsetup.Check(t.Context(), admin, sp); err != nil || !check.OK() || len(check.Guarded) != 2 {
		t.Errorf("Check: %+v, %v", check, err)
	}

	rep, err = dbsetup.Setup(t.Context(), admin, sp, dbsetup.SetupOptions{})
	if err != nil || len(rep.Actions) != 0 || len(rep.Notes) != 1 || !strings.Contains(rep.Notes[0].Text, "the database guard is installed on public.config, public.jobs and was left as it is") {
		t.Errorf("setup without --guard: %+v, %v", rep, err)
	}

	// on_stale changes: the guard's arguments are outdated.
	changed := []rules.Table{{Table: "public.config", OnStale: rules.OnStaleSkip}, tables[1]}
	check = guardCheck(t, admin, changed)
	if len(check.Problems) != 1 || check.Problems[0].Table != "public.config" ||
		!strings.Contains(check.Problems[0].Description, `function fenceproxy."guard_public.config" was made for an earlier configuration (guard of "public.config": column "last_fence", lock optional, on_stale error, strict false, missing_token reject, token_setting "fence.token", lock_setting "fence.lock"); it now needs guard of "public.config": column "last_fence", lock optional, on_stale skip,`) ||
		check.Problems[0].FixFor("fp.yaml") != "fenceproxy setup -c fp.yaml --guard" ||
		!slices.Equal(check.Guarded, []string{"public.jobs"}) {
		t.Errorf("check after a change: %+v", check)
	}
	if rep := guardSetup(t, admin, changed); !slices.Equal(rep.Actions, []string{"updated the guard on public.config"}) {
		t.Errorf("setup after a change: %q", rep.Actions)
	}
	if check := guardCheck(t, admin, changed); !check.OK() || len(check.Guarded) != 2 {
		t.Errorf("check after setup: %+v", check)
	}

	// A superuser the guard does not exempt, who does not own the
	// fenceproxy schema, cannot disable it: the event trigger undoes the
	// command.
	dba := connect(t, db, superRole(t, admin, "guard_dba"))
	for _, sql := range []string{"ALTER TABLE jobs DISABLE TRIGGER fenceproxy_guard", "DROP TABLE jobs", "DROP TRIGGER fenceproxy_guard_truncate ON jobs"} {
		wantState(t, dba, sql, "FP003")
	}
	if check := guardCheck(t, admin, changed); !check.OK() {
		t.Errorf("check after refused DDL: %+v", check)
	}
	// Disabled by setup's role: not guarded, setup enables it again.
	execSQL(t, admin, "ALTER TABLE jobs DISABLE TRIGGER fenceproxy_guard")
	if check := guardCheck(t, admin, changed); len(check.Problems) != 1 || !strings.Contains(check.Problems[0].Description, "fenceproxy_guard is disabled") {
		t.Errorf("check of a disabled guard: %+v", check)
	}
	guardSetup(t, admin, changed)

	// jobs leaves the configuration (audit mode): its guard goes, and so
	// does the function no other table uses.
	audited := []rules.Table{changed[0], {Table: "public.jobs", Lock: rules.LockRequired, Mode: rules.ModeAudit}}
	if check := guardCheck(t, admin, audited); len(check.Problems) != 1 || !strings.Contains(check.Problems[0].Description, "an entry in mode audit applies to it") {
		t.Errorf("check with jobs audited: %+v", check)
	}
	rep = guardSetup(t, admin, audited)
	want = []string{
		"removed the guard from public.jobs: the configuration does not guard it in this database",
		`dropped fenceproxy."guard_public.jobs"(), which no trigger uses any more`,
	}
	if !slices.Equal(rep.Actions, want) || len(rep.Notes) != 1 || rep.Notes[0].Table != "public.jobs" {
		t.Errorf("setup with jobs audited: %+v, want actions %q", rep, want)
	}

	rep, err = dbsetup.Setup(t.Context(), admin, sp, dbsetup.SetupOptions{RemoveGuard: true})
	want = []string{"removed the guard's event triggers (fenceproxy_guard_ddl, fenceproxy_guard_rewrite)", "removed the guard from public.config", "removed the database guard's functions and its table of exempt roles"}
	if err != nil || !slices.Equal(rep.Actions, want) {
		t.Errorf("setup --remove-guard: %+v, %v; want %q", rep, err, want)
	}
	if check := guardCheck(t, admin, tables); !check.OK() || len(check.Guarded) != 0 {
		t.Errorf("check after --remove-guard: %+v", check)
	}
	if left := guardState(t, admin); len(left) != 0 {
		t.Errorf("left after --remove-guard: %q", left)
	}
}

// guardState describes the guard's catalog rows with the transactions
// that wrote them.
func guardState(t *testing.T, conn *pgx.Conn) []string {
	t.Helper()
	state := testutil.QueryStrings(t, conn, `
		SELECT format('trigger %s %s %s %s', tgrelid::regclass, tgname, xmin, tgenabled) FROM pg_trigger WHERE tgname LIKE 'fenceproxy_guard%'
		UNION ALL
		SELECT format('function %s %s', proname, xmin) FROM pg_proc WHERE pronamespace = 'fenceproxy'::regnamespace AND proname LIKE 'guard%'
		UNION ALL
		SELECT format('relation %s %s', relname, xmin) FROM pg_class WHERE relnamespace = 'fenceproxy'::regnamespace AND relname LIKE 'guard%'
		UNION ALL
		SELECT format('meta %s %s', xmin, value) FROM fenceproxy.meta WHERE key = 'guard'
		ORDER BY 1`)
	return state
}

// TestGuardNotEverywhere: tables whose entries are scoped to some
// sessions, or audited, are not guarded; setup says why.
func TestGuardNotEverywhere(t *testing.T) {
	tables := []rules.Table{
		{Table: "public.config", Scope: rules.Scope{ApplicationNames: []string{"billing"}}},
		{Table: "public.jobs", Mode: rules.ModeAudit},
		{Table: "public.staged", Scope: rules.Scope{ApplicationNames: []string{"billing"}}},
		{Table: "public.staged", Mode: rules.ModeAudit},
	}
	db := newDatabase(t)
	admin := connect(t, db)
	execSQL(t, admin, configTable+"; CREATE TABLE jobs (id int, last_fence bigint NOT NULL DEFAULT 0); CREATE TABLE staged (id int, last_fence bigint NOT NULL DEFAULT 0)")
	rep := guardSetup(t, admin, tables)
	var notes []string
	for _, n := range rep.Notes {
		notes = append(notes, n.Table+": "+n.Text)
	}
	want := []string{
		"public.config: not guarded: its entries apply only to some sessions (scope.users or scope.application_names), and the guard would fence every session",
		"public.jobs: not guarded: an entry in mode audit applies to it (audit never refuses a write; the guard would)",
		"public.staged: not guarded: an entry in mode audit applies to it (audit never refuses a write; the guard would)",
	}
	if !slices.Equal(notes, want) || slices.ContainsFunc(rep.Actions, func(a string) bool { return strings.HasPrefix(a, "installed the guard on") }) {
		t.Errorf("setup: actions %q, notes %q; want notes %q", rep.Actions, notes, want)
	}
}

// TestGuardExemptRoleMissing: setup names the roles that do not exist and
// changes nothing.
func TestGuardExemptRoleMissing(t *testing.T) {
	db := newDatabase(t)
	admin := connect(t, db)
	execSQL(t, admin, configTable)
	tables := []rules.Table{{Table: "public.config"}}
	_, err := dbsetup.Setup(t.Context(), admin, specs(t, tables...), dbsetup.SetupOptions{Guard: true, ExemptRoles: []string{"guard_nobody", "guard_noone"}})
	if err == nil || !strings.Contains(err.Error(), "guard.exempt_roles: no such role: guard_nobody, guard_noone") {
		t.Fatalf("setup: %v, want an error naming both roles", err)
	}
	var schema bool
	if err := admin.QueryRow(t.Context(), "SELECT EXISTS (SELECT FROM pg_namespace WHERE nspname = 'fenceproxy')").Scan(&schema); err != nil || schema {
		t.Errorf("the failed setup left the schema (%v)", err)
	}
}

// TestGuardOddColumnName: a fence column whose name needs quoting, and
// holds the dollar quote of a function body.
func TestGuardOddColumnName(t *testing.T) {
	tables := []rules.Table{{Table: `public."Odd Table"`, Column: `"Fence $body$ ""x"""`}}
	db, admin := guardDB(t, `CREATE TABLE "Odd Table" (id int PRIMARY KEY, "Fence $body$ ""x""" bigint NOT NULL DEFAULT 0)`, tables)
	conn := session(t, db, guardApp, "", "4")
	wantState(t, conn, `INSERT INTO "Odd Table" (id) VALUES (1)`, "")
	wantState(t, session(t, db, guardApp, "", "3"), `UPDATE "Odd Table" SET id = 2`, "FP001")
	if rep := guardCheck(t, admin, tables); !rep.OK() || !slices.Equal(rep.Guarded, []string{`public."Odd Table"`}) {
		t.Errorf("check: %+v", rep)
	}
	if rep := guardSetup(t, admin, tables); len(rep.Actions) != 0 {
		t.Errorf("second setup: %q", rep.Actions)
	}
}
