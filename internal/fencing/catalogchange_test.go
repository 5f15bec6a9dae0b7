package fencing_test

import (
	"errors"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/fenceproxy/fenceproxy/internal/policy"
	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// TestCatalogChange: with a session through the proxy open, each kind of
// path to a protected table is created on a direct connection, and the
// session's very next statement writes through it: refused (FP003) with no
// reload, the protected table unchanged. The databases have the catalog
// watch (fenceproxy setup as the superuser); no notification reaches this
// proxy (it has no audit listener), so what refuses is the check of the
// stamp in the write's transaction (fenceproxy.catalog_is), and the retry,
// decided after the database was checked again, is refused for the path.
// Half the writes go as simple Queries, half as Parse.
func TestCatalogChange(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	checker, specs := startChecker(t, testRules)
	e := startPolicyEnv(t, policy.Options{Checks: checker}, specs)
	db := e.newDB(t)
	d := direct(t, db)
	c := e.connect(t, db)
	ctx := ctxT(t)
	setToken(t, c, "5")

	// Statements that write the relations below before they reach
	// anything pass, so the session has decided on them with the results
	// of the first check.
	for _, sql := range []string{"UPDATE src SET v = v WHERE id = 1", "UPDATE public.acct SET n = n WHERE id = 1"} {
		if _, err := c.Exec(ctx, sql); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
	}

	for i, k := range []struct {
		name, ddl, write, undo string
		table                  string // the protected table reached
	}{
		{"view", "CREATE VIEW v_plain AS SELECT * FROM acct",
			"UPDATE v_plain SET payload = 'x' WHERE id = 1", "DROP VIEW v_plain", "acct"},
		{"check option view", "CREATE VIEW v_check AS SELECT * FROM acct WHERE n >= 0 WITH CHECK OPTION",
			"DELETE FROM v_check WHERE id = 1", "DROP VIEW v_check", "acct"},
		{"security_barrier view", "CREATE VIEW v_barrier WITH (security_barrier) AS SELECT * FROM acct WHERE id > 0",
			"UPDATE v_barrier SET n = n + 1", "DROP VIEW v_barrier", "acct"},
		// src was written above, before the rule made it a path.
		{"rule", "CREATE RULE src_to_acct AS ON UPDATE TO src DO INSTEAD UPDATE acct SET payload = 'rule' WHERE id = OLD.id",
			"UPDATE src SET v = v WHERE id = 1", "DROP RULE src_to_acct ON src", "acct"},
		{"inheritance parent", `CREATE TABLE inh_parent (id bigint, payload text, n int, last_fence bigint);
			ALTER TABLE acct INHERIT inh_parent`,
			"UPDATE inh_parent SET payload = 'x'", "ALTER TABLE acct NO INHERIT inh_parent; DROP TABLE inh_parent", "acct"},
		{"partitioned parent", `CREATE TABLE part_parent (id int NOT NULL, n int NOT NULL DEFAULT 0, last_fence bigint NOT NULL DEFAULT 0)
				PARTITION BY RANGE (id);
			ALTER TABLE part_parent ATTACH PARTITION "Config" FOR VALUES FROM (0) TO (1000)`,
			"UPDATE part_parent SET n = n + 1", `ALTER TABLE part_parent DETACH PARTITION "Config"; DROP TABLE part_parent`, `"Config"`},
		{"foreign key ON UPDATE CASCADE", `CREATE TABLE fk_upd (id bigint PRIMARY KEY);
			INSERT INTO fk_upd SELECT id FROM acct;
			ALTER TABLE acct ADD CONSTRAINT acct_fk_upd FOREIGN KEY (id) REFERENCES fk_upd ON UPDATE CASCADE`,
			"UPDATE fk_upd SET id = id + 100 WHERE id = 1", "ALTER TABLE acct DROP CONSTRAINT acct_fk_upd; DROP TABLE fk_upd", "acct"},
		{"foreign key ON DELETE CASCADE", `CREATE TABLE fk_del (id bigint PRIMARY KEY);
			INSERT INTO fk_del SELECT id FROM acct_skip;
			ALTER TABLE acct_skip ADD CONSTRAINT acct_skip_fk_del FOREIGN KEY (id) REFERENCES fk_del ON DELETE CASCADE`,
			"DELETE FROM fk_del WHERE id = 1", "ALTER TABLE acct_skip DROP CONSTRAINT acct_skip_fk_del; DROP TABLE fk_del", "acct_skip"},
		{"foreign key ON DELETE SET NULL", `CREATE TABLE fk_null (id bigint PRIMARY KEY);
			INSERT INTO fk_null SELECT id FROM acct_allow;
			ALTER TABLE acct_allow ADD COLUMN ref bigint;
			UPDATE acct_allow SET ref = id;
			ALTER TABLE acct_allow ADD CONSTRAINT acct_allow_fk_null FOREIGN KEY (ref) REFERENCES fk_null ON DELETE SET NULL`,
			"DELETE FROM fk_null WHERE id = 2", "ALTER TABLE acct_allow DROP COLUMN ref; DROP TABLE fk_null", "acct_allow"},
		{"TRUNCATE CASCADE", `CREATE TABLE trunc_ref (id bigint PRIMARY KEY);
			INSERT INTO trunc_ref SELECT id FROM acct_strict;
			ALTER TABLE acct_strict ADD CONSTRAINT acct_strict_trunc FOREIGN KEY (id) REFERENCES trunc_ref`,
			"TRUNCATE trunc_ref CASCADE", "ALTER TABLE acct_strict DROP CONSTRAINT acct_strict_trunc; DROP TABLE trunc_ref", "acct_strict"},
	} {
		t.Run(k.name, func(t *testing.T) {
			execDirect(t, d, k.ddl)
			before := tableText(t, d, k.table)
			err := retryCatalogCheck(t, func() error {
				if i%2 == 0 {
					_, err := c.PgConn().Exec(ctx, k.write).ReadAll()
					return err
				}
				// Parse, Bind, Execute (pgx's Exec with no arguments
				// would send a simple Query).
				return c.PgConn().ExecParams(ctx, k.write, nil, nil, nil, nil).Read().Err
			})
			wantCode(t, err, "FP003")
			// Refused for the path found by the check the change called
			// for, not only while it ran.
			if !strings.Contains(err.Error(), "without naming it") {
				t.Errorf("refusal %v: not the path's", err)
			}
			if after := tableText(t, d, k.table); after != before {
				t.Errorf("%s changed:\n before %s\n after  %s", k.table, before, after)
			}
			execDirect(t, d, k.undo)
			// With the path gone (another change of the catalog), the
			// session writes the relation again where it still exists.
			if err := retryCatalogCheck(t, func() error {
				_, err := c.Exec(ctx, "UPDATE src SET v = v WHERE id = 1")
				return err
			}); err != nil {
				t.Fatalf("after %s: %v", k.undo, err)
			}
		})
	}
}

// retryCatalogCheck runs write, and once more if the catalog check in
// its transaction refused it (the catalog changed after the proxy's last
// check, and no notification told the proxy), as a client retries a
// statement refused with FP003. It returns the last error.
func retryCatalogCheck(t *testing.T, write func() error) error {
	t.Helper()
	err := write()
	if isCatalogCheck(err) {
		err = write()
	}
	return err
}

// isCatalogCheck reports whether err is the refusal of the catalog check
// in a write's transaction (fenceproxy.catalog_is).
func isCatalogCheck(err error) bool {
	var pe *pgconn.PgError
	return errors.As(err, &pe) && pe.Code == "FP003" && strings.Contains(pe.Message, "changed since the proxy checked it; the statement did not run")
}

// execDirect runs sql (one or more statements) on d, a direct connection,
// as one simple Query.
func execDirect(t *testing.T, d *pgx.Conn, sql string) {
	t.Helper()
	if _, err := d.PgConn().Exec(ctxT(t), sql).ReadAll(); err != nil {
		t.Fatalf("%s: %v", strings.Join(strings.Fields(sql), " "), err)
	}
}

// tableText returns a table's rows as JSON, ordered by id, read through d.
func tableText(t *testing.T, d *pgx.Conn, table string) string {
	t.Helper()
	var s string
	if err := d.QueryRow(ctxT(t), "SELECT coalesce(string_agg(to_jsonb(x)::text, ',' ORDER BY x.id), '') FROM "+table+" x").Scan(&s); err != nil {
		t.Fatalf("read %s: %v", table, err)
	}
	return s
}
