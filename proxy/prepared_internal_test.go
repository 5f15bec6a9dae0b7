package proxy

import "testing"

// TestRepeatDef checks when a Parse may record the definition its name
// already has instead of a new one: only when every field of the new one
// would be equal.
func TestRepeatDef(t *testing.T) {
	ps := newPreparedState(nil, "n")
	const sql = "UPDATE t SET v = $1"
	lock := &LockRegistration{Call: "CALL r()", Query: "CALL r();" + sql, Calls: []int{0}}
	sent := hashText("rewritten")
	def := ps.newDef(sql, sent, 7, []uint32{23}, false)
	def.lock = lock
	ps.addStmtOp("", def, true, 0, false, 0)

	if got := ps.repeatDef("", sql, sent, 7, []uint32{23}, nil, &LockRegistration{Call: "CALL r()", Query: "CALL r();" + sql, Calls: []int{0}}); got != def {
		t.Fatalf("the same Parse again: got %p, want the recorded definition %p", got, def)
	}
	for name, args := range map[string]struct {
		name, sql string
		sent      [32]byte
		gen       uint64
		oids      []uint32
		ops       []PreparedOp
		lock      *LockRegistration
	}{
		"other name":  {"s1", sql, sent, 7, []uint32{23}, nil, lock},
		"other text":  {"", sql + " ", sent, 7, []uint32{23}, nil, lock},
		"other sent":  {"", sql, hashText("other"), 7, []uint32{23}, nil, lock},
		"other rules": {"", sql, sent, 8, []uint32{23}, nil, lock},
		"other types": {"", sql, sent, 7, []uint32{25}, nil, lock},
		"no types":    {"", sql, sent, 7, nil, nil, lock},
		"ops":         {"", sql, sent, 7, []uint32{23}, []PreparedOp{{Kind: OpExecute, Name: "x"}}, lock},
		"no lock":     {"", sql, sent, 7, []uint32{23}, nil, nil},
		"other lock":  {"", sql, sent, 7, []uint32{23}, nil, &LockRegistration{Call: "CALL r()", Query: "CALL r();" + sql, Calls: []int{0}, Required: true}},
		"other calls": {"", sql, sent, 7, []uint32{23}, nil, &LockRegistration{Call: "CALL r()", Query: "CALL r();" + sql, Calls: []int{1}}},
	} {
		if got := ps.repeatDef(args.name, args.sql, args.sent, args.gen, args.oids, args.ops, args.lock); got != nil {
			t.Errorf("%s: reused the recorded definition", name)
		}
	}

	// A definition whose text was not kept (memory budget) is never
	// reused: nothing could be compared.
	ps2 := newPreparedState(nil, "m")
	bare := &stmtDef{sent: sent, gen: 7} // as newDef leaves it past the budget
	ps2.addStmtOp("", bare, true, 0, false, 0)
	if got := ps2.repeatDef("", sql, sent, 7, nil, nil, nil); got != nil {
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
