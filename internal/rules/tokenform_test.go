package rules_test

import (
	"regexp"
	"strings"
	"testing"

	"github.com/fenceproxy/fenceproxy/internal/rules"
)

// TestCanonicalToken: the tokens the token form accepts are exactly those
// the rewrites' pattern validates, written without leading zeros.
func TestCanonicalToken(t *testing.T) {
	pattern := regexp.MustCompile(rules.TokenPattern())
	for _, c := range []struct{ in, want string }{
		{"1", "1"}, {"42", "42"}, {"0042", "42"}, {"0", ""}, {"000", ""}, {"", ""},
		{"-1", ""}, {"+1", ""}, {" 1", ""}, {"1 ", ""}, {"1e3", ""}, {"0x10", ""}, {"1_000", ""},
		{rules.MaxToken, rules.MaxToken}, {"9223372036854775808", ""}, {"99999999999999999999", ""},
		{strings.Repeat("0", 40) + "7", "7"}, {"٣", ""},
	} {
		got, ok := rules.CanonicalToken(c.in)
		if got != c.want || ok != (c.want != "") {
			t.Errorf("CanonicalToken(%q) = %q, %v; want %q", c.in, got, ok, c.want)
		}
		if ok != pattern.MatchString(c.in) {
			t.Errorf("CanonicalToken(%q) says %v, the rewrites' pattern %v", c.in, ok, !ok)
		}
	}
}

// TestTokenFormFill: the token form fills only canonical tokens, and only
// into a text that ends with the decided text.
func TestTokenFormFill(t *testing.T) {
	rs, err := rules.Compile(rules.Config{Tables: []rules.Table{{Table: "public.config"}}})
	if err != nil {
		t.Fatal(err)
	}
	d := rs.ServerFunctions().Decide("UPDATE config SET n = n + 1 WHERE id = 7")
	if d.Action != rules.Rewrite || d.Tok == nil {
		t.Fatalf("no token form: %v %v", d.Action, d.Err)
	}
	got, ok := d.Tok.Fill("SET LOCAL x = '1';"+d.SQL, "42")
	if !ok || !strings.HasPrefix(got, "SET LOCAL x = '1';UPDATE config SET n = n + 1, ") || !strings.Contains(got, "'42'::bigint") ||
		strings.Contains(got, "current_setting") || strings.ContainsRune(got, 0) {
		t.Fatalf("Fill = %q, %v", got, ok)
	}
	// FilledLen is exact, and FillTo writes what Fill returns.
	for _, tok := range []string{"42", "1", "9223372036854775807"} {
		want, _ := d.Tok.Fill("CALL x();"+d.SQL, tok)
		n, ok := d.Tok.FilledLen("CALL x();"+d.SQL, tok)
		var b strings.Builder
		b.WriteString("pre")
		d.Tok.FillTo(&b, "CALL x();"+d.SQL, tok)
		if !ok || n != len(want) || b.String() != "pre"+want {
			t.Errorf("token %s: FilledLen = %d, %v; FillTo wrote %q; Fill %q", tok, n, ok, b.String(), want)
		}
	}
	for _, bad := range []string{"042", "0", "", "4'2", "42'; DROP TABLE config; --", "9223372036854775808"} {
		if s, ok := d.Tok.Fill(d.SQL, bad); ok {
			t.Errorf("Fill(%q) = %q; want refused", bad, s)
		}
		if _, ok := d.Tok.FilledLen(d.SQL, bad); ok {
			t.Errorf("FilledLen(%q) accepted", bad)
		}
	}
	if s, ok := d.Tok.Fill(d.SQL+" ", "42"); ok {
		t.Errorf("Fill of a text that does not end with the decided one = %q", s)
	}
}
