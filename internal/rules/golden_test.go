package rules_test

import (
	"bufio"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"

	pg "github.com/pganalyze/pg_query_go/v6"
	"gopkg.in/yaml.v3"

	"github.com/fenceproxy/fenceproxy/internal/rules"
)

var update = flag.Bool("update", false, "rewrite the golden files in testdata/rewrite with the current decisions")

const updateCmd = "go test ./internal/rules -run TestGolden -update"

// ruleSetFixture is a rule set of testdata/rewrite/rules.yaml: a
// rules.Config with fixture keys. audit_tag is one because the proxy sets
// the tag itself; server_functions because the proxy chooses
// Rules.ServerFunctions per database.
type ruleSetFixture struct {
	rules.Config    `yaml:",inline"`
	AuditTag        string `yaml:"audit_tag"`
	ServerFunctions bool   `yaml:"server_functions"`
}

func readRuleSets(t testing.TB) map[string]ruleSetFixture {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("testdata", "rewrite", "rules.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var raw map[string]ruleSetFixture
	if err := yaml.Unmarshal(b, &raw); err != nil {
		t.Fatalf("rules.yaml: %v", err)
	}
	for name, r := range raw {
		r.Config.AuditTag = r.AuditTag
		raw[name] = r
	}
	return raw
}

// loadRuleSets reads testdata/rewrite/rules.yaml.
func loadRuleSets(t testing.TB) map[string]rules.Config {
	t.Helper()
	sets := map[string]rules.Config{}
	for name, r := range readRuleSets(t) {
		sets[name] = r.Config
	}
	return sets
}

func compileSets(t testing.TB) map[string]*rules.Rules {
	t.Helper()
	out := map[string]*rules.Rules{}
	for name, fx := range readRuleSets(t) {
		r, err := rules.Compile(fx.Config)
		if err != nil {
			t.Fatalf("rules.yaml: %s: %v", name, err)
		}
		if fx.ServerFunctions {
			r = r.ServerFunctions()
		}
		out[name] = r
	}
	return out
}

// goldenFile is a parsed testdata/rewrite/*.txt file:
//
//	# comment lines
//	=== case name
//	SQL (one or more lines)
//	--- rule set name
//	FORWARD
//	--- another rule set
//	REWRITE schema.table ...
//	rewritten SQL (compared after parse -> deparse normalisation; wrapped
//	at about 100 bytes, with the fragments of goldenNames by name:
//	{TOKEN} is pg_catalog.current_setting('fence.token', true),
//	{TOKEN_PATTERN} and {SHORT_TOKEN_PATTERN} the token's patterns)
//	--- yet another
//	REFUSE FP003 schema.table ...
//	message
//	--- an audit rule set
//	FORWARD schema.table ...
//	WOULD REFUSE FP003 schema.table: message
//
// A WOULD REFUSE line (Decision.AuditRefusal) may also follow a REWRITE
// line, before the SQL.
//
// To add a case, write its header, its SQL and empty "--- name" lines for
// the rule sets it should run under, then run the update command.
type goldenFile struct {
	header []string
	cases  []*goldenCase
}

type goldenCase struct {
	name    string
	sql     string
	results []*goldenResult
}

type goldenResult struct {
	set  string
	body []string // lines after the "--- set" line
}

func parseGolden(t *testing.T, path string) *goldenFile {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	g := &goldenFile{}
	var c *goldenCase
	var r *goldenResult
	var sqlLines []string
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	flushSQL := func() {
		if c != nil && r == nil {
			c.sql = strings.TrimSpace(strings.Join(sqlLines, "\n"))
		}
	}
	for n := 1; sc.Scan(); n++ {
		line := sc.Text()
		switch {
		case strings.HasPrefix(line, "=== "):
			flushSQL()
			c = &goldenCase{name: strings.TrimSpace(line[4:])}
			g.cases = append(g.cases, c)
			r, sqlLines = nil, nil
		case strings.HasPrefix(line, "--- "):
			if c == nil {
				t.Fatalf("%s:%d: result before the first case", path, n)
			}
			flushSQL()
			r = &goldenResult{set: strings.TrimSpace(line[4:])}
			c.results = append(c.results, r)
		case c == nil:
			g.header = append(g.header, line)
		case r == nil:
			sqlLines = append(sqlLines, line)
		default:
			if strings.TrimSpace(line) != "" {
				r.body = append(r.body, line)
			}
		}
	}
	flushSQL()
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	return g
}

func (g *goldenFile) String() string {
	var b strings.Builder
	for _, h := range g.header {
		b.WriteString(h + "\n")
	}
	for _, c := range g.cases {
		fmt.Fprintf(&b, "=== %s\n%s\n", c.name, c.sql)
		for _, r := range c.results {
			fmt.Fprintf(&b, "--- %s\n", r.set)
			for _, l := range r.body {
				b.WriteString(l + "\n")
			}
		}
		b.WriteString("\n")
	}
	return b.String()
}

// goldenNames are the long fragments every rewrite repeats, shown in the
// golden files by name so that a diff can be read: the token's pattern
// (both forms) and the read of the token setting.
var goldenNames = []struct{ name, text string }{
	{"{TOKEN_PATTERN}", "'" + rules.TokenPattern() + "'"},
	{"{SHORT_TOKEN_PATTERN}", "'" + rules.ShortTokenPattern() + "'"},
	{"{TOKEN}", "pg_catalog.current_setting('fence.token', true)"},
}

// collapse names the fragments of goldenNames in sql.
func collapse(sql string) string {
	for _, n := range goldenNames {
		sql = strings.ReplaceAll(sql, n.text, n.name)
	}
	return sql
}

// expand is collapse undone.
func expand(sql string) string {
	for i := len(goldenNames) - 1; i >= 0; i-- {
		sql = strings.ReplaceAll(sql, goldenNames[i].name, goldenNames[i].text)
	}
	return sql
}

// goldenWidth is where wrapSQL breaks lines.
const goldenWidth = 100

// wrapSQL breaks sql into lines of about goldenWidth bytes at spaces
// outside string constants and quoted identifiers (a line break is
// white space to the parser, so the comparison, after parse and deparse,
// does not see it). No line starts with the golden format's markers.
func wrapSQL(sql string) []string {
	var lines []string
	start, quote := 0, byte(0)
	for i := 0; i < len(sql); i++ {
		c := sql[i]
		switch {
		case quote != 0:
			if c == quote {
				quote = 0
			}
		case c == '\'' || c == '"':
			quote = c
		case c == ' ' && i-start >= goldenWidth && !strings.HasPrefix(sql[i+1:], "--") && !strings.HasPrefix(sql[i+1:], "==="):
			lines = append(lines, sql[start:i])
			start = i + 1
		}
	}
	return append(lines, sql[start:])
}

// formatDecision renders d in the golden body format.
func formatDecision(d rules.Decision) []string {
	tables := strings.Join(d.Tables, " ")
	var audit []string
	if a := d.AuditRefusal; a != nil {
		audit = []string{"WOULD REFUSE " + a.Code + " " + a.Table + ": " + a.Message}
	}
	switch d.Action {
	case rules.Forward:
		if audit != nil {
			return append([]string{strings.TrimSpace("FORWARD " + tables)}, audit...)
		}
		return []string{"FORWARD"}
	case rules.Rewrite:
		return append(append([]string{strings.TrimSpace("REWRITE " + tables)}, audit...), wrapSQL(collapse(d.SQL))...)
	case rules.Refuse:
		return []string{strings.TrimSpace("REFUSE " + d.Err.Code + " " + tables), d.Err.Message}
	}
	return []string{d.Action.String()}
}

// normalize returns the canonical form of a golden body for comparison:
// rewritten SQL goes through parse -> deparse so that formatting in the
// golden file does not matter.
func normalize(body []string) (string, error) {
	if len(body) == 0 {
		return "", nil
	}
	if !strings.HasPrefix(body[0], "REWRITE") {
		return strings.Join(body, "\n"), nil
	}
	head := body[:1]
	if len(body) > 1 && strings.HasPrefix(body[1], "WOULD REFUSE ") {
		head = body[:2]
	}
	sql := expand(strings.Join(body[len(head):], "\n"))
	tree, err := pg.Parse(sql)
	if err != nil {
		return "", fmt.Errorf("expected SQL does not parse: %v", err)
	}
	out, err := pg.Deparse(tree)
	if err != nil {
		return "", err
	}
	return strings.Join(head, "\n") + "\n" + out, nil
}

// goldenFiles returns the golden files, sorted.
func goldenFiles(t *testing.T) []string {
	t.Helper()
	files, err := filepath.Glob(filepath.Join("testdata", "rewrite", "*.txt"))
	if err != nil || len(files) == 0 {
		t.Fatalf("no golden files: %v", err)
	}
	sort.Strings(files)
	return files
}

func TestGolden(t *testing.T) {
	sets := compileSets(t)
	cfgs := loadRuleSets(t)
	files := goldenFiles(t)
	for _, path := range files {
		g := parseGolden(t, path)
		changed := false
		t.Run(filepath.Base(path), func(t *testing.T) {
			for _, c := range g.cases {
				for _, res := range c.results {
					r, ok := sets[res.set]
					if !ok {
						t.Errorf("%s: case %q: unknown rule set %q", path, c.name, res.set)
						continue
					}
					d := r.Decide(c.sql)
					if d.Action == rules.Rewrite {
						if err := checkFenced(d.SQL, cfgs[res.set], d.AuditRefusal != nil); err != nil {
							t.Errorf("%s: case %q, rules %q: rewritten SQL is not fenced: %v\n%s", path, c.name, res.set, err, d.SQL)
						}
					}
					got := formatDecision(d)
					if *update {
						if strings.Join(res.body, "\n") != strings.Join(got, "\n") {
							res.body = got
							changed = true
						}
						continue
					}
					want, err := normalize(res.body)
					if err != nil {
						t.Errorf("%s: case %q, rules %q: %v", path, c.name, res.set, err)
						continue
					}
					gotN, _ := normalize(got)
					if want != gotN {
						t.Errorf("%s: case %q, rules %q:\nSQL:  %s\ngot:\n%s\nwant:\n%s\n(if the new output is right, run: %s)",
							path, c.name, res.set, c.sql, gotN, want, updateCmd)
					}
				}
			}
		})
		if *update && changed {
			if err := os.WriteFile(path, []byte(g.String()), 0o644); err != nil {
				t.Fatal(err)
			}
			t.Logf("updated %s", path)
		}
	}
}

// TestServerFunctionsEquivalent: over every golden statement and rule set,
// the error raisers' form decides as the inline form does (action, tables,
// refusal, lock registration), and differs in text only where the inline
// form raises.
func TestServerFunctionsEquivalent(t *testing.T) {
	sets := compileSets(t)
	cfgs := loadRuleSets(t)
	files := goldenFiles(t)
	n := 0
	for _, path := range files {
		for _, c := range parseGolden(t, path).cases {
			for name, r := range sets {
				if r != r.ServerFunctions() {
					n++
					a, b := r.Decide(c.sql), r.ServerFunctions().Decide(c.sql)
					switch {
					case a.Action != b.Action || strings.Join(a.Tables, ",") != strings.Join(b.Tables, ","),
						(a.Err == nil) != (b.Err == nil) || a.Err != nil && *a.Err != *b.Err,
						(a.Lock == nil) != (b.Lock == nil) || a.Lock != nil && a.Lock.Call != b.Lock.Call:
						t.Errorf("%s, %s: %q decided differently:\ninline  %+v\nraisers %+v", path, name, c.name, a, b)
					case !strings.Contains(a.SQL, "'fenceproxy:") && a.SQL != b.SQL:
						t.Errorf("%s, %s: %q: the raisers' form changed a statement that raises nothing:\n%s\n%s", path, name, c.name, a.SQL, b.SQL)
					case strings.Contains(b.SQL, "'fenceproxy:stale:") || strings.Contains(b.SQL, "'fenceproxy:token:"):
						t.Errorf("%s, %s: %q: the raisers' form still casts a marker:\n%s", path, name, c.name, b.SQL)
					}
					if b.Action == rules.Rewrite {
						if err := checkFenced(b.SQL, cfgs[name], b.AuditRefusal != nil); err != nil {
							t.Errorf("%s, %s: %q: the raisers' form is not fenced: %v\n%s", path, name, c.name, err, b.SQL)
						}
					}
				}
			}
		}
	}
	if n < 100 {
		t.Errorf("only %d decisions compared", n)
	}
}

// TestPreparedEquivalent: the prepared form (Rules.Prepared) decides every
// golden statement as the form it derives from does, in the inline form
// and the raisers', and every rewrite of it is fenced; it differs exactly
// where it has something to gain (a token check), and then validates a
// token with the short pattern before the full one or a call.
func TestPreparedEquivalent(t *testing.T) {
	if testing.Short() {
		t.Skip("slow: every golden statement in four forms; runs without -short")
	}
	sets := compileSets(t)
	cfgs := loadRuleSets(t)
	short := "OPERATOR(pg_catalog.~) '" + rules.ShortTokenPattern() + "'"
	full := "OPERATOR(pg_catalog.~) '" + rules.TokenPattern() + "'"
	n, changed := 0, 0
	for _, path := range goldenFiles(t) {
		for _, c := range parseGolden(t, path).cases {
			for name, r := range sets {
				for _, base := range []*rules.Rules{r, r.ServerFunctions()} {
					p := base.Prepared()
					if p == base || p.Prepared() != p || p.ServerFunctions().Prepared() != p.ServerFunctions() {
						t.Fatalf("%s: Prepared siblings: %p %p", name, base, p)
					}
					n++
					a, b := base.Decide(c.sql), p.Decide(c.sql)
					switch {
					case a.Action != b.Action || strings.Join(a.Tables, ",") != strings.Join(b.Tables, ","),
						(a.Err == nil) != (b.Err == nil) || a.Err != nil && *a.Err != *b.Err,
						(a.Lock == nil) != (b.Lock == nil) || a.Lock != nil && a.Lock.Call != b.Lock.Call:
						t.Errorf("%s, %s: %q decided differently:\nbase     %+v\nprepared %+v", path, name, c.name, a, b)
					case b.Action != rules.Rewrite:
						continue
					case a.SQL == b.SQL:
						if strings.Contains(a.SQL, full) || strings.Contains(a.SQL, "fenceproxy.tok_b(") || strings.Contains(a.SQL, "fenceproxy.tok(") {
							t.Errorf("%s, %s: %q: the prepared form kept a token check as it was:\n%s", path, name, c.name, b.SQL)
						}
						continue
					}
					changed++
					if err := checkFenced(b.SQL, cfgs[name], b.AuditRefusal != nil); err != nil {
						t.Errorf("%s, %s: %q: the prepared form is not fenced: %v\n%s", path, name, c.name, err, b.SQL)
					}
					checks := strings.Count(b.SQL, full) + strings.Count(b.SQL, "fenceproxy.tok_b(") + strings.Count(b.SQL, "fenceproxy.tok(")
					if strings.Count(b.SQL, short) < checks || strings.Count(b.SQL, short+" OR ") < strings.Count(b.SQL, full) {
						t.Errorf("%s, %s: %q: a token check of the prepared form is not behind the short pattern:\n%s", path, name, c.name, b.SQL)
					}
				}
			}
		}
	}
	t.Logf("%d decisions compared, %d changed", n, changed)
	if n < 100 || changed < 40 {
		t.Errorf("only %d decisions compared, %d of them changed", n, changed)
	}
}
