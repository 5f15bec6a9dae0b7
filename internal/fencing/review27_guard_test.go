package fencing_test

import (
	"fmt"
	"slices"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/fenceproxy/fenceproxy/internal/dbsetup"
	"github.com/fenceproxy/fenceproxy/internal/rules"
	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// Adversarial review of the database guard's DDL event trigger
// (fenceproxy_guard_ddl): as the non-superuser owner of the guarded
// table, stored code whose DDL is built at run time (so the proxy sees
// only the call), called through the proxy, tries to drop, empty, detach
// or neutralise the guarded table. Every outcome is read back on a direct
// superuser connection.

// review27GuardEnv is one database whose public.acct is owned by owner,
// has fences 42 on its three rows and the guard (setup as a superuser, so
// with its event trigger); c is the owner's session through the proxy, d
// a direct superuser connection.
type review27GuardEnv struct {
	db, owner string
	c, d      *pgx.Conn
	before    rowSet
	guard     []string
}

func review27Guard(t *testing.T, e *env) *review27GuardEnv {
	t.Helper()
	ctx := ctxT(t)
	specs, err := rules.Specs(testRules)
	if err != nil {
		t.Fatal(err)
	}
	db := e.newDB(t)
	owner := "fp_r27_" + db
	if err := cluster.Exec(ctx, fmt.Sprintf("CREATE ROLE %s LOGIN", owner)); err != nil {
		t.Fatal(err)
	}
	d := ownedSetup(t, db, owner)
	setFences(t, d, tError, map[int64]int64{1: 42, 2: 42, 3: 42})
	if _, err := dbsetup.Setup(ctx, d, specs, dbsetup.SetupOptions{Guard: true, Tables: testRules.Tables}); err != nil {
		t.Fatal(err)
	}
	g := &review27GuardEnv{db: db, owner: owner, d: d, before: snapshot(t, d, tError), guard: guardTriggers(t, d)}
	if len(g.guard) != 2 {
		t.Fatalf("the guard's triggers on acct: %q", g.guard)
	}
	g.c = connectDSN(t, e.proxy.DSN(owner, "", db))
	return g
}

// asOwner runs sql on the direct connection as the owner.
func (g *review27GuardEnv) asOwner(t *testing.T, sql string) {
	t.Helper()
	if _, err := g.d.PgConn().Exec(ctxT(t), "SET ROLE "+g.owner+"; "+sql+"; RESET ROLE").ReadAll(); err != nil {
		_, _ = g.d.Exec(ctxT(t), "RESET ROLE")
		t.Fatalf("as the owner: %s: %v", sql, err)
	}
}

// call creates (directly, as the owner) a function whose body is body and
// calls it through the proxy, simple protocol; it returns the call's
// error.
func (g *review27GuardEnv) call(t *testing.T, name, body string) error {
	t.Helper()
	g.asOwner(t, "CREATE FUNCTION "+name+"() RETURNS void LANGUAGE plpgsql AS $f$ BEGIN "+body+"; END $f$")
	_, err := g.c.PgConn().Exec(ctxT(t), "SELECT "+name+"()").ReadAll()
	return err
}

// intact checks directly that acct exists with its rows, unchanged, and
// the guard's triggers as setup left them, and that a stale write of the
// owner's on a direct connection is refused (FP001) and changes nothing.
func (g *review27GuardEnv) intact(t *testing.T) {
	t.Helper()
	if !tableExists(t, g.d, tError) {
		t.Fatal("acct was dropped")
	}
	wantUnchanged(t, g.d, tError, g.before)
	if got := guardTriggers(t, g.d); !slices.Equal(got, g.guard) {
		t.Fatalf("the guard's triggers are %q, were %q", got, g.guard)
	}
	g.staleRefused(t)
}

// staleRefused: a write with token 41 (below every fence, 42) on a direct
// connection as the owner is refused with FP001, and acct is unchanged.
func (g *review27GuardEnv) staleRefused(t *testing.T) {
	t.Helper()
	stale := direct(t, g.db)
	_, err := stale.PgConn().Exec(ctxT(t), "SET ROLE "+g.owner+"; SET fence.token = '41'; UPDATE public.acct SET payload = 'stale' WHERE id = 1").ReadAll()
	if sqlState(err) != "FP001" {
		t.Errorf("a stale write (token 41, fences 42): %v, want FP001", err)
	}
	after := snapshot(t, g.d, tError)
	if after[1].Payload == "stale" {
		t.Fatalf("the stale write landed: %v", after)
	}
}

// TestReview27GuardHeld: DDL built at run time in stored code, called
// through the proxy by the table's owner, that reaches the guarded table
// only indirectly (after a rename, a move to another schema, through a
// parent it was made to inherit from or a partitioned table it was
// attached to, DROP OWNED in a SECURITY DEFINER function of another role,
// a procedure that commits after the DDL, a savepoint that swallows the
// error), is undone (FP003) or refused, and acct keeps its rows and guard.
func TestReview27GuardHeld(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	e := startEnv(t)
	cases := []struct {
		name  string
		setup string // as the owner, directly, before
		body  string
		code  string // the call's SQLSTATE
	}{
		{"rename then drop", "",
			`EXECUTE 'ALT' || 'ER TABLE public.ac' || 'ct REN' || 'AME TO fp_x'; EXECUTE 'DR' || 'OP TABLE public.fp_x'`, "FP003"},
		{"set schema then drop schema cascade", "",
			`EXECUTE 'ALT' || 'ER TABLE public.ac' || 'ct SET SCH' || 'EMA fp_ext'; EXECUTE 'DR' || 'OP SCHEMA fp_ext CAS' || 'CADE'`, "FP003"},
		{"inherit then truncate parent", "CREATE TABLE public.fp_par (LIKE public.fp_par0)",
			`EXECUTE 'ALT' || 'ER TABLE public.ac' || 'ct INH' || 'ERIT public.fp_par'; EXECUTE 'TRUN' || 'CATE public.fp_par'`, "FP003"},
		{"inherit then drop parent cascade", "CREATE TABLE public.fp_par (LIKE public.fp_par0)",
			`EXECUTE 'ALT' || 'ER TABLE public.ac' || 'ct INH' || 'ERIT public.fp_par'; EXECUTE 'DR' || 'OP TABLE public.fp_par CAS' || 'CADE'`, "FP003"},
		{"attach to a partitioned table then truncate it", "CREATE TABLE public.fp_pt (LIKE public.fp_par0) PARTITION BY RANGE (id)",
			`EXECUTE 'ALT' || 'ER TABLE public.fp_pt ATT' || 'ACH PARTITION public.ac' || 'ct FOR VALUES FROM (0) TO (100)'; EXECUTE 'TRUN' || 'CATE public.fp_pt'`, "FP003"},
		{"attach to a partitioned table then drop it", "CREATE TABLE public.fp_pt (LIKE public.fp_par0) PARTITION BY RANGE (id)",
			`EXECUTE 'ALT' || 'ER TABLE public.fp_pt ATT' || 'ACH PARTITION public.ac' || 'ct FOR VALUES FROM (0) TO (100)'; EXECUTE 'DR' || 'OP TABLE public.fp_pt'`, "FP003"},
		// The owner's session is not exempt because another role's
		// function runs the drop.
		{"drop owned in another role's security definer function", "",
			`EXECUTE 'SEL' || 'ECT public.fp_secdef()'`, "FP003"},
		// The error is caught in a block: the block's subtransaction,
		// the drop with it, is rolled back; the call succeeds.
		{"savepoint swallows the refusal", "",
			`BEGIN EXECUTE 'DR' || 'OP TABLE public.ac' || 'ct'; EXCEPTION WHEN OTHERS THEN RAISE NOTICE 'caught %', SQLSTATE; END`, ""},
		// A trigger that sorts before the guard's cannot lower the
		// watermark: the guard, after it, stamps the token.
		{"a trigger before the guard lowers the fence", "",
			`EXECUTE 'CREATE TRIGGER a_first BEF' || 'ORE INSERT OR UPDATE ON public.ac' || 'ct FOR EACH ROW EXECUTE FUNCTION public.fp_zero()'`, ""},
		// session_replication_role (replica: no 'O' trigger fires)
		// is superuser-only, as is an event trigger.
		{"session_replication_role", "",
			`PERFORM pg_catalog.set_config('session_replication_role', 'replica', false)`, "42501"},
		{"disable the event trigger", "",
			`EXECUTE 'ALT' || 'ER EVENT TRIGGER fenceproxy_guard_ddl DIS' || 'ABLE'`, "42501"},
		{"another event trigger", "",
			`EXECUTE 'CREATE EVENT TRIGGER fp_et ON ddl_command_start EXECUTE FUNCTION public.fp_noop_et()'`, "42501"},
		{"replace the guard's function", "",
			`EXECUTE 'CREATE OR REPLACE FUNCTION fenceproxy."guard_public.ac' || 'ct"() RETURNS trigger LANGUAGE plpgsql AS ''BEGIN RETURN NEW; END'''`, "42501"},
	}
	for i, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			g := review27Guard(t, e)
			g.asOwner(t, `CREATE TABLE public.fp_par0 (id bigint, payload text, n int, last_fence bigint, dom public.fp_dom);
				CREATE FUNCTION public.fp_zero() RETURNS trigger LANGUAGE plpgsql AS $$BEGIN NEW.last_fence := 0; RETURN NEW; END$$;
				CREATE FUNCTION public.fp_noop_et() RETURNS event_trigger LANGUAGE plpgsql AS $$BEGIN END$$`)
			// Another role's SECURITY DEFINER function that drops
			// what the owner owns.
			other := g.owner + "_def"
			if err := cluster.Exec(ctxT(t), "CREATE ROLE "+other); err != nil {
				t.Fatal(err)
			}
			if _, err := g.d.Exec(ctxT(t), fmt.Sprintf(`GRANT %[1]s TO %[2]s; GRANT CREATE ON SCHEMA public TO %[2]s; SET ROLE %[2]s;
				CREATE FUNCTION public.fp_secdef() RETURNS void LANGUAGE plpgsql SECURITY DEFINER AS $f$ BEGIN EXECUTE 'DR' || 'OP OW' || 'NED BY %[1]s'; END $f$;
				RESET ROLE`, g.owner, other)); err != nil {
				t.Fatal(err)
			}
			if tc.setup != "" {
				g.asOwner(t, tc.setup)
			}
			err := g.call(t, fmt.Sprintf("fp_r27_%d", i), tc.body)
			if code := sqlState(err); code != tc.code {
				t.Errorf("call: %v (SQLSTATE %q), want %q", err, code, tc.code)
			}
			if tc.name == "a trigger before the guard lowers the fence" {
				// A fenced write with token 50 stamps 50, despite the
				// trigger.
				g.asOwner(t, "CREATE FUNCTION public.fp_r27_w() RETURNS void LANGUAGE plpgsql AS $f$ BEGIN EXECUTE 'UPD' || 'ATE public.ac' || 'ct SET n = n + 1 WHERE id = 1'; END $f$")
				if _, err := g.c.PgConn().Exec(ctxT(t), "SET fence.token = '50'; SELECT public.fp_r27_w()").ReadAll(); err != nil {
					t.Fatal(err)
				}
				wantRow(t, g.d, tError, 1, 1, 50)
				g.staleRefused(t)
				return
			}
			g.intact(t)
		})
	}
}

