package fencing_test

import (
	"fmt"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/fenceproxy/fenceproxy/internal/dbsetup"
	"github.com/fenceproxy/fenceproxy/internal/policy"
	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/rules"
	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// catalogMatrixSchema is hijackSchema's tables with the relations the
// paths of TestCatalogChangeMatrix start from, each there before the
// session opens: src (a rule goes on it), v (a view over plain, later
// over the protected table), inh_parent (the protected table comes to
// inherit from it), fk_parent and trunc_ref (the protected table comes to
// reference them).
const catalogMatrixSchema = `
CREATE TABLE acct (id bigint PRIMARY KEY, payload text NOT NULL DEFAULT 'new', n int NOT NULL DEFAULT 0, last_fence bigint NOT NULL DEFAULT 0);
INSERT INTO acct (id, payload) VALUES (1, 'a'), (2, 'b'), (3, 'c');
CREATE TABLE racct (LIKE acct INCLUDING ALL);
INSERT INTO racct (id, payload) VALUES (1, 'a'), (2, 'b'), (3, 'c');
CREATE TABLE jobs (id bigint PRIMARY KEY, state text NOT NULL);
CREATE TABLE src (id bigint PRIMARY KEY, v int NOT NULL);
INSERT INTO src VALUES (1, 10);
CREATE TABLE plain (LIKE acct INCLUDING ALL);
INSERT INTO plain (id, payload) VALUES (1, 'p');
CREATE VIEW v AS SELECT * FROM plain;
CREATE TABLE inh_parent (id bigint, payload text, n int, last_fence bigint);
CREATE TABLE fk_parent (id bigint PRIMARY KEY);
INSERT INTO fk_parent VALUES (1), (2), (3);
CREATE TABLE trunc_ref (id bigint PRIMARY KEY);
`

// catalogMatrixPaths are the paths TestCatalogChangeMatrix creates to the
// protected table %[1]s. Each write is one text, sent before the path
// exists (twice, harmlessly: an auto-prepared or named statement is then
// prepared before the change) and once after, when it would change the
// protected table.
var catalogMatrixPaths = []struct{ name, ddl, write, undo string }{
	{"rule", "CREATE RULE src_to_%[1]s AS ON UPDATE TO src DO INSTEAD UPDATE %[1]s SET payload = 'rule' WHERE id = OLD.id",
		"UPDATE src SET v = v WHERE id = 1", "DROP RULE src_to_%[1]s ON src"},
	{"view", "CREATE OR REPLACE VIEW v AS SELECT * FROM %[1]s",
		"UPDATE v SET payload = 'view' WHERE id = 1", "CREATE OR REPLACE VIEW v AS SELECT * FROM plain -- %[1]s"},
	{"inheritance parent", "ALTER TABLE %[1]s INHERIT inh_parent",
		"UPDATE inh_parent SET payload = 'parent' WHERE id = 1", "ALTER TABLE %[1]s NO INHERIT inh_parent"},
	// Sent twice the key goes to -1 and back; once more, it would cascade.
	{"foreign key ON UPDATE CASCADE", "ALTER TABLE %[1]s ADD CONSTRAINT %[1]s_fk FOREIGN KEY (id) REFERENCES fk_parent ON UPDATE CASCADE",
		"UPDATE fk_parent SET id = -id WHERE id IN (1, -1)", "ALTER TABLE %[1]s DROP CONSTRAINT %[1]s_fk; UPDATE fk_parent SET id = 1 WHERE id = -1"},
	{"TRUNCATE CASCADE", "INSERT INTO trunc_ref SELECT id FROM %[1]s; ALTER TABLE %[1]s ADD CONSTRAINT %[1]s_tr FOREIGN KEY (id) REFERENCES trunc_ref",
		"TRUNCATE trunc_ref CASCADE", "ALTER TABLE %[1]s DROP CONSTRAINT %[1]s_tr"},
}

// TestCatalogChangeMatrix: TestCatalogChange for lock: optional (with a
// lock named) and lock: required, as a simple Query, an unnamed statement
// and a named statement prepared before the change, with and without
// auto_prepare. With a session through the proxy open, a path to the
// protected table is created on a direct connection from a relation the
// session has already written; the session's very next statement, the
// same text, is refused (FP003, after at most one refusal of the catalog
// check), and the protected table, read directly, is unchanged.
func TestCatalogChangeMatrix(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	checker, specs := startChecker(t, hijackRules)
	rs, err := rules.Compile(hijackRules)
	if err != nil {
		t.Fatal(err)
	}
	for _, auto := range []bool{false, true} {
		var edit []func(*proxy.Options)
		name := "auto_prepare off"
		if auto {
			edit, name = append(edit, autoPrepare), "auto_prepare on"
		}
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			p := startProxy(t, policy.New(rs, false, policy.Options{Checks: checker}), edit...)
			for _, proto := range []string{"simple", "unnamed", "named"} {
				for _, target := range []string{"acct", "racct"} {
					t.Run(proto+"/"+target, func(t *testing.T) {
						t.Parallel()
						db, d := catalogMatrixDB(t, "catmatrix", specs)
						c := connectDSN(t, p.DSN("postgres", "", db), func(c *pgx.ConnConfig) {
							c.RuntimeParams["fence.lock"] = "L/" + db
							c.RuntimeParams["fence.token"] = "5"
						})
						for i, k := range catalogMatrixPaths {
							write := sendFunc(t, c.PgConn(), proto, fmt.Sprintf("cm%d", i), k.write)
							for range 2 {
								// The first may meet the change of the
								// last undo.
								if err := retryCatalogCheck(t, write); err != nil {
									t.Fatalf("%s: %s before the change: %v", k.name, k.write, err)
								}
							}
							execDirect(t, d, fmt.Sprintf(k.ddl, target))
							before := tableText(t, d, target)
							err := retryCatalogCheck(t, write)
							if sqlState(err) != "FP003" {
								t.Errorf("%s: %s through the new path: %v, want FP003; %s is now %s (was %s)", k.name, k.write, err, target, tableText(t, d, target), before)
								execDirect(t, d, fmt.Sprintf(k.undo, target))
								continue
							}
							if err != nil && !strings.Contains(err.Error(), "without naming it") {
								t.Errorf("%s: refusal %v: not the path's", k.name, err)
							}
							if after := tableText(t, d, target); after != before {
								t.Fatalf("%s: %s changed:\n before %s\n after  %s", k.name, target, before, after)
							}
							execDirect(t, d, fmt.Sprintf(k.undo, target))
						}
					})
				}
			}
		})
	}
}

