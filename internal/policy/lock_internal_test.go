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