// TestReview27GuardProcedureCommit: a procedure that drops the guarded
// table and then COMMITs (a non-atomic CALL through the proxy): the event
// trigger runs at the end of the DROP, in its transaction, so the drop
// is undone before the COMMIT is reached.
func TestReview27GuardProcedureCommit(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	e := startEnv(t)
	g := review27Guard(t, e)
	g.asOwner(t, `CREATE PROCEDURE public.fp_r27_p() LANGUAGE plpgsql AS $f$ BEGIN
		EXECUTE 'DR' || 'OP TRIGGER fenceproxy_gu' || 'ard ON public.ac' || 'ct'; COMMIT;
		EXECUTE 'DR' || 'OP TABLE public.ac' || 'ct'; COMMIT; END $f$`)
	_, err := g.c.PgConn().Exec(ctxT(t), "CALL public.fp_r27_p()").ReadAll()
	wantCode(t, err, "FP003")
	g.intact(t)
}

// review27GuardHoles are DDL, built at run time and called through the
// proxy by the owner, that keep every recorded trigger (so the event
// trigger lets them pass) and yet neutralise the fence: afterwards a
// stale write (token 41 against fences of 42) lands. setup runs as the
// owner, directly, first.
var review27GuardHoles = []struct{ name, setup, body string }{
	// The USING rewrite writes every row without firing a row trigger:
	// each row's watermark becomes 0.
	{"retype the fence column USING 0", "",
		`EXECUTE 'ALT' || 'ER TABLE public.ac' || 'ct ALT' || 'ER COLUMN last_fence TYPE bigint USING 0'`},
	// The guard's function reads the column by name at run time: a new
	// column of that name, all 0, is the watermark now.
	{"rename the fence column, add a new one", "",
		`EXECUTE 'ALT' || 'ER TABLE public.ac' || 'ct REN' || 'AME COLUMN last_fence TO lf_old'; ` +
			`EXECUTE 'ALT' || 'ER TABLE public.ac' || 'ct ADD COLUMN last_fence bigint NOT NULL DEFAULT 0'`},
	{"drop the fence column, add a new one", "",
		`EXECUTE 'ALT' || 'ER TABLE public.ac' || 'ct DR' || 'OP COLUMN last_fence'; ` +
			`EXECUTE 'ALT' || 'ER TABLE public.ac' || 'ct ADD COLUMN last_fence bigint NOT NULL DEFAULT 0'`},
	// A BEFORE row trigger that sorts after fenceproxy_guard runs after
	// it and may set NEW.last_fence: every write through the guard then
	// stores 0.
	{"a trigger after the guard zeroes the fence",
		`CREATE FUNCTION public.fp_zero() RETURNS trigger LANGUAGE plpgsql AS $$BEGIN NEW.last_fence := 0; RETURN NEW; END$$`,
		`EXECUTE 'CREATE TRIGGER zz_after BEF' || 'ORE INSERT OR UPDATE ON public.ac' || 'ct FOR EACH ROW EXECUTE FUNCTION public.fp_zero()'; ` +
			`EXECUTE 'UPD' || 'ATE public.ac' || 'ct SET n = n + 1'`},
}

