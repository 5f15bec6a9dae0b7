package fencing_test

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgproto3"

	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// Adversarial review of 7669ad3: a Bind of a lock-fenced statement's
// parameter form, alone before its Sync, registers with one call of
// fenceproxy.hold_at($1..$4) (no set_config) in place of
// fenceproxy.enter. Behind PgBouncer (transaction mode, one server
// connection) the connection carries another client's token 43 and lock
// X; the session's are 44 and L (watermark 42). Whatever reads the
// settings in the Bind's transaction must see 44/L, and an older token
// must change nothing.

const rhRec = "INSERT INTO seen2 VALUES ('%s', current_setting('fence.token', true) || '/' || coalesce(current_setting('fence.lock', true), ''))"

// TestReviewHoldAtBindLaterReaders: statements after the registering Bind
// in the same implicit transaction (a Query, another statement's
// Parse/Bind/Execute, a row-limited Execute then a Query, a Flush then a
// Query, and the later messages sent in a separate TCP write after the
// Bind/Execute had been read) must read the session's 44/L, and the
// lock's watermark and rows must be 44.
func TestReviewHoldAtBindLaterReaders(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	e := rbStart(t)
	e.pe.pollute(t, e.db, "43", "X")
	c := e.sess(t, "44", "L")
	rbPrepare(t, c, "s_up", "UPDATE acct SET n = n + 1 WHERE id >= $1 RETURNING id")
	bind := func(p string) *pgproto3.Bind {
		return &pgproto3.Bind{DestinationPortal: p, PreparedStatement: "s_up", Parameters: [][]byte{[]byte("1")}}
	}
	q := func(tag string) *pgproto3.Query { return &pgproto3.Query{String: fmt.Sprintf(rhRec, tag)} }
	for _, tc := range []struct {
		tag   string
		ready int
		msgs  []pgproto3.FrontendMessage
	}{
		{"query", 2, []pgproto3.FrontendMessage{bind(""), &pgproto3.Execute{}, q("query")}},
		{"parse", 1, []pgproto3.FrontendMessage{bind("p"), &pgproto3.Execute{Portal: "p"}, &pgproto3.Parse{Query: fmt.Sprintf(rhRec, "parse")}, &pgproto3.Bind{}, &pgproto3.Execute{}}},
		{"rowlimit", 2, []pgproto3.FrontendMessage{bind("p"), &pgproto3.Execute{Portal: "p", MaxRows: 1}, &pgproto3.Execute{Portal: "p", MaxRows: 1}, q("rowlimit")}},
		{"flush", 2, []pgproto3.FrontendMessage{bind(""), &pgproto3.Execute{}, &pgproto3.Flush{}, q("flush")}},
		{"secondbind", 1, []pgproto3.FrontendMessage{bind("p"), &pgproto3.Execute{Portal: "p"}, &pgproto3.Parse{Name: "s_rec", Query: fmt.Sprintf(rhRec, "secondbind")}, &pgproto3.Bind{DestinationPortal: "q", PreparedStatement: "s_rec"}, &pgproto3.Execute{Portal: "q"}}},
	} {
		if errs := raPipeline(t, c, tc.ready, append(tc.msgs, &pgproto3.Sync{})...); len(errs) > 0 {
			t.Fatalf("%s: %v", tc.tag, errs)
		}
		if got := e.seen(t, tc.tag); got != "44/L" {
			t.Errorf("%s: a statement after the Bind, before the Sync, read %q, want 44/L", tc.tag, got)
		}
	}

	// Split writes: the Bind, Execute and Flush are read (and answered)
	// before the rest of the implicit transaction arrives.
	for _, tag := range []string{"split-parse", "split-query"} {
		var first []byte
		for _, m := range []pgproto3.FrontendMessage{bind(""), &pgproto3.Execute{}, &pgproto3.Flush{}} {
			first, _ = m.Encode(first)
		}
		nc := c.PgConn().Conn()
		if _, err := nc.Write(first); err != nil {
			t.Fatal(err)
		}
		time.Sleep(300 * time.Millisecond)
		var later []pgproto3.FrontendMessage
		if tag == "split-parse" {
			later = []pgproto3.FrontendMessage{&pgproto3.Parse{Query: fmt.Sprintf(rhRec, tag)}, &pgproto3.Bind{}, &pgproto3.Execute{}, &pgproto3.Sync{}}
		} else {
			later = []pgproto3.FrontendMessage{&pgproto3.Sync{}, q(tag)}
		}
		ready := 1
		if tag == "split-query" {
			ready = 2
		}
		if errs := raPipeline(t, c, ready, later...); len(errs) > 0 {
			t.Fatalf("%s: %v", tag, errs)
		}
		if got := e.seen(t, tag); tag == "split-parse" && got != "44/L" {
			t.Errorf("%s: a statement sent after the Bind was read, before the Sync, read %q, want 44/L", tag, got)
		}
	}
	if w := lockWatermark(t, e.d, "L"); w != 44 {
		t.Errorf("lock L's watermark %d, want 44", w)
	}
	for id, r := range snapshot(t, e.d, "acct") {
		if r.Fence != 44 {
			t.Errorf("row %d stamped %d, want 44", id, r.Fence)
		}
	}
}

