package catalog_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/fenceproxy/fenceproxy/internal/catalog"
)

// TestLookupColumnDroppedMeanwhile: a table dropped and created again on
// another connection after a repeatable-read transaction found it. The
// snapshot still shows the old table's column and default, but
// pg_get_expr reads the latest catalog and prints nothing: LookupColumn
// says the relation changed rather than that the column has no default,
// and a new transaction reads the new table's default.
func TestLookupColumnDroppedMeanwhile(t *testing.T) {
	db := newDatabase(t)
	conn, other := connect(t, db), connect(t, db)
	const table = `CREATE TABLE t (id int PRIMARY KEY, last_fence bigint NOT NULL DEFAULT 0)`
	execSQL(t, conn, table)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()

	tx, err := conn.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead, AccessMode: pgx.ReadOnly})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	rel, err := catalog.LookupTable(ctx, tx, "public", "t")
	if err != nil || rel == nil {
		t.Fatalf("LookupTable: %v, %v", rel, err)
	}
	execSQL(t, other, "DROP TABLE t; "+table)

	col, err := catalog.LookupColumn(ctx, tx, rel, "last_fence")
	if !errors.Is(err, catalog.ErrChanged) {
		t.Fatalf("LookupColumn of the dropped table: %+v, %v; want ErrChanged", col, err)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}

	rel, err = catalog.LookupTable(ctx, conn, "public", "t")
	if err != nil || rel == nil {
		t.Fatalf("LookupTable again: %v, %v", rel, err)
	}
	col, err = catalog.LookupColumn(ctx, conn, rel, "last_fence")
	if err != nil || !col.Exists || col.Default == nil || *col.Default != "0" {
		t.Fatalf("LookupColumn of the new table: %+v, %v; want DEFAULT 0", col, err)
	}
	// A column without a default is still told as one.
	execSQL(t, other, "ALTER TABLE t ALTER COLUMN last_fence DROP DEFAULT")
	col, err = catalog.LookupColumn(ctx, conn, rel, "last_fence")
	if err != nil || !col.Exists || col.Default != nil {
		t.Fatalf("LookupColumn without a default: %+v, %v", col, err)
	}
}
