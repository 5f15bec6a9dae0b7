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
