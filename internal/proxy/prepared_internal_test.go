package proxy

import (
	"testing"

	"github.com/fenceproxy/fenceproxy/internal/rules"
)

// TestRepeatDef checks when a Parse may record the definition its name
// already has instead of a new one: only when every field of the new one
// would be equal.
func TestRepeatDef(t *testing.T) {
	const sql = "UPDATE t SET v = $1"
	lock := func() *rules.LockCall {
		return &rules.LockCall{Call: "CALL r()", Query: "CALL r();" + sql, Calls: []int{0}}
	}
	rewrite := &rules.Decision{Action: Rewrite, SQL: "rewritten", Lock: lock()}
	ps := newPreparedState(nil, "n")
	def := ps.newDef(sql, decisionHash(rewrite, sql), 7, []uint32{23}, false)
	def.lock = rewrite.Lock
	ps.addStmtOp("", def, true, 0, false, 0)

	same := &rules.Decision{Action: Rewrite, SQL: "rewritten", Lock: lock()}
	if got := ps.repeatDef("", sql, same, 7, []uint32{23}, nil); got != def {
		t.Fatalf("the same Parse again: got %p, want the recorded definition %p", got, def)
	}
	otherLock := lock()
	otherLock.Required = true
	otherCalls := lock()
	otherCalls.Calls = []int{1}
	for name, c := range map[string]struct {
		name, sql string
		d         *rules.Decision
		gen       uint64
		oids      []uint32
		ops       []PreparedOp
	}{
		"other name":     {"s1", sql, same, 7, []uint32{23}, nil},
		"other text":     {"", sql + " ", same, 7, []uint32{23}, nil},
		"other rewrite":  {"", sql, &rules.Decision{Action: Rewrite, SQL: "other", Lock: lock()}, 7, []uint32{23}, nil},
		"forwarded":      {"", sql, &rules.Decision{Action: Forward, Lock: lock()}, 7, []uint32{23}, nil},
		"other rules":    {"", sql, same, 8, []uint32{23}, nil},
		"other types":    {"", sql, same, 7, []uint32{25}, nil},
		"no types":       {"", sql, same, 7, nil, nil},
		"ops":            {"", sql, same, 7, []uint32{23}, []PreparedOp{{Kind: OpExecute, Name: "x"}}},
		"no lock":        {"", sql, &rules.Decision{Action: Rewrite, SQL: "rewritten"}, 7, []uint32{23}, nil},
		"required lock":  {"", sql, &rules.Decision{Action: Rewrite, SQL: "rewritten", Lock: otherLock}, 7, []uint32{23}, nil},
		"other lock use": {"", sql, &rules.Decision{Action: Rewrite, SQL: "rewritten", Lock: otherCalls}, 7, []uint32{23}, nil},
	} {
		if got := ps.repeatDef(c.name, c.sql, c.d, c.gen, c.oids, c.ops); got != nil {
			t.Errorf("%s: reused the recorded definition", name)
		}
	}

	// A plain definition (forwarded as sent, no lock) is reused for a
	// plain decision without hashing, and not for a rewrite of its text.
	forward := &rules.Decision{Action: Forward}
	plain := ps.newDef(sql, decisionHash(forward, sql), 7, nil, false)
	plain.plain = true
	ps.addStmtOp("", plain, true, 0, false, 0)
	if got := ps.repeatDef("", sql, &rules.Decision{Action: Forward}, 7, nil, nil); got != plain {
		t.Fatal("a plain Parse again: not reused")
	}
	if got := ps.repeatDef("", sql, &rules.Decision{Action: Rewrite, SQL: "fenced " + sql}, 7, nil, nil); got != nil {
		t.Fatal("a plain definition reused for a rewrite")
	}

	// A rewrite without a lock is not reused for the text forwarded as
	// sent.
	ps3 := newPreparedState(nil, "o")
	fenced := &rules.Decision{Action: Rewrite, SQL: "fenced " + sql}
	ps3.addStmtOp("", ps3.newDef(sql, decisionHash(fenced, sql), 7, nil, false), true, 0, false, 0)
	if got := ps3.repeatDef("", sql, &rules.Decision{Action: Forward}, 7, nil, nil); got != nil {
		t.Fatal("a rewrite's definition reused for the text forwarded as sent")
	}

	// A definition whose text was not kept (memory budget) is never
	// reused: nothing could be compared.
	ps2 := newPreparedState(nil, "m")
	bare := &stmtDef{sent: decisionHash(forward, sql), gen: 7, plain: true} // as newDef leaves it past the budget
	ps2.addStmtOp("", bare, true, 0, false, 0)
	if got := ps2.repeatDef("", sql, forward, 7, nil, nil); got != nil {
		t.Fatal("reused a definition without its text")
	}
}

