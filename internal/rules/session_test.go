package rules_test

import (
	"reflect"
	"strings"
	"testing"

	"github.com/fenceproxy/fenceproxy/internal/rules"
)

// sessionRules protects public.config in database app, and not for user
// migrator there.
func sessionRules(t testing.TB) *rules.Rules {
	return mustCompile(t, rules.Config{CacheSize: rules.DefaultCacheSize, Tables: []rules.Table{
		{Table: "public.config", Mode: "off", Scope: rules.Scope{Users: []string{"migrator"}}},
		{Table: "public.config", Scope: rules.Scope{Databases: []string{"app"}}},
	}})
}

// utf8 is how PostgreSQL reads texts by default.
var (
	utf8         = rules.Lexing{StandardConformingStrings: true, ClientEncoding: "UTF8"}
	utf8Prepared = rules.Lexing{StandardConformingStrings: true, ClientEncoding: "UTF8", Prepared: true}
)

// TestDecideFor checks each step of DecideFor against the methods it
// stands for.
func TestDecideFor(t *testing.T) {
	r := sessionRules(t)
	fenced := rules.Session{Database: "app", User: "u", Lexing: utf8}
	unfenced := rules.Session{Database: "app", User: "migrator", Lexing: utf8}
	elsewhere := rules.Session{Database: "other", User: "u", Lexing: utf8}
	const upd = "UPDATE config SET payload = 'x' WHERE id = 1"
	withLex := func(s rules.Session, l rules.Lexing) rules.Session { s.Lexing = l; return s }
	backslash, high := utf8, utf8
	backslash.Backslash = true
	high.NonASCII = true

	tests := []struct {
		name  string
		s     rules.Session
		sql   string
		want  rules.Decision // compared in full unless refusal is set
		final bool
		// refusal: a substring of the refusal's message.
		refusal string
	}{
		{name: "scoped: fenced", s: fenced, sql: upd, want: r.ForSession("app", "u", "").Decide(upd)},
		{name: "scoped: entry off", s: unfenced, sql: upd, want: rules.Decision{}},
		{name: "scoped: other database", s: elsewhere, sql: upd, want: rules.Decision{}},
		{name: "drop database: unfenced session", s: unfenced, sql: "DROP DATABASE app", final: true, refusal: "DROP DATABASE app is not allowed"},
		{name: "drop database: other database's session", s: elsewhere, sql: "drop database app", final: true, refusal: "DROP DATABASE app is not allowed"},
		{name: "drop database: unprotected database", s: elsewhere, sql: "DROP DATABASE scratch", want: rules.Decision{}},
		{name: "drop database: fenced session", s: fenced, sql: "DROP DATABASE app", refusal: "DROP DATABASE"},
		{name: "lexing: uncertain", s: withLex(fenced, rules.Lexing{Uncertain: true, Backslash: true, StandardConformingStrings: true, ClientEncoding: "UTF8"}),
			sql: `UPDATE config SET payload = 'a\b'`, final: true, refusal: "not yet synced"},
		{name: "lexing: backslash, standard_conforming_strings off", s: withLex(fenced, rules.Lexing{Backslash: true, ClientEncoding: "UTF8"}),
			sql: `UPDATE config SET payload = 'a\b'`, final: true, refusal: "need standard_conforming_strings = on"},
		{name: "lexing: non-ASCII, SJIS", s: withLex(fenced, rules.Lexing{NonASCII: true, StandardConformingStrings: true, ClientEncoding: "SJIS"}),
			sql: "UPDATE config SET payload = '\x83\x5c'", final: true, refusal: "need client_encoding UTF8, got SJIS"},
		{name: "lexing: backslash, standard_conforming_strings on", s: withLex(fenced, backslash),
			sql: `UPDATE config SET payload = 'a\b'`, want: r.ForSession("app", "u", "").Decide(`UPDATE config SET payload = 'a\b'`)},
		{name: "lexing: non-ASCII, UTF8", s: withLex(fenced, high), sql: "UPDATE config SET payload = 'ü'",
			want: r.ForSession("app", "u", "").Decide("UPDATE config SET payload = 'ü'")},
		{name: "lexing: not a protected table", s: withLex(fenced, rules.Lexing{Uncertain: true, Backslash: true}),
			sql: `UPDATE other SET payload = 'a\b'`, want: rules.Decision{}},
		{name: "lexing: unfenced session", s: withLex(unfenced, rules.Lexing{Backslash: true}),
			sql: `UPDATE config SET payload = 'a\b'`, want: rules.Decision{}},
		{name: "raisers", s: rules.Session{Database: "app", Lexing: utf8, Raisers: true}, sql: upd,
			want: r.ForSession("app", "", "").ServerFunctions().Decide(upd)},
		{name: "prepared", s: rules.Session{Database: "app", Lexing: utf8Prepared}, sql: upd,
			want: r.ForSession("app", "", "").Prepared().Decide(upd)},
		{name: "raisers, prepared", s: rules.Session{Database: "app", Lexing: utf8Prepared, Raisers: true}, sql: upd,
			want: r.ForSession("app", "", "").ServerFunctions().Prepared().Decide(upd)},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			d, final, ok := r.DecideFor(tt.s, tt.sql)
			if !ok || final != tt.final {
				t.Fatalf("ok %v, final %v; want true, %v", ok, final, tt.final)
			}
			if tt.refusal != "" {
				if d.Action != rules.Refuse || d.Err.Code != rules.CodeRefused || !strings.Contains(d.Err.Message, tt.refusal) {
					t.Fatalf("got %+v, want a refusal with %q", d, tt.refusal)
				}
				return
			}
			if !reflect.DeepEqual(d, tt.want) {
				t.Fatalf("got %+v\nwant %+v", d, tt.want)
			}
		})
	}

	// The variants' rewrites differ: the test above would not notice a
	// variant left out otherwise.
	plain, _, _ := r.DecideFor(fenced, upd)
	raisers, _, _ := r.DecideFor(rules.Session{Database: "app", Lexing: utf8, Raisers: true}, upd)
	prepared, _, _ := r.DecideFor(rules.Session{Database: "app", Lexing: utf8Prepared}, upd)
	if plain.Action != rules.Rewrite || plain.SQL == raisers.SQL || plain.SQL == prepared.SQL {
		t.Errorf("variants decide alike:\n%s\n%s\n%s", plain.SQL, raisers.SQL, prepared.SQL)
	}
}

