package rules

import (
	"strings"
	"testing"
)

// TestParamText: the parameter form takes the token's places, numbered
// after every parameter the statement has; prints where the token is not a
// plain string constant get none.
func TestParamText(t *testing.T) {
	r, err := Compile(Config{Tables: []Table{{Table: "public.config"}}})
	if err != nil {
		t.Fatal(err)
	}
	rs := r.ServerFunctions()
	d := rs.Decide("UPDATE config SET payload = $1 WHERE id = $3")
	if d.Tok == nil {
		t.Fatal("no token form")
	}
	for _, tc := range []struct{ declared, k int }{{0, 4}, {2, 4}, {3, 4}, {5, 6}, {MaxParams - 1, MaxParams}} {
		text, k, ok := d.Tok.ParamText(tc.declared)
		if !ok || k != tc.k {
			t.Errorf("declared %d: k %d %v, want %d", tc.declared, k, ok, tc.k)
			continue
		}
		want, _ := d.Tok.Fill(d.SQL, "1")
		if strings.ReplaceAll(text, "$"+itoa(k)+"::bigint", "'1'::bigint") != want || strings.Count(text, "$"+itoa(k)) != 2 {
			t.Errorf("declared %d: %s\n(the token form: %s)", tc.declared, text, want)
		}
	}
	if _, _, ok := d.Tok.ParamText(MaxParams); ok {
		t.Errorf("a parameter past %d", MaxParams)
	}
	// The print's token places, made unsafe by hand: none.
	for _, pieces := range [][]string{
		{"SELECT x'", "'::bigint"},          // a bit-string constant
		{"SELECT E'", "'::bigint"},          // an escape string
		{"SELECT ", "::bigint"},             // no quotes
		{"SELECT '", "'::bigint; SELECT 1"}, // two statements
	} {
		tf := &TokenForm{real: "SELECT 1", pieces: pieces}
		if text, _, ok := tf.ParamText(0); ok {
			t.Errorf("%q: %s", pieces, text)
		}
	}
	var none *TokenForm
	if _, _, ok := none.ParamText(0); ok {
		t.Error("nil form")
	}
}

func itoa(n int) string {
	var b []byte
	for {
		b = append([]byte{byte('0' + n%10)}, b...)
		n /= 10
		if n == 0 {
			return string(b)
		}
	}
}
