package policy

import (
	"slices"
	"strconv"
	"testing"

	"github.com/fenceproxy/fenceproxy/internal/dbsetup"
	"github.com/fenceproxy/fenceproxy/internal/rules"
)

func TestLockDetail(t *testing.T) {
	for _, c := range []struct{ detail, lock, token, watermark string }{
		{"lock='tenant/7' token=41 watermark=42", "tenant/7", "41", "42"},
		{"lock='it''s' token=1 watermark=2", "it's", "1", "2"},
		{"lock='a'' token=9' token=3 watermark=4", "a' token=9", "3", "4"},
	} {
		l, tok, w, ok := lockDetail(c.detail)
		if !ok || l != c.lock || tok != c.token || w != c.watermark {
			t.Errorf("%q: %q %q %q %v", c.detail, l, tok, w, ok)
		}
	}
	if _, _, _, ok := lockDetail("something else"); ok {
		t.Error("a foreign detail parsed")
	}
}

// Lock names are metric labels only up to maxLockLabels of them.
func TestLockLabelsBounded(t *testing.T) {
	var l lockLabels
	for i := 0; i < maxLockLabels; i++ {
		if got := l.label("lock" + strconv.Itoa(i)); got != "lock"+strconv.Itoa(i) {
			t.Fatalf("label %d = %q", i, got)
		}
	}
	if got := l.label("one more"); got != "other" {
		t.Errorf("label past the bound = %q", got)
	}
	if got := l.label("lock3"); got != "lock3" {
		t.Errorf("a known name = %q", got)
	}
}

// TestRaiserMissing: only the raisers' own names count as missing raisers
// (a client's call of another fenceproxy function must not start a
// recheck or be reported as removed raisers).
func TestRaiserMissing(t *testing.T) {
	for msg, want := range map[string]bool{
		"function fenceproxy.tok_b(unknown, unknown) does not exist":                             true,
		"function fenceproxy.tok(unknown, unknown) does not exist":                               true,
		"function fenceproxy.advance(unknown, bigint, boolean, unknown, unknown) does not exist": true,
		"function fenceproxy.stale(unknown, bigint, unknown) does not exist":                     true,
		"function fenceproxy.no_token_b(unknown, unknown) does not exist":                        true,
		"function fenceproxy.token(unknown) does not exist":                                      false,
		"function fenceproxy.tokens(unknown, unknown) does not exist":                            false,
		"function public.tok(unknown, unknown) does not exist":                                   false,
		"Funktion fenceproxy.tok_b(unknown, unknown) existiert nicht":                            true,
		"fenceproxy.advance(unknown) does not exist":                                             true,
		"function myfenceproxy.tok_b(unknown) and myfenceproxy.stale( do not exist":              false,
		"function myfenceproxy.tok_b(unknown) does not exist":                                    false,
	} {
		if got := raiserMissing(msg); got != want {
			t.Errorf("raiserMissing(%q) = %v, want %v", msg, got, want)
		}
	}
}

// TestCheckedRegistrationMemo: the memo of checkedRegistration answers
// for the same registration and check only; another stamp, another
// procedure or another registration gets its own, right, text.
func TestCheckedRegistrationMemo(t *testing.T) {
	a := &rules.LockCall{Query: "CALL r(1);UPDATE t SET x = 1", Calls: []int{0}, Call: "CALL r(1)"}
	b := &rules.LockCall{Query: "CALL r(2);UPDATE u SET x = 1", Calls: []int{0}, Call: "CALL r(2)"}
	c1 := stampCheck{on: true, stamp: 7, holdAt: true}
	c2 := stampCheck{on: true, stamp: 8, holdAt: true}
	c3 := stampCheck{on: true, stamp: 7, proc: "other.check"}
	for round := range 2 {
		for _, tc := range []struct {
			c    stampCheck
			l    *rules.LockCall
			want string
		}{
			{c1, a, "CALL " + dbsetup.CatalogCheckProc + "(7);CALL r(1);UPDATE t SET x = 1"},
			{c2, a, "CALL " + dbsetup.CatalogCheckProc + "(8);CALL r(1);UPDATE t SET x = 1"},
			{c3, a, "CALL other.check(7);CALL r(1);UPDATE t SET x = 1"},
			{c1, b, "CALL " + dbsetup.CatalogCheckProc + "(7);CALL r(2);UPDATE u SET x = 1"},
		} {
			got := checkedRegistration(tc.c, tc.l)
			if got.Query != tc.want || got.Stamp != tc.c.stamp || got.HoldAt != tc.c.holdAt || !slices.Equal(got.Calls, []int{0, 1}) {
				t.Errorf("round %d: checkedRegistration(%+v) = %q stamp %d holdAt %v calls %v; want %q", round, tc.c, got.Query, got.Stamp, got.HoldAt, got.Calls, tc.want)
			}
			if again := checkedRegistration(tc.c, tc.l); again != got {
				t.Errorf("round %d: a second call for %+v built its result again", round, tc.c)
			}
		}
	}
	// More registrations than slots: each answer is still its own.
	many := make([]*rules.LockCall, 1000)
	for i := range many {
		many[i] = &rules.LockCall{Query: "CALL r(" + strconv.Itoa(i) + ");x", Calls: []int{0}}
	}
	for round := range 2 {
		for i, l := range many {
			if got, want := checkedRegistration(c1, l).Query, "CALL "+dbsetup.CatalogCheckProc+"(7);CALL r("+strconv.Itoa(i)+");x"; got != want {
				t.Fatalf("round %d: registration %d: %q, want %q", round, i, got, want)
			}
		}
	}
	if a.Pre != "" || a.Stamp != 0 || len(a.Calls) != 1 {
		t.Errorf("the rules' LockCall changed: %+v", a)
	}
}