// sendFunc returns a function that sends sql through c: as a simple
// Query, as the unnamed statement (Parse, Bind, Execute), or by executing
// the statement name, which it prepares now.
func sendFunc(t *testing.T, c *pgconn.PgConn, proto, name, sql string) func() error {
	t.Helper()
	switch proto {
	case "simple":
		return func() error {
			_, err := c.Exec(ctxT(t), sql).ReadAll()
			return err
		}
	case "unnamed":
		return func() error { return c.ExecParams(ctxT(t), sql, nil, nil, nil, nil).Read().Err }
	}
	if _, err := c.Prepare(ctxT(t), name, sql, nil); err != nil {
		t.Fatalf("prepare %s: %v", sql, err)
	}
	return func() error { return c.ExecPrepared(ctxT(t), name, nil, nil, nil).Read().Err }
}

// TestCatalogChangeLegacyCheck: in a database whose catalog watch setup
// installed before catalog_at (it has catalog_is only), the proxy checks
// the stamp with catalog_is: a rule created on a direct connection is
// refused on the session's next statement, in both protocols.
func TestCatalogChangeLegacyCheck(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	checker, specs := startChecker(t, hijackRules)
	rs, err := rules.Compile(hijackRules)
	if err != nil {
		t.Fatal(err)
	}
	p := startProxy(t, policy.New(rs, false, policy.Options{Checks: checker}))
	_, d := catalogMatrixDB(t, "catlegacy", specs)
	db := d.Config().Database
	execDirect(t, d, "DROP PROCEDURE "+dbsetup.CatalogCheckProc+"(bigint)")
	c := connectDSN(t, p.DSN("postgres", "", db), func(c *pgx.ConnConfig) { c.RuntimeParams["fence.token"] = "5" })
	for _, proto := range []string{"simple", "unnamed"} {
		write := sendFunc(t, c.PgConn(), proto, "", "UPDATE src SET v = v WHERE id = 1")
		if err := retryCatalogCheck(t, write); err != nil {
			t.Fatalf("%s: before the rule: %v", proto, err)
		}
		execDirect(t, d, "CREATE RULE src_to_acct AS ON UPDATE TO src DO INSTEAD UPDATE acct SET payload = 'rule' WHERE id = OLD.id")
		before := tableText(t, d, "acct")
		err := write()
		if !isCatalogCheck(err) {
			t.Errorf("%s: the first write after the rule: %v, want the refusal of catalog_is", proto, err)
		}
		wantCode(t, retryCatalogCheck(t, write), "FP003")
		if after := tableText(t, d, "acct"); after != before {
			t.Fatalf("%s: acct changed:\n before %s\n after  %s", proto, before, after)
		}
		execDirect(t, d, "DROP RULE src_to_acct ON src")
	}
}

// catalogMatrixDB creates a database named prefix and a number with
// catalogMatrixSchema, runs setup for specs as the superuser (so the
// catalog watch is installed), and returns its name and a direct
// connection.
func catalogMatrixDB(t *testing.T, prefix string, specs []rules.TableSpec) (string, *pgx.Conn) {
	t.Helper()
	ctx := ctxT(t)
	db := schemaDB(t, prefix, catalogMatrixSchema)
	d := direct(t, db)
	if specs != nil {
		if _, err := dbsetup.Setup(ctx, d, specs, dbsetup.SetupOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	return db, d
}
