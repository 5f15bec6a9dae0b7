package rules

import (
	"fmt"
	"strings"
	"testing"

	"github.com/fenceproxy/fenceproxy/internal/sqllex"
)

func TestNameGate(t *testing.T) {
	var g nameGate
	long := strings.Repeat("p", sqllex.MaxIdentBytes)
	for _, n := range []string{"acct_v", "Mixed", "with space", `q"uote`, "pay$ments", long, "vé"} {
		g.add(n)
	}
	for _, c := range []struct {
		sql  string
		want bool
	}{
		{"SELECT * FROM acct_v", true},
		{"select * from ACCT_V where id = 1", true},
		{`SELECT * FROM "acct_v"`, true},
		{"SELECT * FROM s.acct_v", true},
		{"SELECT * FROM acct_v2", false},
		{"SELECT * FROM my_acct_v", false},
		{"SELECT * FROM acct", false},
		{"SELECT 'acct_v'", true}, // a word in a string: parsed, harmlessly
		{"CREATE FUNCTION f() RETURNS int AS $$SELECT count(*) FROM acct_v$$ LANGUAGE sql", true},
		{"DO $x$BEGIN DELETE FROM acct_v;END$x$", true},
		{"SELECT * FROM mixed", true},
		{`SELECT * FROM "with space"`, true},
		{`SELECT * FROM "q""uote"`, true},
		{"SELECT * FROM pay$ments", true},
		{"SELECT * FROM pay", false},
		// PostgreSQL truncates identifiers to 63 bytes.
		{"SELECT * FROM " + long + "qqq", true},
		{"SELECT * FROM " + long, true},
		{"SELECT * FROM " + long[:60], false},
		{"SELECT * FROM vé", true},
		{"SELECT * FROM vée", false},
	} {
		if got := g.mayName(c.sql); got != c.want {
			t.Errorf("%q: %v, want %v", c.sql, got, c.want)
		}
	}
	if n := testing.AllocsPerRun(100, func() { g.mayName("SELECT * FROM acct_v WHERE id = 1") }); n != 0 {
		t.Errorf("mayName allocates %v times", n)
	}
}

// BenchmarkNameGate: a statement checked against the partitions of a
// partitioned table (the readers of its parent), as words and, for
// comparison, as substrings.
func BenchmarkNameGate(b *testing.B) {
	const sql = "SELECT abalance FROM pgbench_accounts WHERE aid = $1"
	for _, n := range []int{10, 1000} {
		var g nameGate
		var subs []string
		for i := range n {
			name := fmt.Sprintf("acct_p%d", i)
			g.add(name)
			subs = append(subs, name)
		}
		b.Run(fmt.Sprintf("words/%d", n), func(b *testing.B) {
			for b.Loop() {
				if g.mayName(sql) {
					b.Fatal("match")
				}
			}
		})
		b.Run(fmt.Sprintf("substrings/%d", n), func(b *testing.B) {
			for b.Loop() {
				for _, s := range subs {
					if indexFoldASCII(sql, s) >= 0 {
						b.Fatal("match")
					}
				}
			}
		})
	}
}
