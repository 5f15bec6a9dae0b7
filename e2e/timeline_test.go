package e2e_test

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/fenceproxy/fenceproxy/internal/rules"
)

// leaseTTL is the TTL the timeline's stale holder A asks for. etcd may grant
// more (its minimum is 1.5 election timeouts, 2s with the embedded
// defaults); the test waits for the key to disappear, whatever the TTL.
const leaseTTL = 2 * time.Second

// runSeq makes the lock keys of repeated runs (-count=N) distinct.
var runSeq atomic.Int64

// TestStaleHolderTimeline is the timeline of docs/design.md with real processes:
// A takes the lock (no keep-alive), stamps the row through fenceproxy, reads
// it and is then stopped with SIGSTOP until etcd has deleted its expired
// lock key. B takes the lock with a larger token, stamps, reads and writes.
// A is resumed and writes its stale copy. It must not land: with on_stale:
// error A gets FP001, with on_stale: skip its UPDATE reports 0 rows. Either
// way B's data is intact and the row carries B's token.
func TestStaleHolderTimeline(t *testing.T) {
	st := getStack(t)
	for _, tc := range []struct {
		onStale string
		table   string
	}{
		{"error", "public.timeline_error"},
		{"skip", "public.timeline_skip"},
	} {
		t.Run(tc.onStale, func(t *testing.T) {
			t.Parallel()
			createPayloadTable(t, st, tc.table)
			key := fmt.Sprintf("e2e/timeline/%s/%d", tc.onStale, runSeq.Add(1))
			a := startClient(t, st, "A")
			b := startClient(t, st, "B")

			tokenA, ttlA := a.lock(t, key, leaseTTL, "token")
			t.Logf("A holds %s with token %d (lease %v, no keep-alive)", key, tokenA, ttlA)
			a.wantRows(t, 1, "stamp %s 1", tc.table)
			if got := a.ok(t, "read %s 1", tc.table); got != "v1" {
				t.Fatalf("A read %q, want v1", got)
			}

			a.pause(t)
			t.Log("A stopped (SIGSTOP); waiting for etcd to delete its lock key")
			st.waitKeyGone(t, key)

			tokenB, _ := b.lock(t, key, 30*time.Second, "token")
			t.Logf("B holds %s with token %d", key, tokenB)
			if tokenB <= tokenA {
				t.Fatalf("B's token %d is not larger than A's %d", tokenB, tokenA)
			}
			b.wantRows(t, 1, "stamp %s 1", tc.table)
			if got := b.ok(t, "read %s 1", tc.table); got != "v1" {
				t.Fatalf("B read %q, want v1", got)
			}
			b.wantRows(t, 1, "write %s 1 v1+B", tc.table)

			a.resume(t)
			t.Log("A resumed (SIGCONT); it writes its stale copy")
			reply := a.call(t, "write %s 1 v1+A", tc.table)
			switch tc.onStale {
			case "error":
				code, msg := wantErr(t, reply)
				if code != rules.CodeStaleToken {
					t.Fatalf("A's stale write: got SQLSTATE %s (%s), want %s", code, msg, rules.CodeStaleToken)
				}
				for _, want := range []string{strconv.FormatInt(tokenA, 10), strings.TrimPrefix(tc.table, "public.")} {
					if !strings.Contains(msg, want) {
						t.Errorf("FP001 message %q does not mention %q", msg, want)
					}
				}
				t.Logf("A's stale write refused: %s %s", code, msg)
			case "skip":
				if got := wantOK(t, reply); got != "0" {
					t.Fatalf("A's stale write with on_stale: skip updated %s rows, want 0", got)
				}
				t.Log("A's stale write skipped: 0 rows")
			}

			// A can tell it lost the lock once it runs again: etcd has
			// deleted its key, so Release reports ErrNotHeld.
			if code, msg := wantErr(t, a.call(t, "release")); code != "notheld" {
				t.Errorf("A's release: got %s %s, want notheld", code, msg)
			}
			b.ok(t, "release")

			payload, fence := readPayloadRow(t, st, tc.table)
			if payload != "v1+B" || fence != tokenB {
				t.Fatalf("row = (%q, last_fence %d), want (%q, %d): B's write was not kept", payload, fence, "v1+B", tokenB)
			}
			t.Logf("row = (%q, last_fence %d): B's data intact", payload, fence)
		})
	}
}

