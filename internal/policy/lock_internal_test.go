package policy

import (
	"strconv"
	"testing"
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
