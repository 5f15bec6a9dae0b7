package rules_test

import (
	"bytes"
	"strings"
	"testing"

	pg "github.com/pganalyze/pg_query_go/v6"

	"github.com/fenceproxy/fenceproxy/internal/rules"
)

// FuzzSpliceKeepsClientBytes checks what makes a rewrite safe under every
// client encoding and string setting: the server must receive the client's
// own bytes, in order, plus fence text that no lexing setting can read two
// ways. For arbitrary bytes v in a protected-table write
//
//	UPDATE config SET payload = v WHERE id = 1
//	INSERT INTO config (id, payload) VALUES (1, v)
//
// every rewrite, under every rule set of testdata/rewrite/rules.yaml in
// each of its forms (inline, raisers, and both prepared), must
//
//  1. hold the client's bytes as a subsequence, in order (the only bytes a
//     rewrite may drop are an assignment of DEFAULT to the fence column,
//     which it replaces);
//  2. add only ASCII, no backslash, and quotes in pairs: the output has the
//     same bytes >= 0x80 and backslashes as the input, in the same order;
//  3. parse into as many statements as the input.
//
// The seed corpus (testdata/fuzz/FuzzSpliceKeepsClientBytes) holds the
// literals that deparsing once turned into other bytes. Run longer with
//
//	go test ./internal/rules -run '^$' -fuzz FuzzSpliceKeepsClientBytes -fuzztime 60s
func FuzzSpliceKeepsClientBytes(f *testing.F) {
	type set struct {
		name   string
		column string
		r      *rules.Rules
	}
	var sets []set
	for name, cfg := range loadRuleSets(f) {
		cfg.CacheSize = -1 // every input takes the full path
		r, err := rules.Compile(cfg)
		if err != nil {
			f.Fatal(err)
		}
		column := "last_fence"
		for _, tb := range cfg.Tables {
			if tb.Table == "public.config" && tb.Column != "" {
				column = tb.Column
			}
		}
		sets = append(sets, set{name, column, r}, set{name + " (raisers)", column, r.ServerFunctions()},
			set{name + " (prepared)", column, r.Prepared()}, set{name + " (raisers, prepared)", column, r.ServerFunctions().Prepared()})
	}
	shapes := [][2]string{
		{"UPDATE config SET payload = ", " WHERE id = 1"},
		{"INSERT INTO config (id, payload) VALUES (1, ", ")"},
	}
	f.Fuzz(func(t *testing.T, v []byte) {
		for _, shape := range shapes {
			sql := shape[0] + string(v) + shape[1]
			for _, s := range sets {
				d := s.r.Decide(sql)
				if d.Action != rules.Rewrite {
					continue
				}
				if err := checkSplice(sql, d.SQL, s.column); err != "" {
					t.Fatalf("rules %s: input %q\n%s\nrewritten: %q", s.name, sql, err, d.SQL)
				}
			}
		}
	})
}

// checkSplice returns what is wrong with out as a splice of in, or "".
func checkSplice(in, out, column string) string {
	if !isSubsequence(in, out) && !assignsDefault(in, column) {
		return "the client's bytes are not all in the rewrite, in order"
	}
	if a, b := special(in), special(out); a != b {
		return "the rewrite adds or reorders non-ASCII bytes or backslashes: " +
			"client's " + quoteBytes(a) + ", rewrite's " + quoteBytes(b)
	}
	for _, q := range []byte{'\'', '"'} {
		if (strings.Count(out, string(q))-strings.Count(in, string(q)))%2 != 0 {
			return "the rewrite adds an odd number of " + string(q)
		}
	}
	a, err := pg.Parse(in)
	if err != nil {
		return "the client's statement was rewritten though it does not parse: " + err.Error()
	}
	b, err := pg.Parse(out)
	if err != nil {
		return "the rewrite does not parse: " + err.Error()
	}
	if len(a.Stmts) != len(b.Stmts) {
		return "the rewrite has another number of statements"
	}
	return ""
}

// isSubsequence reports whether sub's bytes appear in s in order.
func isSubsequence(sub, s string) bool {
	i := 0
	for j := 0; i < len(sub) && j < len(s); j++ {
		if sub[i] == s[j] {
			i++
		}
	}
	return i == len(sub)
}

// special returns the bytes of s that lexing settings can read
// differently: backslashes and bytes >= 0x80.
func special(s string) string {
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if c := s[i]; c == '\\' || c >= 0x80 {
			b.WriteByte(c)
		}
	}
	return b.String()
}

func quoteBytes(s string) string {
	var b bytes.Buffer
	for i := 0; i < len(s); i++ {
		if i > 0 {
			b.WriteByte(' ')
		}
		const hex = "0123456789abcdef"
		b.WriteByte(hex[s[i]>>4])
		b.WriteByte(hex[s[i]&15])
	}
	return "[" + b.String() + "]"
}

// assignsDefault reports whether sql sets column to DEFAULT somewhere (in a
// SET list or a VALUES row): the rewrite replaces that DEFAULT with the
// fence value.
func assignsDefault(sql, column string) bool {
	tree, err := pg.ParseToJSON(sql)
	if err != nil {
		return false
	}
	return strings.Contains(tree, "SetToDefault") && strings.Contains(strings.ToLower(sql), column)
}