// TestResponseQueue checks the response queue's order through its array
// reuse (push starts over at the array's beginning once empty, and moves
// to a new array when it grows), and the resolution of a name's pending
// changes, few (shifted down) or many (sliced off), in order.
func TestResponseQueue(t *testing.T) {
	ps := newPreparedState(nil, "n")
	next, want := 0, 0
	var got []int
	record := func(i int) func(outcome) { return func(outcome) { got = append(got, i) } }
	for round, n := range []int{1, 3, 1, 40, 2, 2000, 5} {
		for range n {
			ps.expect(0, record(next))
			next++
		}
		// Pop all but one, then push more behind it, then drain.
		for len(ps.fifo) > 1 {
			ps.pop(outcomeOK)
		}
		ps.expect(0, record(next))
		next++
		for len(ps.fifo) > 0 {
			ps.pop(outcomeOK)
		}
		for ; want < next; want++ {
			if want >= len(got) || got[want] != want {
				t.Fatalf("round %d: responses resolved out of order: %v", round, got[max(0, want-3):min(len(got), want+3)])
			}
		}
	}

	for _, n := range []int{3, 8, 9, 50} {
		ps := newPreparedState(nil, "n")
		var defs []*stmtDef
		for i := range n {
			d := &stmtDef{gen: uint64(i)}
			defs = append(defs, d)
			ps.addStmtOp("", d, true, 0, false, 0)
		}
		for i := range n {
			ps.pop(outcomeOK)
			e := ps.stmts[""]
			if e == nil {
				t.Fatalf("%d pending, after %d answers: the entry is gone", n, i+1)
			}
			if e.confirmed != defs[i] || len(e.pending) != n-1-i {
				t.Fatalf("%d pending, after %d answers: confirmed gen %v, %d still pending", n, i+1, e.confirmed.gen, len(e.pending))
			}
			if i+1 < n && e.pending[0].def != defs[i+1] {
				t.Fatalf("%d pending, after %d answers: next is gen %d", n, i+1, e.pending[0].def.gen)
			}
		}
		if ps.lost {
			t.Fatalf("%d pending: bookkeeping lost", n)
		}
	}
}

// TestResponseSkippedAfterError: what the proxy sent into a segment after
// the server's error for it arrived is skipped by the server: at the
// segment's ReadyForQuery its entries resolve as skipped, and that is no
// mismatch. An injected message left unanswered in a segment that did not
// fail still is one.
func TestResponseSkippedAfterError(t *testing.T) {
	ps := newPreparedState(nil, "n")
	var outcomes []outcome
	record := func(o outcome) { outcomes = append(outcomes, o) }
	// The client's Bind and Execute, answered by an error.
	ps.countSent('B')
	ps.countSent('E')
	if _, mismatch := ps.response('E', 0); mismatch {
		t.Fatal("error: mismatch")
	}
	// The proxy's own Parse, Bind, Execute, sent after the error arrived,
	// then the Sync.
	for _, m := range []struct{ typ, answer byte }{{'P', '1'}, {'B', '2'}, {'E', 'C'}} {
		ps.expect(m.answer, record)
		ps.countSent(m.typ)
	}
	ps.countSent('S')
	if _, mismatch := ps.response('Z', 'E'); mismatch {
		t.Error("ReadyForQuery of the failed segment: mismatch")
	}
	if len(outcomes) != 3 || outcomes[0] != outcomeSkipped || len(ps.fifo) != 0 {
		t.Errorf("outcomes %v, %d left", outcomes, len(ps.fifo))
	}
	// A segment without an error: the same unanswered entries are one.
	ps.expect('1', record)
	ps.countSent('P')
	ps.countSent('S')
	if _, mismatch := ps.response('Z', 'I'); !mismatch {
		t.Error("an injected Parse unanswered in a segment that did not fail: no mismatch")
	}
}
