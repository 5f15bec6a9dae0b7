package policy

import (
	"strconv"
	"testing"
)

// TestGenerationPerDatabase: a database's change moves its sessions'
// generation and no other's; a reload moves every database's; the counts
// never go back, also once no more databases can be counted (then a
// change moves every database's generation).
func TestGenerationPerDatabase(t *testing.T) {
	p := New(nil, false, Options{})
	a0, b0 := p.Generation("a"), p.Generation("b")
	p.catalogMoved("a")
	if p.Generation("a") <= a0 {
		t.Errorf("a's change: generation of a %d, want past %d", p.Generation("a"), a0)
	}
	if p.Generation("b") != b0 {
		t.Errorf("a's change moved b's generation: %d, want %d", p.Generation("b"), b0)
	}
	a1, b1 := p.Generation("a"), p.Generation("b")
	p.Swap(nil, false)
	if p.Generation("a") <= a1 || p.Generation("b") <= b1 {
		t.Errorf("a reload: generations a %d b %d, want past %d and %d", p.Generation("a"), p.Generation("b"), a1, b1)
	}

	// Fill the counts up; the database after the last one counted moves
	// everyone's generation, the counted ones keep theirs.
	for i := range maxCheckedDBs - 1 {
		p.bumpGeneration("db" + strconv.Itoa(i))
	}
	a2, b2, c2 := p.Generation("a"), p.Generation("b"), p.Generation("db7")
	p.bumpGeneration("b")
	if p.Generation("b") <= b2 || p.Generation("a") <= a2 || p.Generation("db7") <= c2 {
		t.Errorf("a change of an uncounted database with no room: a %d b %d db7 %d, want each past %d, %d, %d",
			p.Generation("a"), p.Generation("b"), p.Generation("db7"), a2, b2, c2)
	}
	a3, c3 := p.Generation("a"), p.Generation("db7")
	p.bumpGeneration("a")
	if p.Generation("a") <= a3 || p.Generation("db7") != c3 {
		t.Errorf("a counted database's change: a %d (was %d), db7 %d (was %d)", p.Generation("a"), a3, p.Generation("db7"), c3)
	}
}
