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
// with their order, each with a fence column.
const cascadeSchema = `
CREATE TABLE orders (id bigint PRIMARY KEY, note text NOT NULL DEFAULT '', last_fence bigint NOT NULL DEFAULT 0);
CREATE TABLE items (id bigint PRIMARY KEY, order_id bigint NOT NULL REFERENCES orders ON DELETE CASCADE,
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
// protocol, and the items are still there. Where both tables are fenced
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
				// Writes of orders that run no action still run.
				mustExec(t, c, "UPDATE orders SET note = 'x' WHERE id = $1", 2)
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
