package fencing_test

import (
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/fenceproxy/fenceproxy/internal/dbsetup"
	"github.com/fenceproxy/fenceproxy/internal/policy"
	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/rules"
	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// Adversarial review of the catalog check for paths created while the
// proxy runs (fenceproxy.catalog_at, the catalog watch): a session through
// the proxy decides a write, a path from the relation it writes to the
// protected table acct is created on a direct connection, and the
// session's next statement must be refused (FP003) with acct unchanged,
// read directly.

// review27CatalogEnv is a database with catalogMatrixSchema and setup
// run as the superuser (the catalog watch, no guard); c is a session
// through p with fence.token 5 (acct's fences are 0), d a direct
// connection.
type review27CatalogEnv struct {
	db   string
	c, d *pgx.Conn
}

func review27Catalog(t *testing.T, p proxytestProxy, specs []rules.TableSpec) *review27CatalogEnv {
	t.Helper()
	ctx := ctxT(t)
	db := schemaDB(t, "r27cat", catalogMatrixSchema)
	d := direct(t, db)
	if _, err := dbsetup.Setup(ctx, d, specs, dbsetup.SetupOptions{}); err != nil {
		t.Fatal(err)
	}
	c := connectDSN(t, p.DSN("postgres", "", db), func(c *pgx.ConnConfig) { c.RuntimeParams["fence.token"] = "5" })
	return &review27CatalogEnv{db: db, c: c, d: d}
}

// proxytestProxy is what review27Catalog needs of a started proxy.
type proxytestProxy = interface {
	DSN(user, password, db string) string
}

func review27CatalogProxy(t *testing.T, edit ...func(*proxy.Options)) (proxytestProxy, []rules.TableSpec) {
	t.Helper()
	checker, specs := startChecker(t, hijackRules)
	rs, err := rules.Compile(hijackRules)
	if err != nil {
		t.Fatal(err)
	}
	return startProxy(t, policy.New(rs, false, policy.Options{Checks: checker}), edit...), specs
}

// q runs sql through the session as one simple Query.
func (x *review27CatalogEnv) q(t *testing.T, sql string) error {
	t.Helper()
	_, err := x.c.PgConn().Exec(ctxT(t), sql).ReadAll()
	return err
}

// settle writes src through the session until the proxy's paths are the
// catalog's (a refusal of the in-band check makes it check again).
func (x *review27CatalogEnv) settle(t *testing.T) {
	t.Helper()
	if err := retryCatalogCheck(t, func() error { return x.q(t, "UPDATE src SET v = v WHERE id = 1") }); err != nil {
		t.Fatalf("settle: %v", err)
	}
}

// wantRefusedUnchanged requires err to be FP003 and acct to read as
// before.
func (x *review27CatalogEnv) wantRefusedUnchanged(t *testing.T, what string, err error, before string) {
	t.Helper()
	if sqlState(err) != "FP003" {
		t.Errorf("%s: %v, want FP003", what, err)
	}
	if after := tableText(t, x.d, "acct"); after != before {
		t.Fatalf("%s: acct changed:\n before %s\n after  %s", what, before, after)
	}
}

// TestReview27CatalogHeld: statement forms and protocol paths around a
// view over acct created on a direct connection after the session decided
// its write: SQL-level PREPARE before the change and EXECUTE after, alone
// and in an explicit transaction; a REPEATABLE READ transaction opened
// before the change; a leading comment; several statements in one Query;
// a data-modifying CTE; a portal bound before the change and executed
// after it (the bind holds the view's lock, so the change waits); and
// search_path shadowing of what catalog_at calls. Each is refused
// (FP003), acct unchanged.
func TestReview27CatalogHeld(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	p, specs := review27CatalogProxy(t)
	const toAcct = "CREATE OR REPLACE VIEW v AS SELECT * FROM acct"
	const write = "UPDATE v SET payload = 'view' WHERE id = 1"
	simpleForms := []struct{ name, before, after string }{
		{"PREPARE then EXECUTE", "PREPARE r27 AS " + write, "EXECUTE r27"},
		{"EXECUTE in a transaction", "PREPARE r27 AS " + write, "BEGIN; EXECUTE r27; COMMIT"},
		{"leading comment", "", "/* c */ " + write},
		{"several statements", "", "SELECT 1; " + write},
		{"data-modifying CTE", "", "WITH w AS (" + write + " RETURNING 1) SELECT count(*) FROM w"},
		{"SELECT then write", "", "SELECT 1 FROM src; " + write},
	}
	for _, f := range simpleForms {
		t.Run(f.name, func(t *testing.T) {
			t.Parallel()
			x := review27Catalog(t, p, specs)
			x.settle(t)
			if f.before != "" {
				if err := x.q(t, f.before); err != nil {
					t.Fatalf("%s: %v", f.before, err)
				}
			}
			execDirect(t, x.d, toAcct)
			before := tableText(t, x.d, "acct")
			err := retryCatalogCheck(t, func() error { return x.q(t, f.after) })
			if strings.HasPrefix(f.after, "BEGIN") {
				_ = x.q(t, "ROLLBACK")
			}
			x.wantRefusedUnchanged(t, f.after, err, before)
		})
	}
	for _, iso := range []string{"REPEATABLE READ", "SERIALIZABLE", "READ COMMITTED"} {
		t.Run("transaction opened before the change/"+iso, func(t *testing.T) {
			t.Parallel()
			x := review27Catalog(t, p, specs)
			x.settle(t)
			if err := x.q(t, "BEGIN ISOLATION LEVEL "+iso+"; SELECT count(*) FROM src"); err != nil {
				t.Fatal(err)
			}
			execDirect(t, x.d, toAcct)
			before := tableText(t, x.d, "acct")
			err := x.q(t, write)
			_ = x.q(t, "ROLLBACK")
			x.wantRefusedUnchanged(t, iso, err, before)
			// Its retry, in a new transaction, too.
			x.wantRefusedUnchanged(t, iso+" retry", x.q(t, write), before)
		})
	}
	t.Run("portal bound before, executed after", func(t *testing.T) {
		t.Parallel()
		x := review27Catalog(t, p, specs)
		x.settle(t)
		before := tableText(t, x.d, "acct")
		pc := x.c.PgConn()
		if err := x.q(t, "BEGIN"); err != nil {
			t.Fatal(err)
		}
		rr := pc.ExecParams(ctxT(t), write, nil, nil, nil, nil)
		if _, err := rr.Close(); err != nil {
			t.Fatal(err)
		}
		// The session holds v's lock: the change waits for its
		// transaction, which writes plain, not acct.
		done := make(chan error, 1)
		d2 := direct(t, x.db)
		go func() {
			_, err := d2.Exec(ctxT(t), toAcct)
			done <- err
		}()
		if err := x.q(t, "COMMIT"); err != nil {
			t.Fatal(err)
		}
		if err := <-done; err != nil {
			t.Fatal(err)
		}
		x.wantRefusedUnchanged(t, "after the change", retryCatalogCheck(t, func() error { return x.q(t, write) }), before)
	})
	t.Run("search_path shadows", func(t *testing.T) {
		t.Parallel()
		x := review27Catalog(t, p, specs)
		// Functions and operators that would make the check pass, in a
		// schema searched before pg_catalog.
		execDirect(t, x.d, `CREATE SCHEMA sh;
			CREATE FUNCTION sh.txid_current_if_assigned() RETURNS bigint LANGUAGE sql AS 'SELECT 0::bigint';
			CREATE FUNCTION sh.current_setting(text) RETURNS text LANGUAGE sql AS $$SELECT 'read committed'::text$$;
			CREATE FUNCTION sh.yes(bigint, bigint) RETURNS boolean LANGUAGE sql AS 'SELECT true';
			CREATE OPERATOR sh.= (LEFTARG = bigint, RIGHTARG = bigint, FUNCTION = sh.yes);
			CREATE OPERATOR sh.<> (LEFTARG = bigint, RIGHTARG = bigint, FUNCTION = sh.yes)`)
		x.settle(t)
		if err := x.q(t, "SET search_path = sh, public, pg_catalog"); err != nil {
			t.Fatal(err)
		}
		execDirect(t, x.d, toAcct)
		before := tableText(t, x.d, "acct")
		x.wantRefusedUnchanged(t, "shadowed", retryCatalogCheck(t, func() error { return x.q(t, write) }), before)
		x.wantRefusedUnchanged(t, "shadowed, extended", retryCatalogCheck(t, func() error {
			return x.c.PgConn().ExecParams(ctxT(t), write, nil, nil, nil, nil).Read().Err
		}), before)
	})
}

// TestReview27CatalogRenameUncounted: ALTER INDEX ... RENAME renames any
// relation (PostgreSQL allows it on tables and views for compatibility),
// so the watch's catalog_changed() counts commands tagged ALTER INDEX
// unless all their objects are indexes. A view over acct created on a
// direct connection under another name (a path the proxy learns and
// refuses) is renamed into the place of a view the session writes: the
// stamp moves, and the session's write through the view is refused, acct
// unchanged. (Before the fix the tag was skipped and the write reached
// acct unfenced.)
func TestReview27CatalogRenameUncounted(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	p, specs := review27CatalogProxy(t)
	for _, proto := range []string{"simple", "unnamed", "named"} {
		t.Run(proto, func(t *testing.T) {
			t.Parallel()
			x := review27Catalog(t, p, specs)
			write := sendFunc(t, x.c.PgConn(), proto, "r27w", "UPDATE v SET payload = 'renamed' WHERE id = 1")
			if err := retryCatalogCheck(t, write); err != nil {
				t.Fatalf("before: %v", err)
			}
			execDirect(t, x.d, "CREATE VIEW v_next AS SELECT * FROM acct")
			// The proxy learns v_next (a path, counted).
			x.settle(t)
			var stamp0, stamp1 int64
			_ = x.d.QueryRow(ctxT(t), "SELECT stamp FROM fenceproxy.catalog").Scan(&stamp0)
			execDirect(t, x.d, "ALTER INDEX v RENAME TO v_old; ALTER INDEX v_next RENAME TO v")
			_ = x.d.QueryRow(ctxT(t), "SELECT stamp FROM fenceproxy.catalog").Scan(&stamp1)
			t.Logf("stamp %d before the renames, %d after", stamp0, stamp1)
			before := tableText(t, x.d, "acct")
			x.wantRefusedUnchanged(t, "through the renamed view", retryCatalogCheck(t, write), before)
		})
	}
}

// TestReview27CatalogStoredCode: a function created through the proxy
// whose body updates a view over acct is refused when it is created
// ("known path"), as one that names acct is: the database check's paths
// (views, rules, parents, foreign keys) count as the protected table's
// names for stored code. Where the view is redefined over acct on a
// direct connection after the function was created ("path created
// after"), the call writes acct unfenced: stored code is fenced only by
// the database guard (a documented limit), and that case stays skipped.
func TestReview27CatalogStoredCode(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	p, specs := review27CatalogProxy(t)
	t.Run("known path", func(t *testing.T) {
		t.Parallel()
		x := review27Catalog(t, p, specs)
		execDirect(t, x.d, "CREATE OR REPLACE VIEW v AS SELECT * FROM acct")
		x.settle(t)
		before := tableText(t, x.d, "acct")
		// A plain write through v is refused: the proxy knows the path.
		x.wantRefusedUnchanged(t, "UPDATE v", x.q(t, "UPDATE v SET payload = 'view' WHERE id = 1"), before)
		for _, create := range []string{
			"CREATE FUNCTION f() RETURNS void LANGUAGE sql AS $$UPDATE v SET payload = 'stored' WHERE id = 1$$",
			"CREATE FUNCTION g() RETURNS void LANGUAGE plpgsql AS $$BEGIN EXECUTE 'UPDATE v SET payload = ''stored'' WHERE id = 1'; END$$",
			"DO $$BEGIN UPDATE v SET payload = 'stored' WHERE id = 1; END$$",
		} {
			x.wantRefusedUnchanged(t, create, x.q(t, create), before)
		}
		if err := x.q(t, "SELECT f()"); sqlState(err) != "42883" {
			t.Errorf("SELECT f(): %v, want 42883 (f was not created)", err)
		}
	})
	t.Run("path created after", func(t *testing.T) {
		t.Skip("LIMIT: stored code created before a path exists writes through it unfenced when called; only the database guard fences stored code")
		t.Parallel()
		x := review27Catalog(t, p, specs)
		x.settle(t)
		if err := x.q(t, "CREATE FUNCTION f() RETURNS void LANGUAGE sql AS $$UPDATE v SET payload = 'stored' WHERE id = 1$$"); err != nil {
			t.Fatalf("create f: %v", err)
		}
		if err := x.q(t, "SELECT f()"); err != nil {
			t.Fatalf("f over plain: %v", err)
		}
		execDirect(t, x.d, "CREATE OR REPLACE VIEW v AS SELECT * FROM acct")
		before := tableText(t, x.d, "acct")
		x.wantRefusedUnchanged(t, "SELECT f()", retryCatalogCheck(t, func() error { return x.q(t, "SELECT f()") }), before)
	})
}
