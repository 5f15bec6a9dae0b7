package rules_test

import (
	"fmt"
	"strings"
	"sync"
	"testing"

	"github.com/fenceproxy/fenceproxy/internal/rules"
)

func mustCompile(t testing.TB, cfg rules.Config) *rules.Rules {
	t.Helper()
	r, err := rules.Compile(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

func TestMayTouch(t *testing.T) {
	r := mustCompile(t, rules.Config{Tables: []rules.Table{
		{Table: "public.config"},
		{Table: `app."Quo""ted"`},
		{Table: "public.off", Mode: "off"},
	}})
	tests := []struct {
		sql  string
		want bool
	}{
		{"SELECT 1", false},
		{"", false},
		{"UPDATE config SET a = 1", true},
		{"update CONFIG set a = 1", true},
		{`UPDATE "CoNfIg" SET a = 1`, true}, // conservative: a different table, but it has to be parsed
		{"SELECT * FROM configuration", true},
		{"SELECT * FROM confi", false},
		{"confi", false},
		{"xconfig", true},
		{`UPDATE U&"\0063onfig" SET a = 1`, true},
		{`SELECT u&'\0041'`, true},
		{"SELECT 'a&b'", false},
		{`UPDATE app."Quo""ted" SET a = 1`, true},
		{`UPDATE app.quo"ted SET a = 1`, true},
		{"UPDATE off SET a = 1", false},
		{"SELECT 'ü' FROM t", false},
		// Schema names count only after "alter" (ALTER SCHEMA ... RENAME).
		{"ALTER SCHEMA public RENAME TO p2", true},
		{`alter schema "APP" rename to a`, true},
		{"ALTER SCHEMA other RENAME TO p2", false},
		{"SELECT * FROM public.orders", false},
		{"SELECT 'walter' FROM public.orders", true}, // conservative
	}
	for _, tt := range tests {
		if got := r.MayTouch(tt.sql); got != tt.want {
			t.Errorf("MayTouch(%q) = %v, want %v", tt.sql, got, tt.want)
		}
	}
	allocs := testing.AllocsPerRun(100, func() {
		r.MayTouch("SELECT * FROM orders WHERE id = 1 AND status = 'open'")
		r.MayTouch("ALTER TABLE public.orders ADD COLUMN x int")
	})
	if allocs != 0 {
		t.Errorf("MayTouch allocates %v times", allocs)
	}
}

// An identifier longer than 63 bytes is truncated by PostgreSQL, so a longer
// name in the statement can still reach a protected table.
func TestTruncatedIdentifierMatches(t *testing.T) {
	name := strings.Repeat("a", 63)
	r := mustCompile(t, rules.Config{Tables: []rules.Table{{Table: "public." + name}}})
	d := r.Decide("UPDATE " + name + "zzz SET x = 1")
	if d.Action != rules.Rewrite {
		t.Fatalf("got %v, want REWRITE", d.Action)
	}
}

func TestDecideKeepsOtherStatementsVerbatim(t *testing.T) {
	r := mustCompile(t, rules.Config{Tables: []rules.Table{{Table: "public.config"}}})
	sql := "SET LOCAL fence.token = '42' /* keep me */;\nUPDATE config SET a = 1 WHERE id = 1;  SELECT  'x;y'  -- trailing"
	d := r.Decide(sql)
	if d.Action != rules.Rewrite {
		t.Fatalf("got %+v", d)
	}
	if !strings.HasPrefix(d.SQL, "SET LOCAL fence.token = '42' /* keep me */;\nUPDATE config SET a = 1, \"last_fence\" = (CASE") {
		t.Errorf("first statement not kept verbatim:\n%s", d.SQL)
	}
	if !strings.HasSuffix(d.SQL, ";  SELECT  'x;y'  -- trailing") {
		t.Errorf("last statement not kept verbatim:\n%s", d.SQL)
	}
	// A line comment before the separator must not swallow the write.
	d = r.Decide("SELECT 1 -- note\n; UPDATE config SET a = 1")
	if d.Action != rules.Rewrite || !strings.HasPrefix(d.SQL, "SELECT 1 -- note\n; UPDATE config SET a = 1, \"last_fence\" = (CASE") {
		t.Errorf("got %v:\n%s", d.Action, d.SQL)
	}
}

func TestDecideTablesAndErrors(t *testing.T) {
	r := mustCompile(t, rules.Config{Tables: []rules.Table{{Table: "public.config"}, {Table: "public.accounts"}}})
	d := r.Decide("WITH a AS (UPDATE accounts SET x = 1 RETURNING 1) DELETE FROM config WHERE id IN (SELECT 1 FROM a); INSERT INTO config (id) VALUES (1)")
	if d.Action != rules.Rewrite || strings.Join(d.Tables, ",") != "public.accounts,public.config" {
		t.Fatalf("got %v %v", d.Action, d.Tables)
	}
	d = r.Decide("UPDATE config SET x = 1; TRUNCATE accounts")
	if d.Action != rules.Refuse || d.Err.Code != rules.CodeRefused || strings.Join(d.Tables, ",") != "public.accounts" || d.Err.Table != "public.accounts" {
		t.Fatalf("got %+v", d)
	}
	d = r.Decide("UPDATE U&\"\\0063onfig\" SET")
	if d.Action != rules.Refuse || d.Err.Code != rules.CodeRefused || len(d.Tables) != 0 ||
		d.Err.Message != "fenceproxy: cannot parse a statement that mentions a protected table, so it cannot be fenced" || d.Err.Detail == "" {
		t.Fatalf("got %+v %+v", d, d.Err)
	}
}

func TestActionString(t *testing.T) {
	for a, want := range map[rules.Action]string{rules.Forward: "FORWARD", rules.Rewrite: "REWRITE", rules.Refuse: "REFUSE", 9: "Action(9)"} {
		if a.String() != want {
			t.Errorf("%d.String() = %q", a, a.String())
		}
	}
}

// The cache must give the same decisions as a fresh parse, stay bounded,
// and be safe under concurrent use (run with -race).
func TestDecideCacheConcurrent(t *testing.T) {
	cached := mustCompile(t, rules.Config{CacheSize: 16, Tables: []rules.Table{{Table: "public.config"}}})
	uncached := mustCompile(t, rules.Config{CacheSize: -1, Tables: []rules.Table{{Table: "public.config"}}})
	stmts := make([]string, 64)
	for i := range stmts {
		switch i % 4 {
		case 0:
			stmts[i] = fmt.Sprintf("UPDATE config SET a = %d WHERE id = 1", i)
		case 1:
			stmts[i] = fmt.Sprintf("SELECT %d FROM config", i)
		case 2:
			stmts[i] = fmt.Sprintf("TRUNCATE config, t%d", i)
		case 3:
			stmts[i] = fmt.Sprintf("SELECT %d", i)
		}
	}
	want := make([]rules.Decision, len(stmts))
	for i, s := range stmts {
		want[i] = uncached.Decide(s)
	}
	var wg sync.WaitGroup
	errs := make(chan string, 8)
	for g := 0; g < 8; g++ {
		wg.Add(1)
		go func(g int) {
			defer wg.Done()
			for n := 0; n < 400; n++ {
				i := (n*7 + g) % len(stmts)
				got := cached.Decide(stmts[i])
				if got.Action != want[i].Action || got.SQL != want[i].SQL {
					select {
					case errs <- fmt.Sprintf("%q: got %v want %v", stmts[i], got.Action, want[i].Action):
					default:
					}
					return
				}
			}
		}(g)
	}
	wg.Wait()
	close(errs)
	for e := range errs {
		t.Error(e)
	}
}
