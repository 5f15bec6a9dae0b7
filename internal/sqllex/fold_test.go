package sqllex_test

import (
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/fenceproxy/fenceproxy/internal/sqllex"
)

// wordAt is the definition ContainsWordFold implements: n at i, folded,
// with no identifier byte on either side.
func wordAt(s, n string, i int) bool {
	return sqllex.HasPrefixFold(s[i:], n) && (i == 0 || !sqllex.IsIdentCont(s[i-1])) &&
		(i+len(n) == len(s) || !sqllex.IsIdentCont(s[i+len(n)]))
}

func containsWordSlow(s, n string) bool {
	for i := 0; i+len(n) <= len(s); i++ {
		if wordAt(s, n, i) {
			return true
		}
	}
	return false
}

// TestContainsAnyWordFold compares the one-pass scan with the definition
// over random texts made of the words' pieces and of the bytes that
// border words ($, digits, _, a multibyte letter, quotes, spaces).
func TestContainsAnyWordFold(t *testing.T) {
	words := []string{"alter", "drop", "trigger", "do", "create"}
	pieces := []string{"ALTER", "alter", "Drop", "dro", "p", "TRIGGER", "do", "D", "O", "create", "x", "_", "$", "1", "é", " ", ";", "\"", "'", "(", "\n", "/*", "*/", "-"}
	rng := rand.New(rand.NewPCG(1, 2))
	for range 20000 {
		var b strings.Builder
		for range rng.IntN(8) {
			b.WriteString(pieces[rng.IntN(len(pieces))])
		}
		s := b.String()
		want := false
		for _, w := range words {
			one := containsWordSlow(s, w)
			if got := sqllex.ContainsWordFold(s, w); got != one {
				t.Fatalf("ContainsWordFold(%q, %q) = %t, want %t", s, w, got, one)
			}
			want = want || one
		}
		if got := sqllex.ContainsAnyWordFold(s, words); got != want {
			t.Fatalf("ContainsAnyWordFold(%q) = %t, want %t", s, got, want)
		}
	}
	// Needles that are not words keep the byte-by-byte definition.
	for _, tc := range []struct {
		s, n string
		want bool
	}{
		{"a set x", "set x", true},
		{"a set xy", "set x", false},
		{"(config)", "(config)", true},
	} {
		if got := sqllex.ContainsWordFold(tc.s, tc.n); got != tc.want {
			t.Errorf("ContainsWordFold(%q, %q) = %t, want %t", tc.s, tc.n, got, tc.want)
		}
	}
}

var benchWords = []string{"alter", "create", "drop", "comment", "grant", "reindex", "trigger"}

// BenchmarkContainsAnyWordFold is the migration pre-check's scan of
// pgbench's select-only statement (none of the words is there); the loop
// of one ContainsWordFold per word it replaced is beside it.
func BenchmarkContainsAnyWordFold(b *testing.B) {
	const q = "SELECT abalance FROM pgbench_accounts WHERE aid = 45678;"
	b.Run("one-pass", func(b *testing.B) {
		for b.Loop() {
			if sqllex.ContainsAnyWordFold(q, benchWords) {
				b.Fatal("found")
			}
		}
	})
	b.Run("per-word-definition", func(b *testing.B) {
		for b.Loop() {
			for _, w := range benchWords {
				if containsWordSlow(q, w) {
					b.Fatal("found")
				}
			}
		}
	})
}

func TestMayEndTx(t *testing.T) {
	for _, c := range []struct {
		code string
		want bool
	}{
		{"BEGIN UPDATE t SET n = 1; COMMIT; END", true},
		{"begin delete from t; Rollback; end", true},
		{"plpy.execute('update t set n = 1'); plpy.commit()", true},
		{"spi_exec_query('update t set n = 1'); spi_commit();", true},
		{"BEGIN CALL other(1); END", true},
		{"BEGIN UPDATE t SET committed = true; END", true}, // a name counts
		{"UPDATE t SET n = n + 1 WHERE id = i", false},
		{"BEGIN PERFORM recall(1); END", false}, // "call" inside a word
		{"SELECT callback FROM t", false},
	} {
		if got := sqllex.MayEndTx(c.code); got != c.want {
			t.Errorf("MayEndTx(%q) = %v, want %v", c.code, got, c.want)
		}
	}
}
