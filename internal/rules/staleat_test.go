package rules_test

import (
	"strings"
	"testing"

	"github.com/fenceproxy/fenceproxy/internal/rules"
)

// TestStaleAtTokenForm: a StaleAt set's token form raises a stale row's
// error with fenceproxy.stale_at and says which table it is for; the
// ServerFunctions set's form, decided from the same cache, keeps the call
// that names the table; a text whose stale rows may be of two tables has
// no token form in the StaleAt set; the real forms are the same.
func TestStaleAtTokenForm(t *testing.T) {
	rs, err := rules.Compile(rules.Config{Tables: []rules.Table{{Table: "public.config"}, {Table: "public.other"}}})
	if err != nil {
		t.Fatal(err)
	}
	plain, at := rs.ServerFunctions(), rs.ServerFunctions().StaleAt()
	if at.StaleAt() != at || at.ServerFunctions() != at {
		t.Errorf("StaleAt and ServerFunctions of a StaleAt set are not the set itself")
	}
	one := []string{
		"UPDATE config SET counter = counter + 1 WHERE id = 7",
		"DELETE FROM config WHERE id = 7",
		"INSERT INTO config (id) VALUES (7) ON CONFLICT (id) DO UPDATE SET counter = 1",
		"UPDATE config c SET counter = 2 FROM other o WHERE o.id = c.id",
		"WITH u AS (UPDATE config SET counter = 3 WHERE id = 1 RETURNING id) SELECT * FROM u",
	}
	// Decided in both orders, so that neither set's cached prints serve
	// the other.
	for round := range 2 {
		for _, sql := range one {
			sets := []*rules.Rules{plain, at}
			if round == 1 {
				sets = []*rules.Rules{at, plain}
			}
			var forms [2]string
			var reals [2]string
			for i, s := range sets {
				d := s.Decide(sql)
				if d.Action != rules.Rewrite || d.Tok == nil {
					t.Fatalf("%s: %v, token form %v", sql, d.Action, d.Tok != nil)
				}
				f, ok := d.Tok.Fill(d.SQL, "42")
				if !ok {
					t.Fatalf("%s: the token form does not fill", sql)
				}
				forms[i], reals[i] = f, d.SQL
				if s == at {
					if got := d.Tok.StaleTable(); got != "public.config" {
						t.Errorf("%s: StaleTable() = %q, want public.config", sql, got)
					}
					if !strings.Contains(f, "fenceproxy.stale_at") || strings.Contains(f, "fenceproxy.stale(") || strings.Contains(f, "fenceproxy.stale_b(") {
						t.Errorf("%s: the StaleAt token form:\n%s", sql, f)
					}
				} else {
					if got := d.Tok.StaleTable(); got != "" {
						t.Errorf("%s: StaleTable() = %q in the ServerFunctions set", sql, got)
					}
					if strings.Contains(f, "stale_at") || !strings.Contains(f, "fenceproxy.stale") {
						t.Errorf("%s: the ServerFunctions token form:\n%s", sql, f)
					}
				}
			}
			if reals[0] != reals[1] {
				t.Errorf("%s: the real forms differ:\n%s\n%s", sql, reals[0], reals[1])
			}
		}
	}
	for _, sql := range []string{
		"UPDATE config SET counter = 1 WHERE id = 1; UPDATE other SET counter = 1 WHERE id = 1",
		"WITH u AS (UPDATE config SET counter = 3 WHERE id = 1 RETURNING id) UPDATE other SET counter = 1 WHERE id IN (SELECT id FROM u)",
	} {
		if d := plain.Decide(sql); d.Action != rules.Rewrite || d.Tok == nil {
			t.Errorf("%s: ServerFunctions set: %v, token form %v", sql, d.Action, d.Tok != nil)
		}
		if d := at.Decide(sql); d.Action != rules.Rewrite || d.Tok != nil {
			t.Errorf("%s: StaleAt set: %v, token form %v, want a rewrite without one", sql, d.Action, d.Tok != nil)
		}
	}
	// Prepared forms have no token form in either.
	if d := at.Prepared().Decide(one[0]); d.Tok != nil {
		t.Errorf("the prepared StaleAt set has a token form")
	}
}

