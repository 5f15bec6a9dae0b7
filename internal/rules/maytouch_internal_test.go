package rules

import (
	"math/rand"

	"github.com/fenceproxy/fenceproxy/internal/sqllex"
	"strings"
	"testing"
)

// mayTouchRef is MayTouch written the plain way (a loop over every byte,
// every needle compared at every position): the fast version must agree.
func (r *Rules) mayTouchRef(sql string) bool {
	if len(r.tables) == 0 {
		return false
	}
	alter := false
	for i := 0; i < len(sql); i++ {
		if sql[i] == '&' && i > 0 && lowerASCII(sql[i-1]) == 'u' {
			return true
		}
		if hasPrefixFoldASCII(sql[i:], "alter") || hasPrefixFoldASCII(sql[i:], "drop") {
			alter = true
		}
		for _, n := range r.needles {
			if hasPrefixFoldASCII(sql[i:], n) {
				return true
			}
		}
	}
	if alter {
		for _, s := range r.schemas {
			if containsFoldASCII(sql, s) {
				return true
			}
		}
	}
	hides := false
	for i := 0; i < len(sql) && !hides; i++ {
		switch sql[i] {
		case '\\':
			hides = true
		case '\'':
			hides = continuesString(sql[i+1:])
		}
	}
	if hides && (containsWordFoldASCII(sql, "do") || containsWordFoldASCII(sql, "function") || containsWordFoldASCII(sql, "procedure")) {
		return true
	}
	return mayReachUnnamed(sql)
}

// mayReachUnnamed is, written the plain way, MayTouch's check for the
// statements reachesUnnamed refuses, which need not name a protected
// table (MayTouch makes it in its own pass, with reachWord at each word's
// start): it reports whether sql
// has the word "owned" (DROP OWNED, REASSIGN OWNED), or "alter" or "drop"
// with "cascade", "extension" or "database". Words are compared ignoring
// ASCII case wherever they appear (in strings and comments too: a false
// positive only costs a parse); a keyword is always such a word, as the
// lexer ends an identifier or keyword only at a byte that cannot continue
// one. It does not allocate.
func mayReachUnnamed(sql string) bool {
	alterDrop, object := false, false
	for i := 0; i < len(sql); {
		if !sqllex.IsIdentCont(sql[i]) {
			i++
			continue
		}
		j := i + 1
		for j < len(sql) && sqllex.IsIdentCont(sql[j]) {
			j++
		}
		switch w := sql[i:j]; {
		case len(w) < 4 || len(w) > 9:
		case hasPrefixFoldASCII(w, "owned") && len(w) == 5:
			return true
		case len(w) == 5 && hasPrefixFoldASCII(w, "alter"), len(w) == 4 && hasPrefixFoldASCII(w, "drop"):
			alterDrop = true
		case len(w) == 7 && hasPrefixFoldASCII(w, "cascade"), len(w) == 9 && hasPrefixFoldASCII(w, "extension"),
			len(w) == 8 && hasPrefixFoldASCII(w, "database"):
			object = true
		}
		if alterDrop && object {
			return true
		}
		i = j
	}
	return false
}

func TestMayTouchMatchesReference(t *testing.T) {
	r, err := Compile(Config{Tables: []Table{
		{Table: "public.config"}, {Table: `"My Schema"."T""q"`}, {Table: "s.x"}, {Table: "public.accounts"}, {Table: "ünï.cödé"},
	}})
	if err != nil {
		t.Fatal(err)
	}
	frags := []string{"config", "CONFIG", "Conf", "ig", "x", "X", "s", "alter", "ALTER", "drop", "dRoP", "schema", "my schema", `t"q`, `t""q`, "public",
		"u&", "U&", "&", "'", "\\", "\n", " ", "--c\n", "do", "function", "procedure", "accounts", "acc", "a", "c", "ünï", "cödé", "é", "\xff", ";", "(", ")", "owned", "cascade", "extension", "database", "reassign", "_", "9", "$", "OWNED", "Cascade"}
	rng := rand.New(rand.NewSource(1))
	for i := 0; i < 200000; i++ {
		var b strings.Builder
		for k := rng.Intn(8); k >= 0; k-- {
			b.WriteString(frags[rng.Intn(len(frags))])
		}
		s := b.String()
		if got, want := r.MayTouch(s), r.mayTouchRef(s); got != want {
			t.Fatalf("MayTouch(%q) = %v, reference %v", s, got, want)
		}
	}
}
