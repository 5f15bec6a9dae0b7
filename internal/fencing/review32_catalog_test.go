package fencing_test

import (
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// Adversarial review 32 of the catalog paths (internal/catalog,
// internal/dbsetup/watch.sql, rules.IndirectSet): relations through which
// a write reaches the protected table acct without naming it, made so
// that the proxy never learns them. Every test uses review27Catalog's
// database (catalog watch, no guard; acct protected, fences 0, the
// session's token 5) and requires the safe outcome: the write (or the DDL
// that opens the path) refused with FP003 and acct unchanged, read on a
// direct connection.

// review32Fences lists acct's rows as id:payload:fence, read directly
// (a write that landed fenced stamps 5).
func review32Fences(t *testing.T, x *review27CatalogEnv) string {
	t.Helper()
	var s string
	if err := x.d.QueryRow(ctxT(t), "SELECT coalesce(string_agg(id || ':' || payload || ':' || last_fence, ',' ORDER BY id), '') FROM acct").Scan(&s); err != nil {
		t.Fatal(err)
	}
	return s
}

// wantSafe requires that the steps, run in order through the session (each
// one simple Query), end with one of them refused (FP003) and acct as
// before; a step that fails otherwise fails the test.
func (x *review27CatalogEnv) wantSafe(t *testing.T, steps ...string) {
	t.Helper()
	before := tableText(t, x.d, "acct")
	var refused bool
	for _, s := range steps {
		err := retryCatalogCheck(t, func() error { return x.q(t, s) })
		if err == nil {
			continue
		}
		if strings.HasPrefix(strings.TrimSpace(s), "BEGIN") {
			_ = x.q(t, "ROLLBACK")
		}
		if sqlState(err) != "FP003" {
			t.Fatalf("%s: %v, want FP003 or success", s, err)
		}
		t.Logf("refused: %s: %v", s, err)
		refused = true
		break
	}
	if after := tableText(t, x.d, "acct"); after != before {
		t.Errorf("acct written through the proxy without a refusal (fences %s):\n before %s\n after  %s", review32Fences(t, x), before, after)
	} else if !refused {
		t.Errorf("no step refused (acct unchanged, but nothing showed the path): %q", steps)
	}
}

// TestReview32CatalogTempViewOverPath: a temporary view, created through
// the proxy, over a relation the proxy knows as a path to acct (a view, an
// inheritance parent). The proxy's DDL policy refuses views over a
// protected table by name only; the database check leaves out temporary
// relations (pg_temp_N) and the catalog watch does not count this
// session's temporary objects. So the write through the temporary view is
// the proxy's to refuse, or the CREATE VIEW.
func TestReview32CatalogTempViewOverPath(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	p, specs := review27CatalogProxy(t)
	for _, k := range []struct{ name, path, view string }{
		{"view", "CREATE VIEW v_acct AS SELECT * FROM acct", "CREATE TEMP VIEW tv AS SELECT * FROM v_acct"},
		{"inheritance parent", "ALTER TABLE acct INHERIT inh_parent", "CREATE TEMP VIEW tv AS SELECT * FROM inh_parent"},
	} {
		t.Run(k.name, func(t *testing.T) {
			t.Parallel()
			x := review27Catalog(t, p, specs)
			execDirect(t, x.d, k.path)
			x.settle(t)
			x.wantSafe(t, k.view, "UPDATE tv SET payload = 'temp view' WHERE id = 1")
		})
	}
}

// TestReview32CatalogTempViewThenPath: a temporary view created through
// the proxy over v while v reads plain (no path, rightly forwarded); then
// v is redefined over acct on a direct connection. The watch counts that
// change and the proxy checks the database again, learning v; but the
// check leaves out temporary relations, so tv, which now writes acct
// through v, is not a path it knows. The session's write through tv must
// be refused.
func TestReview32CatalogTempViewThenPath(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	p, specs := review27CatalogProxy(t)
	for _, proto := range []string{"simple", "unnamed", "named"} {
		t.Run(proto, func(t *testing.T) {
			t.Parallel()
			x := review27Catalog(t, p, specs)
			x.settle(t)
			if err := x.q(t, "CREATE TEMP VIEW tv AS SELECT * FROM v"); err != nil {
				t.Fatalf("create tv over v (plain): %v", err)
			}
			write := sendFunc(t, x.c.PgConn(), proto, "r32tv", "UPDATE tv SET payload = 'temp view' WHERE id = 1")
			if err := retryCatalogCheck(t, write); err != nil {
				t.Fatalf("write tv over plain: %v", err)
			}
			execDirect(t, x.d, "CREATE OR REPLACE VIEW v AS SELECT * FROM acct")
			x.settle(t)
			before := tableText(t, x.d, "acct")
			err := retryCatalogCheck(t, write)
			if after := tableText(t, x.d, "acct"); after != before {
				t.Fatalf("write through tv: %v; acct written unfenced (fences %s):\n before %s\n after  %s", err, review32Fences(t, x), before, after)
			}
			if sqlState(err) != "FP003" {
				t.Errorf("write through tv: %v, want FP003", err)
			}
		})
	}
}

// TestReview32CatalogSameTransaction: DDL through the proxy that the DDL
// policy forwards (it names no protected table) opens a path to acct, and
// a write through the path follows in the same transaction. catalog_at
// compares a transaction's own changes as not yet made (base), and a text
// of several statements is checked by a stamp read before it is
// forwarded, so the write is decided with the paths from before the DDL.
// It must be refused (or the DDL).
func TestReview32CatalogSameTransaction(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	p, specs := review27CatalogProxy(t)
	for _, k := range []struct {
		name  string
		steps []string
	}{
		{"view over a path, explicit transaction", []string{"BEGIN", "CREATE VIEW pv AS SELECT * FROM v_acct", "UPDATE pv SET payload = 'pv' WHERE id = 1", "COMMIT"}},
		{"view over a path, one Query", []string{"CREATE VIEW pv AS SELECT * FROM v_acct; UPDATE pv SET payload = 'pv' WHERE id = 1"}},
		{"rename of a path, explicit transaction", []string{"BEGIN", "ALTER VIEW v_acct RENAME TO harmless", "UPDATE harmless SET payload = 'renamed' WHERE id = 1", "COMMIT"}},
		{"rename of a path, one Query", []string{"ALTER VIEW v_acct RENAME TO harmless; UPDATE harmless SET payload = 'renamed' WHERE id = 1"}},
		{"SET SCHEMA of a path, one Query", []string{"CREATE SCHEMA elsewhere; ALTER VIEW v_acct SET SCHEMA elsewhere; UPDATE elsewhere.v_acct SET payload = 'moved' WHERE id = 1"}},
	} {
		t.Run(k.name, func(t *testing.T) {
			t.Parallel()
			x := review27Catalog(t, p, specs)
			execDirect(t, x.d, "CREATE VIEW v_acct AS SELECT * FROM acct")
			x.settle(t)
			x.wantSafe(t, k.steps...)
			_ = x.q(t, "ROLLBACK")
		})
	}
}

// TestReview32CatalogSameTransactionInherit: inh_parent is a known path
// (acct inherits it). HierarchySet forwards ALTER TABLE ... INHERIT on it
// (allow-listed), which makes a new table an ancestor of acct; an UPDATE
// of that table in the same Query recurses into acct.
func TestReview32CatalogSameTransactionInherit(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	p, specs := review27CatalogProxy(t)
	x := review27Catalog(t, p, specs)
	execDirect(t, x.d, "ALTER TABLE acct INHERIT inh_parent; CREATE TABLE grand (id bigint, payload text)")
	x.settle(t)
	x.wantSafe(t, "ALTER TABLE inh_parent INHERIT grand; UPDATE grand SET payload = 'grand' WHERE id = 1")
}

// TestReview32CatalogSameTransactionPipeline: the view over a path and the
// write through it sent in the extended protocol, one pipeline, one Sync
// (one implicit transaction).
func TestReview32CatalogSameTransactionPipeline(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	p, specs := review27CatalogProxy(t)
	x := review27Catalog(t, p, specs)
	execDirect(t, x.d, "CREATE VIEW v_acct AS SELECT * FROM acct")
	x.settle(t)
	before := tableText(t, x.d, "acct")
	pc := x.c.PgConn()
	b := &pgconn.Batch{}
	b.ExecParams("CREATE VIEW pv AS SELECT * FROM v_acct", nil, nil, nil, nil)
	b.ExecParams("UPDATE pv SET payload = 'pipelined' WHERE id = 1", nil, nil, nil, nil)
	_, err := pc.ExecBatch(ctxT(t), b).ReadAll()
	if after := tableText(t, x.d, "acct"); after != before {
		t.Fatalf("pipeline: %v; acct written unfenced (fences %s):\n before %s\n after  %s", err, review32Fences(t, x), before, after)
	}
	if sqlState(err) != "FP003" {
		t.Errorf("pipeline: %v, want FP003", err)
	}
}

// TestReview32CatalogAcrossTransactionsHeld: the same DDL through the
// proxy in its own transaction, the write in the next: the watch counts
// the DDL, the write's catalog_at refuses, the retry is decided with the
// new path and refused. (Held.)
func TestReview32CatalogAcrossTransactionsHeld(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	p, specs := review27CatalogProxy(t)
	for _, k := range []struct {
		name  string
		steps []string
	}{
		{"view over a path", []string{"CREATE VIEW pv AS SELECT * FROM v_acct", "UPDATE pv SET payload = 'pv' WHERE id = 1"}},
		{"rename of a path", []string{"ALTER VIEW v_acct RENAME TO harmless", "UPDATE harmless SET payload = 'renamed' WHERE id = 1"}},
	} {
		t.Run(k.name, func(t *testing.T) {
			t.Parallel()
			x := review27Catalog(t, p, specs)
			execDirect(t, x.d, "CREATE VIEW v_acct AS SELECT * FROM acct")
			x.settle(t)
			x.wantSafe(t, k.steps...)
		})
	}
}

// TestReview32CatalogInformationSchema: a view over acct created on a
// direct connection in schema information_schema (a superuser may create
// objects there). The watch counts it, but the database check reads no
// relation of information_schema, so the path is never learned.
func TestReview32CatalogInformationSchema(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	p, specs := review27CatalogProxy(t)
	x := review27Catalog(t, p, specs)
	x.settle(t)
	execDirect(t, x.d, "CREATE VIEW information_schema.acct_view AS SELECT * FROM acct")
	x.wantSafe(t, "UPDATE information_schema.acct_view SET payload = 'information_schema' WHERE id = 1")
}

// TestReview32CatalogReplicaRole: event triggers enabled ORIGIN (the
// watch's) do not fire in a session with session_replication_role =
// replica, so a view redefined over acct there moves no stamp. The
// proxy's session, which wrote v while it read plain, then writes v.
func TestReview32CatalogReplicaRole(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	p, specs := review27CatalogProxy(t)
	x := review27Catalog(t, p, specs)
	x.settle(t)
	if err := retryCatalogCheck(t, func() error { return x.q(t, "UPDATE v SET payload = 'plain' WHERE id = 1") }); err != nil {
		t.Fatal(err)
	}
	execDirect(t, x.d, "SET session_replication_role = replica; CREATE OR REPLACE VIEW v AS SELECT * FROM acct; RESET session_replication_role")
	x.wantSafe(t, "UPDATE v SET payload = 'replica' WHERE id = 1")
}

// TestReview32CatalogTempHeld: temporary objects through the proxy that
// name acct, or write a known path, in their definition: a temporary view
// over acct in several spellings, a rule on a temporary table whose
// action writes a path, a temporary table inheriting acct written through
// the parent. Each is refused (or the write fenced) with acct unchanged
// or stamped. (Held.)
func TestReview32CatalogTempHeld(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	p, specs := review27CatalogProxy(t)
	for _, k := range []struct {
		name  string
		steps []string
	}{
		{"temp view, unqualified", []string{"CREATE TEMP VIEW tv AS SELECT * FROM acct", "UPDATE tv SET payload = 'tv' WHERE id = 1"}},
		{"temp view, Unicode escape", []string{`CREATE TEMP VIEW tv AS SELECT * FROM U&"\0061cct"`, "UPDATE tv SET payload = 'tv' WHERE id = 1"}},
		{"temp view, qualified ONLY", []string{`CREATE TEMPORARY VIEW tv AS SELECT * FROM ONLY "public"."acct" WITH CASCADED CHECK OPTION`, "UPDATE tv SET payload = 'tv' WHERE id = 1"}},
		{"temp view in pg_temp", []string{`CREATE VIEW pg_temp.tv AS SELECT * FROM public.acct`, "UPDATE pg_temp.tv SET payload = 'tv' WHERE id = 1"}},
		{"rule on a temp table writing a path", []string{"CREATE TEMP TABLE tt (id bigint)",
			"CREATE RULE r AS ON INSERT TO tt DO INSTEAD UPDATE v_acct SET payload = 'rule' WHERE id = NEW.id", "INSERT INTO tt VALUES (1)"}},
		{"rule on a temp table writing acct", []string{"CREATE TEMP TABLE tt (id bigint)",
			"CREATE RULE r AS ON INSERT TO tt DO INSTEAD UPDATE public.acct SET payload = 'rule' WHERE id = NEW.id", "INSERT INTO tt VALUES (1)"}},
	} {
		t.Run(k.name, func(t *testing.T) {
			t.Parallel()
			x := review27Catalog(t, p, specs)
			execDirect(t, x.d, "CREATE VIEW v_acct AS SELECT * FROM acct")
			x.settle(t)
			x.wantSafe(t, k.steps...)
		})
	}
}

// TestReview32CatalogOtherSessionTempView: the catalog watch does not
// count temporary objects and the database check reads none, on the
// ground that other sessions cannot write through them. A view has no
// storage, so another session can: a temporary view over acct created on
// a direct connection (which stays open), written by the proxy's session
// under its schema-qualified name pg_temp_N.tv.
func TestReview32CatalogOtherSessionTempView(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	p, specs := review27CatalogProxy(t)
	x := review27Catalog(t, p, specs)
	x.settle(t)
	other := direct(t, x.db)
	execDirect(t, other, "CREATE TEMP VIEW tv AS SELECT * FROM acct")
	var nsp string
	if err := other.QueryRow(ctxT(t), "SELECT nspname FROM pg_namespace WHERE oid = pg_my_temp_schema()").Scan(&nsp); err != nil {
		t.Fatal(err)
	}
	x.wantSafe(t, "UPDATE "+nsp+".tv SET payload = 'other temp' WHERE id = 1")
}
