package rules_test

import (
	"testing"

	pg "github.com/pganalyze/pg_query_go/v6"
	"google.golang.org/protobuf/reflect/protoreflect"

	"github.com/fenceproxy/fenceproxy/internal/rules"
)

// FuzzRewrite checks, for arbitrary input under every rule set of
// testdata/rewrite/rules.yaml, in each of its forms (inline, raisers, and
// both as a named prepared statement gets them), that Decide never panics, that a rewrite is
// SQL in which every protected write is fenced (checkFenced), that a refusal
// carries a fenceproxy error, and that a forwarded statement that parses
// does not write a protected table. The seed corpus is in
// testdata/fuzz/FuzzRewrite; run longer with
//
//	go test ./internal/rules -run '^$' -fuzz FuzzRewrite -fuzztime 60s
func FuzzRewrite(f *testing.F) {
	cfgs := loadRuleSets(f)
	type set struct {
		name string
		cfg  rules.Config
		r    *rules.Rules
	}
	var sets []set
	for name, cfg := range cfgs {
		cfg.CacheSize = -1 // every input takes the full path
		r, err := rules.Compile(cfg)
		if err != nil {
			f.Fatal(err)
		}
		// And the error raisers' form of the same rules, and the forms a
		// named prepared statement gets (Rules.Prepared).
		sets = append(sets, set{name, cfg, r}, set{name + " (raisers)", cfg, r.ServerFunctions()},
			set{name + " (prepared)", cfg, r.Prepared()}, set{name + " (raisers, prepared)", cfg, r.ServerFunctions().Prepared()})
	}
	f.Fuzz(func(t *testing.T, sql string) {
		for _, s := range sets {
			d := s.r.Decide(sql)
			if a := d.AuditRefusal; a != nil && (d.Action == rules.Refuse || a.Code != rules.CodeRefused || a.Message == "") {
				t.Fatalf("rules %s: input %q: audit refusal without a proper error or on a refusal: %v %+v", s.name, sql, d.Action, a)
			}
			switch d.Action {
			case rules.Rewrite:
				if err := checkFenced(d.SQL, s.cfg, d.AuditRefusal != nil); err != nil {
					t.Fatalf("rules %s: input %q\nrewrite is not fenced: %v\n%s", s.name, sql, err, d.SQL)
				}
			case rules.Refuse:
				if d.Err == nil || d.Err.Code != rules.CodeRefused || d.Err.Message == "" {
					t.Fatalf("rules %s: input %q: refusal without a proper error: %+v", s.name, sql, d.Err)
				}
			case rules.Forward:
				if writesProtected(sql, s.cfg, d.AuditRefusal != nil) {
					t.Fatalf("rules %s: input %q writes a protected table but was forwarded", s.name, sql)
				}
			default:
				t.Fatalf("rules %s: unknown action %v", s.name, d.Action)
			}
		}
	})
}

// writesProtected reports whether sql parses and contains a write to (or a
// COPY FROM / TRUNCATE of) a table protected by cfg; with auditRefused,
// tables in audit mode do not count.
func writesProtected(sql string, cfg rules.Config, auditRefused bool) bool {
	tree, err := pg.Parse(sql)
	if err != nil {
		return false
	}
	c := &checker{cfg: cfg}
	for _, tb := range cfg.Tables {
		scoped := len(tb.Scope.Databases)+len(tb.Scope.Users)+len(tb.Scope.ApplicationNames) > 0
		if tb.Mode == "off" || scoped || tb.Mode == "audit" && auditRefused {
			continue
		}
		parts := splitName(tb.Table)
		c.tables = append(c.tables, checkTable{schema: parts[0], rel: parts[1]})
	}
	found := false
	for _, s := range tree.Stmts {
		walkMessages(s.ProtoReflect(), func(m protoreflect.ProtoMessage) {
			switch n := m.(type) {
			case *pg.UpdateStmt:
				found = found || c.match(n.Relation) != nil
			case *pg.DeleteStmt:
				found = found || c.match(n.Relation) != nil
			case *pg.InsertStmt:
				found = found || c.match(n.Relation) != nil
			case *pg.MergeStmt:
				found = found || c.match(n.Relation) != nil
			case *pg.CopyStmt:
				found = found || n.IsFrom && c.match(n.Relation) != nil
			case *pg.TruncateStmt:
				for _, r := range n.Relations {
					found = found || c.match(r.GetRangeVar()) != nil
				}
			}
		})
	}
	return found
}