// TestReviewHoldAtBindReplacedTrigger: a trigger on acct whose function
// reads no setting when the proxy checks the database is replaced, on
// another connection, by one reading fence.token and fence.lock (CREATE
// OR REPLACE FUNCTION: the trigger itself is unchanged). A Bind
// registering by value afterwards must have the trigger see the
// session's 44/L, never the pooled connection's 43/X.
func TestReviewHoldAtBindReplacedTrigger(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	e := rbStart(t)
	execDirect(t, e.d, `CREATE FUNCTION rh_nt() RETURNS trigger LANGUAGE plpgsql AS $$BEGIN RETURN NEW; END$$;
		CREATE TRIGGER rh_nt BEFORE UPDATE ON acct FOR EACH ROW EXECUTE FUNCTION rh_nt()`)
	e.pe.pollute(t, e.db, "43", "X")
	c := e.sess(t, "44", "L")
	const upd = "UPDATE acct SET n = n + 1 WHERE id = $1"
	waitUntil(t, "the Bind registers by value", func() bool { return byValue(t, mustBindRan(t, c, upd, 2)) })
	execDirect(t, e.d, `CREATE OR REPLACE FUNCTION rh_nt() RETURNS trigger LANGUAGE plpgsql AS $$BEGIN
		INSERT INTO seen2 VALUES ('trg', current_setting('fence.token', true) || '/' || coalesce(current_setting('fence.lock', true), ''));
		RETURN NEW; END$$`)
	ran := mustBindRan(t, c, upd, 3)
	if got := e.seen(t, "trg"); got != "44/L" {
		t.Errorf("a trigger function replaced on another connection read %q, want 44/L (by value: %v)", got, byValue(t, ran))
	}
	if w := lockWatermark(t, e.d, "L"); w != 44 {
		t.Errorf("lock L's watermark %d, want 44", w)
	}
}

// TestReviewHoldAtBindOddTokens: tokens that leave hold_at's common case
// (over 18 characters with leading zeros; SERIALIZABLE by the session's
// default) go through register with the settings set from the values:
// an older one is refused with FP001 and changes nothing (rows and
// watermark), a newer one moves the watermark to its value, and a
// statement after it in the same transaction reads the session's.
func TestReviewHoldAtBindOddTokens(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	e := rbStart(t)
	e.pe.pollute(t, e.db, "99", "L")
	const upd = "UPDATE acct SET payload = $2 WHERE id = $1"
	z := strings.Repeat("0", 20)

	for _, tc := range []struct{ name, tok, iso string }{
		{"leading zeros", z + "41", ""},
		{"serializable", "41", "serializable"},
		{"repeatable read, zeros", z + "41", "repeatable read"},
	} {
		s := e.sess(t, tc.tok, "L")
		if tc.iso != "" {
			mustSend(t, s, "SET default_transaction_isolation = '"+tc.iso+"'")
		}
		before := snapshot(t, e.d, "acct")
		ran, err := bindRan(t, s, upd+" /* "+tc.iso+tc.tok+" */", 2, "stale")
		if sqlState(err) != "FP001" {
			t.Errorf("%s: older token: %v, want FP001\n%s", tc.name, err, strings.Join(ran, "\n"))
		}
		wantUnchanged(t, e.d, "acct", before)
		if w := lockWatermark(t, e.d, "L"); w != 42 {
			t.Errorf("%s: watermark %d after an older token, want 42", tc.name, w)
		}
	}

	n := e.sess(t, z+"50", "L")
	ran := mustBindRan(t, n, upd+" /* n */", 2, "w50")
	if w := lockWatermark(t, e.d, "L"); w != 50 {
		t.Errorf("a newer token with leading zeros: watermark %d, want 50\n%s", w, strings.Join(ran, "\n"))
	}
	if r := snapshot(t, e.d, "acct")[2]; r.Payload != "w50" || r.Fence != 50 {
		t.Errorf("row 2 = %+v, want w50 stamped 50", r)
	}
	rbPrepare(t, n, "s_up", upd+" /* n2 */")
	if errs := raPipeline(t, n, 2, &pgproto3.Bind{PreparedStatement: "s_up", Parameters: [][]byte{[]byte("3"), []byte("z")}}, &pgproto3.Execute{},
		&pgproto3.Query{String: fmt.Sprintf(rhRec, "zeros")}, &pgproto3.Sync{}); len(errs) > 0 {
		t.Fatal(errs)
	}
	if got := e.seen(t, "zeros"); got != z+"50/L" {
		t.Errorf("after a registration through register: read %q, want %s/L", got, z+"50")
	}
	// The holder of 42 ... older than 50 now: refused.
	o := e.sess(t, "42", "L")
	before := snapshot(t, e.d, "acct")
	if _, err := bindRan(t, o, upd+" /* o */", 1, "old"); sqlState(err) != "FP001" {
		t.Errorf("the holder of 42 after 50: %v, want FP001", err)
	}
	wantUnchanged(t, e.d, "acct", before)
}