// TestStampOrdersStaleWrite lands A's stale write in the gap between B's
// read and B's write. With the stamp (docs/design.md), B's stamp has already
// raised the row's watermark to B's token before B read, so A's write is
// refused and B reads and keeps a consistent row. Without the stamp, the row
// still carries no newer token when A writes, so the write is accepted,
// acknowledged to A and then overwritten by B, which computed its value from
// a read taken before it: a lost update no token check can see. The
// unstamped run is a demonstration: it logs what happened and asserts
// nothing about it.
func TestStampOrdersStaleWrite(t *testing.T) {
	st := getStack(t)
	for _, tc := range []struct {
		name  string
		table string
		stamp bool
	}{
		{"stamped", "public.between_stamped", true},
		{"unstamped", "public.between_unstamped", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			createPayloadTable(t, st, tc.table)
			key := fmt.Sprintf("e2e/between/%s/%d", tc.name, runSeq.Add(1))
			a := startClient(t, st, "A")
			b := startClient(t, st, "B")

			tokenA, _ := a.lock(t, key, leaseTTL, "token")
			if tc.stamp {
				a.wantRows(t, 1, "stamp %s 1", tc.table)
			}
			a.ok(t, "read %s 1", tc.table)
			a.pause(t)
			st.waitKeyGone(t, key)

			tokenB, _ := b.lock(t, key, 30*time.Second, "token")
			if tc.stamp {
				b.wantRows(t, 1, "stamp %s 1", tc.table)
			}
			readB := b.ok(t, "read %s 1", tc.table)

			a.resume(t)
			replyA := a.call(t, "write %s 1 v1+A", tc.table)
			replyB := b.call(t, "write %s 1 %s+B", tc.table, readB)
			payload, fence := readPayloadRow(t, st, tc.table)
			t.Logf("tokens A=%d B=%d; B read %q; A's write: %s; B's write: %s; final row (%q, last_fence %d)",
				tokenA, tokenB, readB, replyA, replyB, payload, fence)

			if !tc.stamp {
				if strings.HasPrefix(replyA, "ok 1") && strings.HasPrefix(replyB, "ok 1") && !strings.Contains(payload, "A") {
					t.Logf("without the stamp: A's write was acknowledged and then lost under B's, which was computed from an older read")
				}
				return
			}
			if code, msg := wantErr(t, replyA); code != rules.CodeStaleToken {
				t.Fatalf("A's stale write after B's stamp: got %s %s, want %s", code, msg, rules.CodeStaleToken)
			}
			if got := wantOK(t, replyB); got != "1" {
				t.Fatalf("B's write updated %s rows, want 1", got)
			}
			if payload != "v1+B" || fence != tokenB {
				t.Fatalf("row = (%q, %d), want (%q, %d)", payload, fence, "v1+B", tokenB)
			}
		})
	}
}

// createPayloadTable creates table (the seed's config row) with row 1 = v1.
func createPayloadTable(t *testing.T, st *stack, table string) {
	t.Helper()
	st.exec(t, fmt.Sprintf(`
		DROP TABLE IF EXISTS %[1]s;
		CREATE TABLE %[1]s (
			id         int PRIMARY KEY,
			payload    text NOT NULL,
			last_fence bigint NOT NULL DEFAULT 0
		);
		INSERT INTO %[1]s (id, payload) VALUES (1, 'v1');`, table))
}

// readPayloadRow reads row 1 straight from PostgreSQL.
func readPayloadRow(t *testing.T, st *stack, table string) (string, int64) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var payload string
	var fence int64
	if err := st.direct(t).QueryRow(ctx, "SELECT payload, last_fence FROM "+ident(table)+" WHERE id = 1").Scan(&payload, &fence); err != nil {
		t.Fatalf("read %s: %v", table, err)
	}
	return payload, fence
}

// clientProc is a scripted client worker (see runClient).
type clientProc struct{ *proc }

func startClient(t *testing.T, st *stack, name string) clientProc {
	t.Helper()
	return clientProc{startProc(t, roleClient, workerConfig{
		Name: name,
		DSN:  st.proxyDSN(),
		Etcd: st.etcdEndpoints(),
	})}
}

// call sends one command and returns the reply line.
func (c clientProc) call(t *testing.T, format string, args ...any) string {
	t.Helper()
	c.send(t, format, args...)
	return c.next(t)
}

// ok sends a command that must succeed and returns the reply after "ok".
func (c clientProc) ok(t *testing.T, format string, args ...any) string {
	t.Helper()
	reply := c.call(t, format, args...)
	rest, ok := strings.CutPrefix(reply, "ok")
	if !ok {
		t.Fatalf("%s: %s: got %q, want ok", c.name, fmt.Sprintf(format, args...), reply)
	}
	return strings.TrimSpace(rest)
}

// wantRows sends a stamp or write that must succeed and touch n rows.
func (c clientProc) wantRows(t *testing.T, n int, format string, args ...any) {
	t.Helper()
	if got := c.ok(t, format, args...); got != strconv.Itoa(n) {
		t.Fatalf("%s: %s: %s rows, want %d", c.name, fmt.Sprintf(format, args...), got, n)
	}
}

// lock takes key with ttl, hands the grant to the session the way how
// says (token, set or startup: see runClient), and returns the token and
// the granted TTL.
func (c clientProc) lock(t *testing.T, key string, ttl time.Duration, how string) (int64, time.Duration) {
	t.Helper()
	f := strings.Fields(c.ok(t, "lock %s %s %s", key, ttl, how))
	if len(f) != 2 {
		t.Fatalf("%s: lock reply %q", c.name, f)
	}
	token, err1 := strconv.ParseInt(f[0], 10, 64)
	granted, err2 := time.ParseDuration(f[1])
	if err1 != nil || err2 != nil || token <= 0 {
		t.Fatalf("%s: bad lock reply %q", c.name, f)
	}
	return token, granted
}

// wantOK returns the text after "ok", failing the test on an error reply.
func wantOK(t *testing.T, reply string) string {
	t.Helper()
	rest, ok := strings.CutPrefix(reply, "ok")
	if !ok {
		t.Fatalf("got %q, want ok", reply)
	}
	return strings.TrimSpace(rest)
}

// wantErr splits an error reply into its code and message, failing the
// test on "ok".
func wantErr(t *testing.T, reply string) (code, msg string) {
	t.Helper()
	rest, ok := strings.CutPrefix(reply, "err ")
	if !ok {
		t.Fatalf("got %q, want an error", reply)
	}
	code, msg, _ = strings.Cut(rest, " ")
	return code, msg
}
