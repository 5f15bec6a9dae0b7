package sqllex_test

import (
	"strings"
	"testing"

	"github.com/fenceproxy/fenceproxy/internal/sqllex"
)

func TestSkips(t *testing.T) {
	for _, c := range []struct {
		name string
		got  int
		want int
	}{
		{"quoted", sqllex.SkipQuoted(`'a''b' x`, 1, '\'', false), 6},
		{"escaped quote", sqllex.SkipQuoted(`'a\'b' x`, 1, '\'', true), 6},
		{"backslash literal", sqllex.SkipQuoted(`'a\' x`, 1, '\'', false), 4},
		{"unterminated", sqllex.SkipQuoted(`'abc`, 1, '\'', false), 4},
		{"nested comment", sqllex.SkipBlockComment("/* a /* b */ c */ x", 0), 17},
		{"unterminated comment", sqllex.SkipBlockComment("/* a", 0), 4},
		{"line comment", sqllex.SkipLineComment("-- a\nx", 0), 4},
		{"dollar quote", sqllex.SkipDollar("$t$ a $ b $t$ x", 0), 13},
		{"empty tag", sqllex.SkipDollar("$$a$$x", 0), 5},
		{"parameter", sqllex.SkipDollar("$12 x", 0), 3},
		{"lone dollar", sqllex.SkipDollar("$ x", 0), 1},
	} {
		if c.got != c.want {
			t.Errorf("%s: %d, want %d", c.name, c.got, c.want)
		}
	}
	if !sqllex.IsIdentStart(0x80) || sqllex.IsIdentStart('1') || !sqllex.IsIdentCont('$') || !sqllex.IsSpace('\v') {
		t.Error("character classes")
	}
}

func TestWords(t *testing.T) {
	long := strings.Repeat("x", sqllex.MaxIdentBytes+2)
	var got []string
	sqllex.Words(`SELECT * FROM "the view", s.acct_v$x $$BEGIN t1;END$$ vé `+long, func(w string) bool {
		got = append(got, w)
		return false
	})
	want := []string{"SELECT", "FROM", "the", "view", "s", "acct_v", "x", "BEGIN", "t1", "END", "vé",
		long[:63], long[:62], long[:61], long[:60]}
	if strings.Join(got, "|") != strings.Join(want, "|") {
		t.Errorf("words %q, want %q", got, want)
	}
	if !sqllex.Words("a b c", func(w string) bool { return w == "b" }) || sqllex.Words("a b c", func(string) bool { return false }) {
		t.Error("Words does not report the stop")
	}
	for s, want := range map[string]bool{"acct_v": true, "vé": true, "": false, "a b": false, "pay$ments": false, `q"`: false} {
		if sqllex.IsWord(s) != want {
			t.Errorf("IsWord(%q) = %v", s, !want)
		}
	}
}

// TestMayName: a setting's first name part found as a word in any case,
// in strings and comments; a longer word holding it is not it; an escape
// of either kind may spell it.
func TestMayName(t *testing.T) {
	words := sqllex.SettingParts("fence.token", "FENCE.lock", "app")
	if len(words) != 2 || words[0] != "fence" || words[1] != "app" {
		t.Fatalf("SettingParts = %q, want [fence app]", words)
	}
	for _, c := range []struct {
		text string
		want bool
	}{
		{"UPDATE t SET last_fence = 1", false},
		{"SELECT current_setting('Fence.Token')", true},
		{`SELECT "FENCE"`, true},
		{"/* fence */ UPDATE t SET x = 1", true},
		{"UPDATE fencing SET x = 1; SELECT fenceproxy.stale_at(1)", false},
		{"SELECT $$app$$", true},
		{`SELECT current_setting(U&'\0066ence.token')`, true},
		{`SELECT current_setting(u&"x")`, true},
		{"SELECT a&'b'", false},
		{`SELECT E'\x66ence.token'`, true},
		{"", false},
	} {
		if got := sqllex.MayName(c.text, words); got != c.want {
			t.Errorf("MayName(%q) = %v, want %v", c.text, got, c.want)
		}
	}
}

// mayNameSlow is MayName without its first-byte filter: every word
// compared with every name.
func mayNameSlow(text string, words []string) bool {
	if strings.IndexByte(text, '\\') >= 0 || sqllex.HasUnicodeEscape(text) {
		return true
	}
	return sqllex.Words(text, func(w string) bool {
		for _, x := range words {
			if strings.EqualFold(w, x) {
				return true
			}
		}
		return false
	})
}

// TestMayNameFilter: MayName's first-byte filter passes over no word
// the names match, whatever their cases and the characters that fold to
// ASCII letters (the Kelvin sign, the long s), in the words or in the
// names; checked against the plain comparison of every word.
func TestMayNameFilter(t *testing.T) {
	names := [][]string{
		{"fence", "current_setting", "pg_settings", "pg_show_all_settings", "show"},
		{"kafka", "sidecar"},
		{"ſidecar"}, // a name that begins with a multi-byte character
		{"_x", "9lives"},
		{},
	}
	spell := []string{
		"fence", "FENCE", "Fence", "\u212Aafka", "KAFKA", "\u017Fidecar", "sidecar", "SIDECAR", "ſidecar",
		"show", "SHOW", "ſhow", "_x", "_X", "9lives", "9LIVES", "current_setting", "Current_Setting",
		"fences", "afence", "kafkas", "x", "pg_catalog", "config", "\u212Aelvin", "é", "ẞ",
	}
	for _, ns := range names {
		for _, w := range spell {
			for _, text := range []string{w, "UPDATE t SET a = 1 WHERE " + w + " = 2", "SELECT '" + w + "'", "/*" + w + "*/ SELECT 1"} {
				if got, want := sqllex.MayName(text, ns), mayNameSlow(text, ns); got != want {
					t.Errorf("MayName(%q, %q) = %v, the plain comparison %v", text, ns, got, want)
				}
			}
		}
	}
	// The filter's point: these must still be found.
	for _, c := range []struct {
		text  string
		names []string
	}{
		{"SELECT \u212Aafka", []string{"kafka"}},
		{"SELECT sidecar", []string{"ſidecar"}},
		{"SELECT SHOW", []string{"show"}},
	} {
		if !sqllex.MayName(c.text, c.names) {
			t.Errorf("MayName(%q, %q) = false, want true", c.text, c.names)
		}
	}
}

// BenchmarkMayName is the prelude's check of a row-fenced Query's sent
// text (the catalog check, the token form) for the settings' names and
// their readers; the plain comparison of every word is beside it.
func BenchmarkMayName(b *testing.B) {
	const sent = `CALL fenceproxy.catalog_at(0);UPDATE config SET counter = counter + 1, "last_fence" = (CASE WHEN config.last_fence OPERATOR(pg_catalog.<=) '42'::bigint THEN '42'::bigint ELSE fenceproxy.stale_at(config.last_fence) END) WHERE (id = 1)`
	words := []string{"fence", "current_setting", "pg_settings", "pg_show_all_settings", "show"}
	b.Run("filtered", func(b *testing.B) {
		for b.Loop() {
			if sqllex.MayName(sent, words) {
				b.Fatal("found")
			}
		}
	})
	b.Run("plain", func(b *testing.B) {
		for b.Loop() {
			if mayNameSlow(sent, words) {
				b.Fatal("found")
			}
		}
	})
}
