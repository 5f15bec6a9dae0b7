package fencing_test

import (
	"testing"

	"github.com/jackc/pgx/v5/pgproto3"

	"github.com/fenceproxy/fenceproxy/internal/rules"
	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// txAloneSchema: items (protected, written by a newer holder: fence 9)
// follow mid (unprotected, partitioned) ON DELETE CASCADE, so mid is a
// path to items; top is unrelated until a foreign key ties mid to it.
const txAloneSchema = `
CREATE TABLE orders (id bigint PRIMARY KEY, code text, note text NOT NULL DEFAULT '', last_fence bigint NOT NULL DEFAULT 0);
CREATE TABLE top (id bigint PRIMARY KEY);
INSERT INTO top VALUES (1), (2);
CREATE TABLE mid (id bigint PRIMARY KEY, top_id bigint) PARTITION BY RANGE (id);
CREATE TABLE mid_1 PARTITION OF mid FOR VALUES FROM (0) TO (100);
INSERT INTO mid VALUES (1, 1), (2, 2);
CREATE TABLE items (id bigint PRIMARY KEY, order_id bigint REFERENCES mid ON DELETE CASCADE, owner_id bigint, last_fence bigint NOT NULL DEFAULT 0);
INSERT INTO items (id, order_id, last_fence) VALUES (10, 1, 9), (20, 2, 9);
`

// TestDDLOpeningPathsAlone: DDL that opens a path to a protected table,
// sent through the proxy as a simple Query of its own outside a
// transaction block, runs (it commits before anything else of the
// session runs, as on a direct connection), and the session's next
// writes are checked against the catalog it left: a write through the
// new path is refused and the items, which a newer holder wrote, are
// unchanged in PostgreSQL — also when the client sends the write at once
// behind the DDL, in a form the proxy checks with a stamp read before
// forwarding it (two statements in one Query). The same DDL in the
// extended protocol, or sharing its Query with another statement, is
// refused as before, and does not run.
func TestDDLOpeningPathsAlone(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	p, specs := fkProxy(t, fkRowRules)
	const (
		addFK     = "ALTER TABLE mid ADD FOREIGN KEY (top_id) REFERENCES top ON DELETE CASCADE"
		fkCount   = "SELECT count(*) FROM pg_constraint WHERE conrelid = 'mid'::regclass AND contype = 'f'"
		topRows   = "SELECT id, id::text FROM top"
		viaTop    = "DELETE FROM top WHERE id = 1"
		viaTopTwo = "SELECT 1; DELETE FROM top WHERE id = 1"
	)

	t.Run("foreign key, then writes", func(t *testing.T) {
		t.Parallel()
		db, d := fkDB(t, specs, txAloneSchema)
		c := rvSession(t, p, db, "", "5")
		ctx := ctxT(t)
		items0, top0 := fkRows(t, d, txItemsQ), fkRows(t, d, topRows)
		if _, err := c.PgConn().Exec(ctx, addFK).ReadAll(); err != nil {
			t.Fatalf("%s as a Query of its own: %v", addFK, err)
		}
		var n int
		if err := d.QueryRow(ctx, fkCount).Scan(&n); err != nil || n != 1 {
			t.Fatalf("%s: %d, %v; want 1", fkCount, n, err)
		}
		for _, w := range []string{viaTop, viaTopTwo} {
			_, err := c.PgConn().Exec(ctx, w).ReadAll()
			if !fkRefused(err) {
				t.Errorf("%s after the foreign key: %v, want FP003 for the path", w, err)
			}
		}
		if items, top := fkRows(t, d, txItemsQ), fkRows(t, d, topRows); items != items0 || top != top0 {
			t.Errorf("items %s (were %s), top %s (was %s)", items, items0, top, top0)
		}
	})

	t.Run("foreign key, write pipelined behind it", func(t *testing.T) {
		t.Parallel()
		db, d := fkDB(t, specs, txAloneSchema)
		c := rvSession(t, p, db, "", "5")
		items0, top0 := fkRows(t, d, txItemsQ), fkRows(t, d, topRows)
		// Sent together: the proxy reads the write while the DDL runs.
		fe := c.PgConn().Frontend()
		fe.Send(&pgproto3.Query{String: addFK})
		fe.Send(&pgproto3.Query{String: viaTopTwo})
		if err := fe.Flush(); err != nil {
			t.Fatal(err)
		}
		var codes []string
		for ready := 0; ready < 2; {
			msg, err := fe.Receive()
			if err != nil {
				t.Fatal(err)
			}
			switch m := msg.(type) {
			case *pgproto3.ErrorResponse:
				codes = append(codes, m.Code+": "+m.Message)
			case *pgproto3.ReadyForQuery:
				ready++
			}
		}
		if len(codes) != 1 || codes[0][:len(rules.CodeRefused)] != rules.CodeRefused {
			t.Errorf("the DDL and the write behind it: errors %q, want one FP003 (the write's)", codes)
		}
		if items, top := fkRows(t, d, txItemsQ), fkRows(t, d, topRows); items != items0 || top != top0 {
			t.Errorf("items %s (were %s), top %s (was %s)", items, items0, top, top0)
		}
	})

	t.Run("partition, then a write through it", func(t *testing.T) {
		t.Parallel()
		db, d := fkDB(t, specs, txAloneSchema)
		c := rvSession(t, p, db, "", "5")
		ctx := ctxT(t)
		if _, err := c.PgConn().Exec(ctx, "CREATE TABLE mid_2 PARTITION OF mid FOR VALUES FROM (100) TO (200)").ReadAll(); err != nil {
			t.Fatalf("CREATE TABLE ... PARTITION OF as a Query of its own: %v", err)
		}
		execDirect(t, d, "INSERT INTO mid VALUES (150, 1); INSERT INTO items (id, order_id, last_fence) VALUES (30, 150, 9)")
		items0 := fkRows(t, d, txItemsQ)
		_, err := c.PgConn().Exec(ctx, "DELETE FROM mid_2").ReadAll()
		if !fkRefused(err) {
			t.Errorf("DELETE FROM mid_2: %v, want FP003 for the path", err)
		}
		if items := fkRows(t, d, txItemsQ); items != items0 {
			t.Errorf("items %s, were %s", items, items0)
		}
	})

	t.Run("not alone", func(t *testing.T) {
		t.Parallel()
		db, d := fkDB(t, specs, txAloneSchema)
		c := rvSession(t, p, db, "", "5")
		ctx := ctxT(t)
		// Parse, Bind, Execute: a later message before the Sync would
		// share the transaction.
		if err := c.PgConn().ExecParams(ctx, addFK, nil, nil, nil, nil).Read().Err; !fkRefused(err) {
			t.Errorf("%s in the extended protocol: %v, want FP003", addFK, err)
		}
		if _, err := c.PgConn().Exec(ctx, addFK+"; SELECT 1").ReadAll(); !fkRefused(err) {
			t.Errorf("%s with another statement: %v, want FP003", addFK, err)
		}
		var n int
		if err := d.QueryRow(ctx, fkCount).Scan(&n); err != nil || n != 0 {
			t.Errorf("%s: %d, %v; want 0 (the DDL must not have run)", fkCount, n, err)
		}
	})
}