// TestDecideForNonASCIIName: where a protected name has a byte >= 0x80,
// which MayTouch can only find in UTF-8 text, a text with such bytes in
// another encoding is refused even when MayTouch clears it.
func TestDecideForNonASCIIName(t *testing.T) {
	r := mustCompile(t, rules.Config{Tables: []rules.Table{{Table: `public."configé"`}}})
	s := rules.Session{Database: "app", Lexing: rules.Lexing{NonASCII: true, StandardConformingStrings: true, ClientEncoding: "LATIN1"}}
	const sql = "UPDATE \"config\xe9\" SET payload = 'x'"
	if r.MayTouch(sql) {
		t.Fatal("MayTouch finds the LATIN1 name: the test no longer tests the case")
	}
	d, final, ok := r.DecideFor(s, sql)
	if !ok || !final || d.Action != rules.Refuse || !strings.Contains(d.Err.Message, "got LATIN1") {
		t.Fatalf("got %+v, %v, %v; want a final refusal", d, final, ok)
	}
	s.Lexing.ClientEncoding = "UTF8"
	if d, final, ok := r.DecideFor(s, sql); !ok || final || d.Action != rules.Forward {
		t.Fatalf("UTF8: got %+v, %v, %v; want a forward", d, final, ok)
	}
}

// TestDecideForQuick: a quick decision answers what needs no parse, and
// reports false for the rest until the text's decision is cached.
func TestDecideForQuick(t *testing.T) {
	r := sessionRules(t)
	full := rules.Session{Database: "app", Lexing: utf8}
	quick := full
	quick.Quick = true
	for _, s := range []rules.Session{quick, {Database: "app", Lexing: utf8Prepared, Raisers: true, Quick: true}} {
		if d, _, ok := r.DecideFor(s, "SELECT 1"); !ok || d.Action != rules.Forward {
			t.Fatalf("%+v: SELECT 1: got %+v, %v; want a forward", s, d, ok)
		}
		const upd = "UPDATE config SET payload = 'q' WHERE id = 2"
		if _, _, ok := r.DecideFor(s, upd); ok {
			t.Fatalf("%+v: first seen: answered without a parse", s)
		}
		slow := s
		slow.Quick = false
		want, _, _ := r.DecideFor(slow, upd)
		if d, final, ok := r.DecideFor(s, upd); !ok || final || !reflect.DeepEqual(d, want) || d.Action != rules.Rewrite {
			t.Fatalf("%+v: cached: got %+v, %v, %v; want %+v", s, d, final, ok, want)
		}
	}
	// The variants are cached apart.
	if _, _, ok := r.DecideFor(rules.Session{Database: "app", Lexing: utf8, Raisers: true, Quick: true}, "UPDATE config SET payload = 'q' WHERE id = 2"); ok {
		t.Fatal("the raisers' form answered from the plain form's entry")
	}
	// Refusals before the decision need no parse of it.
	s := quick
	s.Lexing.Uncertain, s.Lexing.Backslash = true, true
	if d, final, ok := r.DecideFor(s, `UPDATE config SET payload = 'a\b' WHERE id = 3`); !ok || !final || d.Action != rules.Refuse {
		t.Fatalf("lexing refusal: got %+v, %v, %v", d, final, ok)
	}
	s = rules.Session{Database: "other", Lexing: utf8, Quick: true}
	if d, final, ok := r.DecideFor(s, "DROP DATABASE app"); !ok || !final || d.Action != rules.Refuse {
		t.Fatalf("drop database: got %+v, %v, %v", d, final, ok)
	}
}

// TestDecideForAllocs: a text forwarded unlooked at, and a cached one, are
// decided without allocating, as the relay's hot path needs.
func TestDecideForAllocs(t *testing.T) {
	r := sessionRules(t)
	const upd = "UPDATE config SET payload = 'x' WHERE id = 1"
	s := rules.Session{Database: "app", User: "u", ApplicationName: "web", Lexing: utf8, Raisers: true}
	r.DecideFor(s, upd) // cached from here on
	q := s
	q.Quick = true
	if n := testing.AllocsPerRun(100, func() {
		r.DecideFor(s, "SELECT v FROM items WHERE id = 1")
		r.DecideFor(s, upd)
		r.DecideFor(q, upd)
	}); n != 0 {
		t.Errorf("DecideFor allocates %v times", n)
	}
}