// TestExpandStaleAt: the relay's expansion of stale_at's marker reads as
// the full marker does, and what it cannot expand still reads as a stale
// token.
func TestExpandStaleAt(t *testing.T) {
	for _, tc := range []struct {
		msg, token, table string
		ok                bool
		want              string
	}{
		{"fenceproxy:stale_at:57", "42", "public.config", true, "fenceproxy: stale fencing token 42 for table public.config (stored watermark 57)"},
		{"fenceproxy:stale_at:", "42", "public.config", true, "fenceproxy: stale fencing token 42 for table public.config (stored watermark NULL)"},
		{"fenceproxy:stale_at:-3", "9", `public."a:b"`, true, `fenceproxy: stale fencing token 9 for table public."a:b" (stored watermark -3)`},
		{"fenceproxy:stale_at:57", "042", "public.config", false, "fenceproxy: stale fencing token"},
		{"fenceproxy:stale_at:57", "", "public.config", false, "fenceproxy: stale fencing token"},
		{"fenceproxy:stale_at:57", "42", "", false, "fenceproxy: stale fencing token"},
		{"fenceproxy:stale:41:42:13:public.config", "7", "public.other", false, "fenceproxy: stale fencing token 41 for table public.config (stored watermark 42)"},
	} {
		got, ok := rules.ExpandStaleAt(tc.msg, tc.token, tc.table)
		if ok != tc.ok || (!ok && got != tc.msg) {
			t.Errorf("ExpandStaleAt(%q, %q, %q) = %q, %v", tc.msg, tc.token, tc.table, got, ok)
		}
		e, translated := rules.TranslateError(rules.CodeStaleToken, got)
		if !translated || e.Code != rules.CodeStaleToken || e.Message != tc.want {
			t.Errorf("%q expanded with %q, %q: %+v, %v; want %q", tc.msg, tc.token, tc.table, e, translated, tc.want)
		}
	}
	// Only FP001 carries the short marker: another code's text is not a
	// stale row's error.
	if _, ok := rules.TranslateError("P0001", "fenceproxy:stale_at:5"); ok {
		t.Errorf("P0001 with the short marker was translated")
	}
}

// TestWithStaleToken: the relay's token in place of the one the stale
// marker read from the setting, whatever that setting held, and the
// table's own colons read as the table's.
func TestWithStaleToken(t *testing.T) {
	for _, tc := range []struct {
		msg, token string
		ok         bool
		want       string
	}{
		{"fenceproxy:stale:43:57:13:public.config", "41", true, "fenceproxy: stale fencing token 41 for table public.config (stored watermark 57)"},
		{"fenceproxy:stale::57:13:public.config", "41", true, "fenceproxy: stale fencing token 41 for table public.config (stored watermark 57)"},
		{"fenceproxy:stale:1:9:13:public.config:57:13:public.config", "41", true, "fenceproxy: stale fencing token 41 for table public.config (stored watermark 57)"},
		{"fenceproxy:stale:x:y::57:13:public.config", "41", true, "fenceproxy: stale fencing token 41 for table public.config (stored watermark 57)"},
		{"fenceproxy:stale:43::13:public.config", "41", true, "fenceproxy: stale fencing token 41 for table public.config (stored watermark NULL)"},
		{`fenceproxy:stale:43:-3:12:public."a:b"`, "9", true, `fenceproxy: stale fencing token 9 for table public."a:b" (stored watermark -3)`},
		{`fenceproxy:stale:5:7:16:public."t:0:2:y"`, "5", true, `fenceproxy: stale fencing token 5 for table public."t:0:2:y" (stored watermark 7)`},
		{`fenceproxy:stale:7:99:11:public.acct:42:11:public.acct`, "41", true, "fenceproxy: stale fencing token 41 for table public.acct (stored watermark 42)"},
		{"fenceproxy:stale:43:57:13:public.config", "041", false, "fenceproxy: stale fencing token 43 for table public.config (stored watermark 57)"},
		{"fenceproxy:stale:43:57:99:public.config", "41", false, "fenceproxy: stale fencing token"},
		{"fenceproxy:stale_at:57", "41", false, "fenceproxy: stale fencing token"},
	} {
		got, ok := rules.WithStaleToken(tc.msg, tc.token)
		if ok != tc.ok || (!ok && got != tc.msg) {
			t.Errorf("WithStaleToken(%q, %q) = %q, %v", tc.msg, tc.token, got, ok)
		}
		e, translated := rules.TranslateError(rules.CodeStaleToken, got)
		if !translated || e.Message != tc.want {
			t.Errorf("%q with %q: %+v, %v; want %q", tc.msg, tc.token, e, translated, tc.want)
		}
	}
}
