package policy

import (
	"context"
	"reflect"
	"testing"

	"github.com/fenceproxy/fenceproxy/internal/dbsetup"
	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/rules"
)

func memoRules(t testing.TB, tables ...string) *rules.Rules {
	t.Helper()
	cfg := rules.Config{CacheSize: rules.DefaultCacheSize}
	for _, tb := range tables {
		cfg.Tables = append(cfg.Tables, rules.Table{Table: tb})
	}
	rs, err := rules.Compile(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return rs
}

// TestLastForwardRemembered: a session's decision of a text forwarded as
// sent is answered from its memory the next time, and the answer is the
// decision without it; texts rewritten, with a lock registration, or
// judged against running migrations are not kept.
func TestLastForwardRemembered(t *testing.T) {
	p := New(memoRules(t, "public.config"), false, Options{})
	info := &proxy.SessionInfo{Database: "db", User: "u", Memo: new(proxy.DecisionMemo)}
	plain := &proxy.SessionInfo{Database: "db", User: "u"} // no memory
	lex := proxy.Lexing{StandardConformingStrings: true, ClientEncoding: "UTF8"}

	const read = "SELECT v FROM items WHERE id = $1"
	first := p.Decide(info, lex, read)
	if m := remembered(info); m == nil || string(m.text) != read {
		t.Fatalf("a forwarded read is not remembered: %+v", m)
	}
	again, ok := p.DecideQuick(info, lex, read)
	if !ok || !reflect.DeepEqual(again, first) || !reflect.DeepEqual(again, p.Decide(plain, lex, read)) {
		t.Errorf("the read again: %+v (ok %v), first %+v", again, ok, first)
	}

	// A rewrite is not kept, and what was kept stays the read's.
	const write = "UPDATE config SET v = 1 WHERE id = 1"
	if d := p.Decide(info, lex, write); d.Action != proxy.Rewrite {
		t.Fatalf("the write: %+v, want a rewrite", d)
	}
	if m := remembered(info); m == nil || string(m.text) != read {
		t.Errorf("after a rewrite the memory holds %q", m.text)
	}
	if d := p.Decide(info, lex, write); d.Action != proxy.Rewrite {
		t.Errorf("the write again: %+v, want a rewrite", d)
	}

	// A text the server may read otherwise is not the same text.
	other := lex
	other.StandardConformingStrings = false
	if _, ok := recall(info, p.current.Load(), nil, other, read); ok {
		t.Error("recalled under another lexing")
	}
	if _, ok := recall(info, p.current.Load(), &dbChecks{}, lex, read); ok {
		t.Error("recalled under other check results")
	}
	if _, ok := recall(info, p.current.Load(), nil, lex, read+" "); ok {
		t.Error("recalled for another text")
	}
}

// TestLastForwardAfterReload: a text forwarded under one rule set is
// decided again under the next: a reload that protects its table rewrites
// it at once.
func TestLastForwardAfterReload(t *testing.T) {
	p := New(memoRules(t, "public.config"), false, Options{})
	info := &proxy.SessionInfo{Database: "db", User: "u", Memo: new(proxy.DecisionMemo)}
	lex := proxy.Lexing{StandardConformingStrings: true, ClientEncoding: "UTF8"}
	const write = "UPDATE items SET v = 1 WHERE id = 1"
	for range 2 {
		if d := p.Decide(info, lex, write); d.Action != proxy.Forward {
			t.Fatalf("a write of an unprotected table: %+v", d)
		}
	}
	if remembered(info) == nil {
		t.Fatal("not remembered")
	}
	p.Swap(memoRules(t, "public.config", "public.items"), false)
	d, ok := p.DecideQuick(info, lex, write)
	if !ok {
		d = p.Decide(info, lex, write)
	}
	if d.Action != proxy.Rewrite {
		t.Errorf("after the reload that protects it: %+v, want a rewrite", d)
	}
}

// TestLastForwardNotKept: decisions that depend on more than the rules,
// the check results and the lexing are not remembered.
func TestLastForwardNotKept(t *testing.T) {
	rs, err := rules.Compile(rules.Config{CacheSize: rules.DefaultCacheSize, Tables: []rules.Table{{Table: "public.config", Lock: "optional"}}})
	if err != nil {
		t.Fatal(err)
	}
	p := New(rs, false, Options{})
	p.SetMigrations(MigrationOptions{})
	lex := proxy.Lexing{StandardConformingStrings: true, ClientEncoding: "UTF8"}
	for _, sql := range []string{
		"SELECT v FROM config WHERE id = 1",    // registers the lock
		"CREATE INDEX ON items (v)",            // judged against the migrations
		"ALTER TABLE items ADD COLUMN w int",   // the same
		"UPDATE config SET v = 1 WHERE id = 1", // rewritten
	} {
		info := &proxy.SessionInfo{Database: "db", User: "u", Memo: new(proxy.DecisionMemo)}
		p.Decide(info, lex, sql)
		if m := remembered(info); m != nil && m.set != nil {
			t.Errorf("%s: remembered", sql)
		}
	}
	// The memory of a text is dropped when the next decision may not be
	// kept: a session alternating the two decides both each time.
	info := &proxy.SessionInfo{Database: "db", User: "u", Memo: new(proxy.DecisionMemo)}
	p.Decide(info, lex, "SELECT 1")
	p.remember(info, p.current.Load(), nil, lex, "SELECT 2", &rules.Decision{}, true)
	if _, ok := recall(info, p.current.Load(), nil, lex, "SELECT 1"); ok {
		t.Error("a volatile decision left the earlier text remembered")
	}
}

// BenchmarkDecideRepeated: the decision of a read that names no protected
// table, sent again and again by one session (pgbench -S -M extended's
// Parse), with the session's memory and without.
func BenchmarkDecideRepeated(b *testing.B) {
	p := New(memoRules(b, "public.config"), false, Options{})
	lex := proxy.Lexing{StandardConformingStrings: true, ClientEncoding: "UTF8"}
	const sql = "SELECT abalance FROM pgbench_accounts WHERE aid = $1;"
	for _, c := range []struct {
		name string
		memo *proxy.DecisionMemo
	}{{"memory", new(proxy.DecisionMemo)}, {"none", nil}} {
		b.Run(c.name, func(b *testing.B) {
			info := &proxy.SessionInfo{Database: "db", User: "u", Memo: c.memo}
			p.Decide(info, lex, sql)
			b.ReportAllocs()
			for b.Loop() {
				if _, ok := p.DecideQuick(info, lex, sql); !ok {
					b.Fatal("not quick")
				}
			}
		})
	}
}

// TestKeptStateInForce: a session's kept check results answer only while
// they are the database's results in force: not once expired, nor once
// newer results replaced them.
func TestKeptStateInForce(t *testing.T) {
	p := New(nil, false, Options{Checks: noChecks{}})
	cur := &dbChecks{known: true}
	p.checkCache.byDB.Store("db", cur)
	if st, ok := p.dbStateKept(cur, "db"); !ok || st != cur {
		t.Fatalf("kept results in force: %p %v", st, ok)
	}
	old := &dbChecks{known: true}
	old.superseded.Store(true)
	if st, ok := p.dbStateKept(old, "db"); !ok || st != cur {
		t.Errorf("superseded results kept: got %p, want those in force %p", st, cur)
	}
	gone := &dbChecks{known: true}
	gone.expired.Store(true)
	if st, ok := p.dbStateKept(gone, "db"); !ok || st != cur {
		t.Errorf("expired results kept: got %p, want those in force %p", st, cur)
	}
	cur.expired.Store(true)
	if _, ok := p.dbStateKept(cur, "db"); ok {
		t.Error("expired results in force answered without a check")
	}
}

// noChecks is a Checks whose every database's results are known and empty.
type noChecks struct{}

func (noChecks) Ensure(string)                        {}
func (noChecks) Wait(context.Context, string) error   { return nil }
func (noChecks) Result(string) (dbsetup.Result, bool) { return dbsetup.Result{}, true }
func (noChecks) Recheck(string)                       {}

// TestRefreshSupersedes: reading a database's results again marks those
// it replaces, which sessions then stop using.
func TestRefreshSupersedes(t *testing.T) {
	p := New(nil, false, Options{Checks: noChecks{}})
	first := p.refreshDBState("db")
	if first.superseded.Load() {
		t.Fatal("the first results read are superseded")
	}
	second := p.refreshDBState("db")
	if !first.superseded.Load() || second.superseded.Load() {
		t.Errorf("after a second read: first superseded %v, second %v", first.superseded.Load(), second.superseded.Load())
	}
	if st, ok := p.dbStateKept(first, "db"); !ok || st != second {
		t.Errorf("a session keeping the first results: got %p, want %p", st, second)
	}
}
