package policy_test

import (
	"strconv"
	"strings"
	"testing"
)

// TestLargeInsert sends a 5,000-row INSERT through the proxy: with a fresh
// token every row is stored with the token as its watermark; with an
// invalid one the statement fails with FP002 and stores nothing.
func TestLargeInsert(t *testing.T) {
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