// TestReview27GuardFenceReset: DDL that keeps the guard's triggers but
// would reset or override the fence column (review27GuardHoles): each
// case asserts that either the DDL is refused (FP003) or the stale write
// that follows still is (FP001). The guard's event triggers refuse all of
// them (guard_relations, table_rewrite); before they did, each passed.
func TestReview27GuardFenceReset(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	e := startEnv(t)
	for i, h := range review27GuardHoles {
		t.Run(h.name, func(t *testing.T) {
			g := review27Guard(t, e)
			if h.setup != "" {
				g.asOwner(t, h.setup)
			}
			// With token 50 set, for the trigger case's own UPDATE.
			if _, err := g.c.PgConn().Exec(ctxT(t), "SET fence.token = '50'").ReadAll(); err != nil {
				t.Fatal(err)
			}
			err := g.call(t, fmt.Sprintf("fp_r27_h%d", i), h.body)
			if sqlState(err) == "FP003" {
				g.intact(t)
				return
			}
			if err != nil {
				t.Fatalf("call: %v", err)
			}
			t.Logf("the DDL passed; acct now %v", snapshot(t, g.d, tError))
			g.staleRefused(t)
		})
	}
}

// TestReview27GuardSetUnlogged: ALTER TABLE ... SET UNLOGGED keeps the
// guard's triggers, but an unlogged table is emptied by crash recovery and
// is empty on every standby, a loss of all its rows that no TRUNCATE
// trigger sees: the event triggers refuse it.
func TestReview27GuardSetUnlogged(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	e := startEnv(t)
	g := review27Guard(t, e)
	err := g.call(t, "fp_r27_u", `EXECUTE 'ALT' || 'ER TABLE public.ac' || 'ct SET UNLOG' || 'GED'`)
	var persistence string
	if err := g.d.QueryRow(ctxT(t), "SELECT relpersistence::text FROM pg_catalog.pg_class WHERE oid = 'public.acct'::regclass").Scan(&persistence); err != nil {
		t.Fatal(err)
	}
	if sqlState(err) != "FP003" || persistence != "p" {
		t.Errorf("SET UNLOGGED: %v; relpersistence %q, want FP003 and p", err, persistence)
	}
}
