package fencing_test

import (
	"strconv"
	"strings"
	"testing"

	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// TestLargeInsert sends a 5,000-row INSERT through the proxy: with a fresh
// token every row is stored with the token as its watermark; with an
// invalid one the statement fails with FP002 and stores nothing.
func TestLargeInsert(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	e := startEnv(t)
	db := e.newDB(t)
	d := direct(t, db)
	c := e.connect(t, db)
	const rows = 5000
	var b strings.Builder
	b.WriteString("INSERT INTO acct (id, payload) VALUES ")
	for i := 1; i <= rows; i++ {
		if i > 1 {
			b.WriteString(",")
		}
		b.WriteString("(" + strconv.Itoa(1000+i) + ", 'x')")
	}
	sql := b.String()

	setToken(t, c, "abc")
	before := snapshot(t, d, tError)
	_, err := c.PgConn().Exec(ctxT(t), sql).ReadAll()
	wantCode(t, err, "FP002")
	wantUnchanged(t, d, tError, before)

	setTokenN(t, c, 42)
	res, err := c.PgConn().Exec(ctxT(t), sql).ReadAll()
	if err != nil {
		t.Fatal(err)
	}
	if n := res[0].CommandTag.RowsAffected(); n != rows {
		t.Fatalf("%d rows inserted, want %d", n, rows)
	}
	var count, stamped int
	if err := d.QueryRow(ctxT(t), "SELECT count(*), count(*) FILTER (WHERE last_fence = 42) FROM acct WHERE id > 1000 AND payload = 'x'").
		Scan(&count, &stamped); err != nil {
		t.Fatal(err)
	}
	if count != rows || stamped != rows {
		t.Fatalf("%d rows stored, %d with last_fence 42; want %d and %d", count, stamped, rows, rows)
	}
}

// TestLargeListInFencedCondition: a long VALUES list inside a DELETE's
// WHERE or a MERGE DELETE's condition, which the rewrite repeats in its
// check, is fenced for every id of the list, not only the first ones
// (the reduced-statement path for long VALUES lists must not apply).
func TestLargeListInFencedCondition(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	e := startEnv(t)
	db := e.newDB(t)
	d := direct(t, db)
	c := e.connect(t, db)
	ids := make([]string, 1000)
	for i := range ids {
		ids[i] = "(" + strconv.Itoa(i+1) + ")"
	}
	list := "(VALUES " + strings.Join(ids, ", ") + ")"
	for _, sql := range []string{
		"DELETE FROM acct WHERE id IN " + list,
		"MERGE INTO acct t USING (SELECT g AS id FROM generate_series(1, 1000) g) s ON t.id = s.id WHEN MATCHED AND t.id IN " + list + " THEN DELETE",
	} {
		resetTable(t, d, tError)
		// Row 3 holds the list's third id: the first one a reduced
		// statement with two of the list's rows would leave out.
		setFences(t, d, tError, map[int64]int64{3: 50})
		before := snapshot(t, d, tError)
		setTokenN(t, c, 42)
		_, err := c.PgConn().Exec(ctxT(t), sql).ReadAll()
		if sqlState(err) != "FP001" {
			t.Errorf("%.40s…: %v, want FP001", sql, err)
		}
		wantUnchanged(t, d, tError, before)
	}
}
