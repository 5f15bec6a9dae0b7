package fencing_test

import (
	"errors"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/fenceproxy/fenceproxy/internal/dbsetup"
	"github.com/fenceproxy/fenceproxy/internal/policy"
	"github.com/fenceproxy/fenceproxy/internal/rules"
	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// cascadeSchema: orders and its items, whose foreign key deletes them
// with their order and follows its id, each with a fence column.
const cascadeSchema = `
CREATE TABLE orders (id bigint PRIMARY KEY, note text NOT NULL DEFAULT '', last_fence bigint NOT NULL DEFAULT 0);
CREATE TABLE items (id bigint PRIMARY KEY, order_id bigint NOT NULL REFERENCES orders ON DELETE CASCADE ON UPDATE CASCADE,
	qty int NOT NULL DEFAULT 1, last_fence bigint NOT NULL DEFAULT 0);
INSERT INTO orders (id) VALUES (1), (2);
INSERT INTO items (id, order_id) VALUES (10, 1), (20, 2);
`

// TestCascadeBetweenProtectedTables: a foreign key action of one
// protected table's statement runs a query of its own on another
// protected table, which the fence of the statement does not reach. Where
// the items are row-fenced, a holder of token 5 deleting an order (its
// fence 0) would delete items a holder of 9 wrote: the DELETE is refused
// (FP003, naming the foreign key), in the simple and the extended
// protocol, and the items are still there; so is an upsert that may
// update an order's id, which the items follow, while a plain INSERT and
// an UPDATE of no key run. Where both tables are fenced
// by the lock alone (lock: required, no column), the statement's
// registration covers the items as a direct write would, and the DELETE
// runs for the current holder and is refused (FP001) for a stale one.
func TestCascadeBetweenProtectedTables(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	for _, tc := range []struct {
		name   string
		tables []rules.Table
		row    bool
	}{
		{"row-fenced items", []rules.Table{{Table: "public.orders"}, {Table: "public.items"}}, true},
		{"lock-only tables", []rules.Table{
			{Table: "public.orders", Lock: rules.LockRequired},
			{Table: "public.items", Lock: rules.LockRequired},
		}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			cfg := rules.Config{Tables: tc.tables}
			checker, specs := startChecker(t, cfg)
			rs, err := rules.Compile(cfg)
			if err != nil {
				t.Fatal(err)
			}
			p := startProxy(t, policy.New(rs, false, policy.Options{Checks: checker}))
			db := schemaDB(t, "cascade", cascadeSchema)
			d := direct(t, db)
			if _, err := dbsetup.Setup(ctxT(t), d, specs, dbsetup.SetupOptions{}); err != nil {
				t.Fatal(err)
			}
			items := func() string {
				var s string
				if err := d.QueryRow(ctxT(t), "SELECT coalesce(string_agg(id::text, ',' ORDER BY id), '') FROM items").Scan(&s); err != nil {
					t.Fatal(err)
				}
				return s
			}
			if tc.row {
				execDirect(t, d, "UPDATE items SET last_fence = 9")
				c := rvSession(t, p, db, "", "5")
				for _, q := range []struct {
					name string
					args []any
					sql  string
				}{
					{"simple", nil, "DELETE FROM orders WHERE id = 1"},
					{"extended", []any{1}, "DELETE FROM orders WHERE id = $1"},
				} {
					_, err := c.Exec(ctxT(t), q.sql, q.args...)
					var pe *pgconn.PgError
					if !errors.As(err, &pe) || pe.Code != rules.CodeRefused || !strings.Contains(pe.Message+pe.Detail, "items_order_id_fkey") {
						t.Errorf("%s: %v, want FP003 naming the foreign key", q.name, err)
					}
				}
				if got := items(); got != "10,20" {
					t.Errorf("items after the refused deletes: %q, want 10,20", got)
				}
				// An upsert may update an id: refused too.
				_, err := c.Exec(ctxT(t), "INSERT INTO orders (id) VALUES ($1) ON CONFLICT (id) DO UPDATE SET id = 7", 2)
				var pe *pgconn.PgError
				if !errors.As(err, &pe) || pe.Code != rules.CodeRefused {
					t.Errorf("upsert: %v, want FP003", err)
				}
				if got := items(); got != "10,20" {
					t.Errorf("items after the refused upsert: %q, want 10,20", got)
				}
				// So is an UPDATE of the key.
				_, err = c.Exec(ctxT(t), "UPDATE orders SET id = 7 WHERE id = $1", 2)
				if !errors.As(err, &pe) || pe.Code != rules.CodeRefused {
					t.Errorf("update of the key: %v, want FP003", err)
				}
				// A plain INSERT and an UPDATE of other columns run no
				// action: they run.
				mustExec(t, c, "INSERT INTO orders (id) VALUES ($1)", 3)
				mustExec(t, c, "UPDATE orders SET note = 'x' WHERE id = $1", 2)
				var note string
				if err := d.QueryRow(ctxT(t), "SELECT note || last_fence FROM orders WHERE id = 2").Scan(&note); err != nil || note != "x5" {
					t.Errorf("order 2: %q, %v; want x5 (fenced with token 5)", note, err)
				}
				if got := items(); got != "10,20" {
					t.Errorf("items at the end: %q, want 10,20", got)
				}
				return
			}
			c := rvSession(t, p, db, "L", "5")
			mustExec(t, c, "DELETE FROM orders WHERE id = $1", 1)
			if got := items(); got != "20" {
				t.Errorf("items after the current holder's delete: %q, want 20", got)
			}
			mustExec(t, rvSession(t, p, db, "L", "9"), "SELECT count(*) FROM orders")
			_, err = c.Exec(ctxT(t), "DELETE FROM orders WHERE id = $1", 2)
			var pe *pgconn.PgError
			if !errors.As(err, &pe) || pe.Code != "FP001" {
				t.Errorf("stale holder's delete: %v, want FP001", err)
			}
			if got := items(); got != "20" {
				t.Errorf("items after the stale holder's delete: %q, want 20", got)
			}
		})
	}
}
