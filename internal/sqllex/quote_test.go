package sqllex_test

import (
	"testing"

	"github.com/fenceproxy/fenceproxy/internal/sqllex"
)

func TestQuote(t *testing.T) {
	for _, tc := range []struct {
		in, ident, literal, display string
	}{
		{"config", `"config"`, `'config'`, "config"},
		{"_a$1", `"_a$1"`, `'_a$1'`, "_a$1"},
		{"Config", `"Config"`, `'Config'`, `"Config"`},
		{`a"b`, `"a""b"`, `'a"b'`, `"a""b"`},
		{"it's", `"it's"`, `'it''s'`, `"it's"`},
		{`a\b'`, `"a\b'"`, `E'a\\b'''`, `"a\b'"`},
		{"1st", `"1st"`, `'1st'`, `"1st"`},
		{"$x", `"$x"`, `'$x'`, `"$x"`},
		{"", `""`, `''`, `""`},
	} {
		if got := sqllex.QuoteIdent(tc.in); got != tc.ident {
			t.Errorf("QuoteIdent(%q) = %s, want %s", tc.in, got, tc.ident)
		}
		if got := sqllex.QuoteLiteral(tc.in); got != tc.literal {
			t.Errorf("QuoteLiteral(%q) = %s, want %s", tc.in, got, tc.literal)
		}
		if got := sqllex.DisplayIdent(tc.in); got != tc.display {
			t.Errorf("DisplayIdent(%q) = %s, want %s", tc.in, got, tc.display)
		}
	}
}

func TestFold(t *testing.T) {
	if got := sqllex.Fold("ÀbC_Ä"); got != "Àbc_Ä" {
		t.Errorf("Fold: %q", got)
	}
	for _, tc := range []struct {
		s, n         string
		index        int
		prefix, word bool
	}{
		{"UPDATE Config SET", "config", 7, false, true},
		{"ConfigX", "config", 0, true, false},
		{"xconfig", "config", 1, false, false},
		{"CONFI", "config", -1, false, false},
		{"a", "", 0, true, false},
	} {
		if got := sqllex.IndexFold(tc.s, tc.n); got != tc.index {
			t.Errorf("IndexFold(%q, %q) = %d, want %d", tc.s, tc.n, got, tc.index)
		}
		if got := sqllex.ContainsFold(tc.s, tc.n); got != (tc.index >= 0) {
			t.Errorf("ContainsFold(%q, %q) = %t", tc.s, tc.n, got)
		}
		if got := sqllex.HasPrefixFold(tc.s, tc.n); got != tc.prefix {
			t.Errorf("HasPrefixFold(%q, %q) = %t", tc.s, tc.n, got)
		}
		if got := sqllex.ContainsWordFold(tc.s, tc.n); got != tc.word && tc.n != "" {
			t.Errorf("ContainsWordFold(%q, %q) = %t", tc.s, tc.n, got)
		}
	}
}
