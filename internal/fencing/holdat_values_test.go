package fencing_test

import (
	"fmt"
	"strconv"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/fenceproxy/fenceproxy/internal/proxytest"
	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// oddLockNames are lock names that need dollar quotes, hold the quote tag,
// are multibyte, hold a line break, or are as long as a lock name may be
// (1024 bytes).
var oddLockNames = []string{
	"L",
	`L'x`,
	`L\x`,
	`$fp$`,
	`a$fp$b$fpx$c'\`,
	"ключ-锁🔒",
	"two\nlines",
	strings.Repeat("k", 1023) + "'",
	strings.Repeat("é", 512),
}

// oddLockSession connects to db through p with token tok and lock lk, in mode
// (marked by runPid); a lock too large for a startup packet is SET.
func oddLockSession(t *testing.T, p *proxytest.Proxy, db, lk, tok string, mode pgx.QueryExecMode) *pgx.Conn {
	t.Helper()
	if len(lk) < 1000 {
		return runPid(t, readerSession(t, p, db, lk, tok, mode))
	}
	c := runPid(t, readerSession(t, p, db, "", tok, mode))
	if _, err := c.PgConn().Exec(ctxT(t), "SET fence.lock = "+sqlQuote(lk)).ReadAll(); err != nil {
		t.Fatalf("SET fence.lock (%d bytes): %v", len(lk), err)
	}
	return c
}

// sqlQuote quotes s as a string constant (standard_conforming_strings on).
func sqlQuote(s string) string { return "'" + strings.ReplaceAll(s, "'", "''") + "'" }

// oddLockWrite runs the update of acct row id on c: a simple Query, or a Bind
// of the prepared statement; it returns the error and whether the server
// ran one call of hold_at/rehold_at (and nothing reading the settings)
// in front of it.
func oddLockWrite(t *testing.T, d, c *pgx.Conn, id int, bind bool) (bool, error) {
	t.Helper()
	if !bind {
		proc, err := sentProc(t, d, c, fmt.Sprintf("UPDATE acct SET n = n + 1 WHERE id = %d", id))
		return proc != "", err
	}
	ran, err := bindRan(t, c, "UPDATE acct SET n = n + 1 WHERE id = $1", id)
	return byValue(t, ran), err
}

// TestHoldAtOddLockNames: lock names that need dollar quotes, hold the
// quote's tag, are multibyte, hold a line break or are as long as a lock
// name may be, in the simple Query (hold_at's CALL and the filled text
// built in one builder) and a Bind (hold_at's parameters in a reused
// buffer): each holder registers by value, the newer holder's token
// makes the older one's writes fail with FP001 and change nothing, and
// a session that moves to a newer token and back is refused too. The
// watermarks and the rows are read back from PostgreSQL.
func TestHoldAtOddLockNames(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	for _, bind := range []bool{false, true} {
		name := "simple"
		mode := pgx.QueryExecModeSimpleProtocol
		if bind {
			name, mode = "bind", pgx.QueryExecModeCacheStatement
		}
		t.Run(name, func(t *testing.T) {
			pol, _ := raPolicy(t, lockRules)
			p := startProxy(t, pol)
			db, d := bindDB(t, "")
			for i, lk := range oddLockNames {
				show := lk
				if len(show) > 20 {
					show = fmt.Sprintf("%s... (%d bytes)", show[:10], len(show))
				}
				base := int64(100 * (i + 1))
				a := oddLockSession(t, p, db, lk, strconv.FormatInt(base, 10), mode)
				b := oddLockSession(t, p, db, lk, strconv.FormatInt(base+1, 10), mode)
				for k := range 2 {
					ok, err := oddLockWrite(t, d, a, 3, bind)
					if err != nil || !ok {
						t.Fatalf("lock %q: holder %d write %d: %v (by value %v)", show, base, k, err, ok)
					}
				}
				if w := lockWatermark(t, d, lk); w != base {
					t.Errorf("lock %q: watermark %d, want %d", show, w, base)
				}
				if r := snapshot(t, d, "acct")[3]; r.Fence != base {
					t.Errorf("lock %q: row 3 fence %d, want %d", show, r.Fence, base)
				}
				if ok, err := oddLockWrite(t, d, b, 3, bind); err != nil || !ok {
					t.Fatalf("lock %q: newer holder %d: %v (by value %v)", show, base+1, err, ok)
				}
				before := snapshot(t, d, "acct")
				for k := range 2 {
					if _, err := oddLockWrite(t, d, a, 3, bind); sqlState(err) != "FP001" {
						t.Errorf("lock %q: stale holder %d write %d: %v, want FP001", show, base, k, err)
					}
				}
				wantUnchanged(t, d, "acct", before)
				// The stale session moves on to a newer token, then back.
				mustExec(t, a, "SET fence.token = '"+strconv.FormatInt(base+2, 10)+"'")
				if ok, err := oddLockWrite(t, d, a, 3, bind); err != nil || !ok {
					t.Errorf("lock %q: token %d: %v (by value %v)", show, base+2, err, ok)
				}
				mustExec(t, a, "SET fence.token = '"+strconv.FormatInt(base, 10)+"'")
				before = snapshot(t, d, "acct")
				if _, err := oddLockWrite(t, d, a, 3, bind); sqlState(err) != "FP001" {
					t.Errorf("lock %q: back to token %d: %v, want FP001", show, base, err)
				}
				if _, err := oddLockWrite(t, d, b, 3, bind); sqlState(err) != "FP001" {
					t.Errorf("lock %q: holder %d after %d: %v, want FP001", show, base+1, base+2, err)
				}
				wantUnchanged(t, d, "acct", before)
				if w := lockWatermark(t, d, lk); w != base+2 {
					t.Errorf("lock %q: watermark %d, want %d", show, w, base+2)
				}
				if r := snapshot(t, d, "acct")[3]; r.Fence != base+2 {
					t.Errorf("lock %q: row 3 fence %d, want %d", show, r.Fence, base+2)
				}
			}
			// No lock other than those named got a watermark.
			if got := testutil.QueryStrings(t, d, "SELECT count(*)::text FROM fenceproxy.locks"); len(got) != 1 || got[0] != strconv.Itoa(len(oddLockNames)) {
				t.Errorf("fenceproxy.locks has %v rows, want %d", got, len(oddLockNames))
			}
		})
	}
}
