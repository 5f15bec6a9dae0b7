package rules

import (
	"math/rand"
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

func TestMayTouchMatchesReference(t *testing.T) {
	r, err := Compile(Config{Tables: []Table{
		{Table: "public.config"}, {Table: `"My Schema"."T""q"`}, {Table: "s.x"}, {Table: "public.accounts"}, {Table: "ünï.cödé"},
	}})
	if err != nil {
		t.Fatal(err)
	}
	frags := []string{"config", "CONFIG", "Conf", "ig", "x", "X", "s", "alter", "ALTER", "drop", "dRoP", "schema", "my schema", `t"q`, `t""q`, "public",
		"u&", "U&", "&", "'", "\\", "\n", " ", "--c\n", "do", "function", "procedure", "accounts", "acc", "a", "c", "ünï", "cödé", "é", "\xff", ";", "(", ")", "owned", "cascade", "extension", "database", "reassign"}
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
