package fencing_test

import (
	"context"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// TestDDLOpeningPathsInTransaction: DDL sent through the proxy that would
// open a path to a protected table is refused, since a write later in
// the same transaction would be decided with the paths from before it (the
// catalog check counts a transaction's own changes only once it
// commits). Each case runs BEGIN, the DDL, the write, COMMIT, in both
// protocols; the items, which a newer holder (fence 9) wrote, must be
// unchanged, and the DDL must not have run. Cases: a foreign key added to
// a path relation, a partition created or attached under one, and key
// columns renamed where the path counts only UPDATEs setting the key.
func TestDDLOpeningPathsInTransaction(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	p, specs := fkProxy(t, fkRowRules)
	// items follow mid (unprotected) ON DELETE CASCADE: mid is a path to
	// items; top and mid_top are unrelated until a foreign key ties them.
	const schema = `
CREATE TABLE orders (id bigint PRIMARY KEY, code text, note text NOT NULL DEFAULT '', last_fence bigint NOT NULL DEFAULT 0);
CREATE TABLE top (id bigint PRIMARY KEY);
INSERT INTO top VALUES (1), (2);
CREATE TABLE mid (id bigint PRIMARY KEY, top_id bigint) PARTITION BY RANGE (id);
CREATE TABLE mid_1 PARTITION OF mid FOR VALUES FROM (0) TO (100);
INSERT INTO mid VALUES (1, 1), (2, 2);
CREATE TABLE owner (id bigint PRIMARY KEY, name bigint);
INSERT INTO owner VALUES (1, 1), (2, 2);
CREATE TABLE items (id bigint PRIMARY KEY, order_id bigint REFERENCES mid ON DELETE CASCADE,
	owner_id bigint REFERENCES owner ON UPDATE CASCADE, last_fence bigint NOT NULL DEFAULT 0);
INSERT INTO items (id, order_id, owner_id, last_fence) VALUES (10, 1, 1, 9), (20, 2, 2, 9);
`
	for _, k := range []struct {
		name, ddl, write, created string
	}{
		{name: "foreign key added to a path relation", ddl: "ALTER TABLE mid ADD FOREIGN KEY (top_id) REFERENCES top ON DELETE CASCADE",
			write: "DELETE FROM top WHERE id = 1", created: "SELECT count(*) FROM pg_constraint WHERE conrelid = 'mid'::regclass AND contype = 'f'"},
		{name: "partition of a path relation", ddl: "CREATE TABLE mid_2 PARTITION OF mid FOR VALUES FROM (100) TO (200)",
			write: "DELETE FROM mid_2", created: "SELECT count(*) FROM pg_class WHERE relname = 'mid_2'"},
		{name: "child of a path relation, qualified", ddl: "CREATE TABLE public.mid_3 (LIKE public.mid); ALTER TABLE public.mid ATTACH PARTITION public.mid_3 FOR VALUES FROM (200) TO (300)",
			write: "DELETE FROM mid_3", created: "SELECT count(*) FROM pg_class WHERE relname = 'mid_3'"},
		// An UPDATE of owner reaches items only by setting id: swapped
		// names would let one that sets the key pass for one that does
		// not.
		{name: "key column renamed", ddl: "ALTER TABLE owner RENAME COLUMN id TO tmp; ALTER TABLE owner RENAME COLUMN name TO id; ALTER TABLE owner RENAME COLUMN tmp TO name",
			write: "UPDATE owner SET name = 7 WHERE name = 1", created: "SELECT count(*) FROM pg_attribute WHERE attrelid = 'owner'::regclass AND attnum = 1 AND attname <> 'id'"},
	} {
		for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeCacheStatement, pgx.QueryExecModeSimpleProtocol} {
			t.Run(k.name+"/"+mode.String(), func(t *testing.T) {
				t.Parallel()
				db, d := fkDB(t, specs, schema)
				c := rvSession(t, p, db, "", "5")
				ctx := ctxT(t)
				items0 := fkRows(t, d, txItemsQ)
				if err := execIn(ctx, c, "BEGIN", mode); err != nil {
					t.Fatal(err)
				}
				derr := execIn(ctx, c, k.ddl, mode)
				var werr error
				if derr == nil {
					werr = execIn(ctx, c, k.write, mode)
				}
				cerr := execIn(ctx, c, "COMMIT", mode)
				if !fkRefused(derr) {
					t.Errorf("%s: %v (write: %v, commit: %v), want FP003", k.ddl, derr, werr, cerr)
				}
				if items := fkRows(t, d, txItemsQ); items != items0 {
					t.Errorf("items changed: %s, were %s", items, items0)
				}
				var n int
				if err := d.QueryRow(ctx, k.created).Scan(&n); err != nil || n != 0 {
					t.Errorf("%s: %d, %v; want 0 (the DDL must not have run)", k.created, n, err)
				}
			})
		}
	}
}

// txItemsQ is items' rows, id:order_id:owner_id:last_fence by id.
const txItemsQ = "SELECT id, id || ':' || coalesce(order_id::text, 'null') || ':' || coalesce(owner_id::text, 'null') || ':' || last_fence FROM items"

// execIn runs sql on c in mode: in the simple protocol as one Query, in
// the extended one as a Parse, Bind and Execute per statement (sql split
// at each semicolon: the callers' texts have none inside literals). pgx's
// Exec with no arguments would use the simple protocol in every mode.
func execIn(ctx context.Context, c *pgx.Conn, sql string, mode pgx.QueryExecMode) error {
	if mode == pgx.QueryExecModeSimpleProtocol {
		_, err := c.PgConn().Exec(ctx, sql).ReadAll()
		return err
	}
	for _, stmt := range strings.Split(sql, ";") {
		if strings.TrimSpace(stmt) == "" {
			continue
		}
		if err := c.PgConn().ExecParams(ctx, stmt, nil, nil, nil, nil).Read().Err; err != nil {
			return err
		}
	}
	return nil
}

// TestDDLRefusalAfterPathGone: DDL refused because its relation is a path
// (mid: items follow it ON DELETE CASCADE) runs once the path is gone on
// another connection: a refusal for a path waits for a stamp read, also
// when the proxy could answer it from its cache, so it is not kept from
// results older than the catalog.
func TestDDLRefusalAfterPathGone(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	p, specs := fkProxy(t, fkRowRules)
	db, d := fkDB(t, specs, txAloneSchema)
	c := rvSession(t, p, db, "", "5")
	// No word of a write in it: no stamp read for a write's sake.
	const addFK = "ALTER TABLE mid ADD FOREIGN KEY (top_id) REFERENCES top"
	if err := mpSimple(c, addFK); !fkRefused(err) {
		t.Fatalf("%s while mid is a path: %v, want FP003", addFK, err)
	}
	execDirect(t, d, "ALTER TABLE items DROP CONSTRAINT items_order_id_fkey")
	if err := mpSimple(c, addFK); err != nil {
		t.Fatalf("%s once mid is no path: %v", addFK, err)
	}
	var n int
	if err := d.QueryRow(ctxT(t), "SELECT count(*) FROM pg_constraint WHERE conrelid = 'mid'::regclass AND contype = 'f'").Scan(&n); err != nil || n != 1 {
		t.Errorf("foreign keys of mid: %d, %v; want 1", n, err)
	}
}
