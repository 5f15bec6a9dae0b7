package rules

// This is the one internal test: it needs the rewritten tree and the
// splicer's edits, to prove that for every golden input the fragments land
// where the tree says they go: the spliced text parses back into exactly
// the rewritten tree, and the client's bytes all survive, in order.

import (
	"bufio"
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"

	pg "github.com/pganalyze/pg_query_go/v6"
	"google.golang.org/protobuf/proto"
	"gopkg.in/yaml.v3"
)

// goldenInputs returns the SQL of every case in testdata/rewrite/*.txt.
func goldenInputs(t *testing.T) []string {
	t.Helper()
	files, err := filepath.Glob(filepath.Join("testdata", "rewrite", "*.txt"))
	if err != nil || len(files) == 0 {
		t.Fatalf("no golden files: %v", err)
	}
	var out []string
	for _, path := range files {
		f, err := os.Open(path)
		if err != nil {
			t.Fatal(err)
		}
		sc := bufio.NewScanner(f)
		sc.Buffer(make([]byte, 1<<20), 1<<20)
		var cur []string
		in := false
		for sc.Scan() {
			line := sc.Text()
			switch {
			case strings.HasPrefix(line, "=== "):
				in, cur = true, nil
			case strings.HasPrefix(line, "--- ") && in:
				out = append(out, strings.Join(cur, "\n"))
				in = false
			case in:
				cur = append(cur, line)
			}
		}
		f.Close()
	}
	return out
}

func TestSplicePreservesRewrittenTree(t *testing.T) {
	b, err := os.ReadFile(filepath.Join("testdata", "rewrite", "rules.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var sets map[string]Config
	if err := yaml.Unmarshal(b, &sets); err != nil {
		t.Fatal(err)
	}
	inputs := goldenInputs(t)
	checked := 0
	for name, cfg := range sets {
		r, err := Compile(cfg)
		if err != nil {
			t.Fatal(err)
		}
		for _, sql := range inputs {
			res, final := r.rewrite(sql, nil)
			if final != nil {
				continue
			}
			out, check, _, err := res.sp.apply()
			if err == nil {
				err = verify(check, res.tree)
			}
			if err != nil {
				t.Errorf("%s: %s: %v", name, sql, err)
				continue
			}
			// Every byte the client sent is still there, in order, and
			// only replaced where the rewriter wraps a client's value.
			kept := 0
			for _, e := range res.sp.edits {
				kept += e.end - e.start
			}
			if kept == 0 && !isSubsequence(sql, out) {
				t.Errorf("%s: %s: the client's bytes did not survive: %s", name, sql, out)
			}
			checked++
		}
	}
	if checked < 50 {
		t.Fatalf("only %d rewritten statements checked", checked)
	}
}

func isSubsequence(a, b string) bool {
	j := 0
	for i := 0; i < len(b) && j < len(a); i++ {
		if a[j] == b[i] {
			j++
		}
	}
	return j == len(a)
}

// canonical must ignore positions and nothing else.
func TestCanonical(t *testing.T) {
	md := (&pg.ParseResult{}).ProtoReflect().Descriptor()
	enc := func(sql string) []byte {
		t.Helper()
		tree, err := pg.Parse(sql)
		if err != nil {
			t.Fatal(err)
		}
		b, err := proto.Marshal(tree)
		if err != nil {
			t.Fatal(err)
		}
		c, ok := canonical(nil, b, md)
		if !ok {
			t.Fatalf("canonical(%q) failed", sql)
		}
		return c
	}
	same := [][2]string{
		{"UPDATE t SET a = 1 WHERE b = 2", "UPDATE   t  SET a=1   WHERE b=2"},
		{"SELECT (a + b) * c", "SELECT (a+b)*c"},
	}
	for _, p := range same {
		if !bytes.Equal(enc(p[0]), enc(p[1])) {
			t.Errorf("%q and %q differ", p[0], p[1])
		}
	}
	differ := [][2]string{
		{"UPDATE t SET a = 1 WHERE b = 2", "UPDATE t SET a = 1 WHERE b = 3"},
		{"SELECT a + b * c", "SELECT (a + b) * c"},
		{"SELECT a OR b AND c", "SELECT (a OR b) AND c"},
		{"SELECT 1", "SELECT 1; SELECT 1"},
		{"SELECT x", "SELECT \"X\""},
	}
	for _, p := range differ {
		if bytes.Equal(enc(p[0]), enc(p[1])) {
			t.Errorf("%q and %q compare equal", p[0], p[1])
		}
	}
	if _, ok := canonical(nil, []byte{0x0a, 0x05, 0x01}, md); ok {
		t.Error("malformed input accepted")
	}
}
