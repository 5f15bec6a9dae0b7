package rules

import (
	"fmt"
	"reflect"
	"strings"
	"testing"
)

// rowsOf joins n rows made by row(i).
func rowsOf(n int, row func(i int) string) string {
	out := make([]string, n)
	for i := range out {
		out[i] = row(i)
	}
	return strings.Join(out, ", ")
}

// The reduced-statement path for long VALUES lists must decide exactly as
// parsing the whole statement does, for every shape it takes and every
// shape it must leave to the full path.
func TestValuesFastPathMatchesFullPath(t *testing.T) {
	plain := func(i int) string {
		return fmt.Sprintf("(%d, 'p,(%d)''', -%d.5, $%d::text, NULL, DEFAULT)", i, i, i, i%3+1)
	}
	call := func(i int) string {
		if i == 100 {
			return fmt.Sprintf("(%d, pg_catalog.set_config('fence.token', '9', true), 0, $1, NULL, DEFAULT)", i)
		}
		return plain(i)
	}
	cols := "(id, payload, n, note, x, y)"
	cases := map[string]string{
		"insert":         "INSERT INTO config " + cols + " VALUES " + rowsOf(200, plain),
		"upsert":         "INSERT INTO config AS c " + cols + " VALUES " + rowsOf(200, plain) + " ON CONFLICT (id) DO UPDATE SET payload = EXCLUDED.payload RETURNING c.id",
		"multi":          "SELECT 1; INSERT INTO config " + cols + " VALUES " + rowsOf(100, plain) + "; UPDATE config SET n = 1 WHERE id = 1",
		"unprotected":    "INSERT INTO other " + cols + " VALUES " + rowsOf(100, plain),
		"select-from":    "INSERT INTO config " + cols + " SELECT * FROM (VALUES " + rowsOf(100, plain) + ") v",
		"cte":            "WITH i AS (INSERT INTO config " + cols + " VALUES " + rowsOf(100, plain) + " RETURNING id) SELECT count(*) FROM i",
		"fence-listed":   "INSERT INTO config (id, payload, n, note, x, last_fence) VALUES " + rowsOf(100, plain),
		"call-in-row":    "INSERT INTO config " + cols + " VALUES " + rowsOf(200, call),
		"short":          "INSERT INTO config " + cols + " VALUES " + rowsOf(10, plain),
		"truncate-after": "INSERT INTO config " + cols + " VALUES " + rowsOf(100, plain) + "; TRUNCATE config",
		// Fragments that repeat the client's text must repeat all of it.
		"merge-delete-in": "MERGE INTO config c USING src s ON c.id = s.id WHEN MATCHED AND c.id IN (VALUES " +
			rowsOf(1000, func(i int) string { return fmt.Sprintf("(%d)", 1000+i) }) + ") THEN DELETE",
		"merge-by-source": "MERGE INTO config c USING src s ON c.id = s.id WHEN NOT MATCHED BY SOURCE AND c.id IN (VALUES " +
			rowsOf(1000, func(i int) string { return fmt.Sprintf("($%d)", i+1) }) + ") THEN DELETE",
		"delete-in": "DELETE FROM config WHERE id IN (VALUES " + rowsOf(1000, func(i int) string { return fmt.Sprintf("(%d)", i) }) + ")",
		// Rows of plain tokens in an order that does not parse.
		"bad-row": "INSERT INTO config (id, payload) VALUES " + rowsOf(400, func(i int) string {
			if i == 50 {
				return "(1 2, 'x')"
			}
			return fmt.Sprintf("(%d, 'x')", i)
		}),
	}
	for _, bad := range []string{"(NULL NULL, 'x')", "(1 +, 'x')", "(1::select, 'x')", "(1::from, 'x')", "(TRUE::TRUE, 'x')", "(1::interval '1', 'x')", "(-DEFAULT, 'x')", "(1,, 'x')"} {
		cases["bad-row "+bad] = "INSERT INTO config (id, payload) VALUES " + rowsOf(400, func(i int) string {
			if i == 50 {
				return bad
			}
			return fmt.Sprintf("(%d, 'x')", i)
		})
	}
	for _, tbl := range []Table{
		{Table: "public.config"},
		{Table: "public.config", OnStale: "skip"},
		{Table: "public.config", Mode: "audit"},
		{Table: "public.config", MissingToken: "allow"},
		{Table: "public.config", Lock: "off"},
		{Table: "public.config", Lock: "required"},
		{Table: "public.config", Lock: "required", Column: "last_fence"},
	} {
		r, err := Compile(Config{Tables: []Table{tbl}, AuditTag: "t"})
		if err != nil {
			t.Fatal(err)
		}
		for name, sql := range cases {
			_, taken, _ := r.decideValuesFast(sql)
			// Whether the copies cases may take it depends on the mode (the
			// skip form repeats no text); equality is what counts there.
			copies := strings.HasPrefix(name, "merge-") || name == "delete-in"
			// Without a fence column nothing stamps the rows: listing
			// last_fence is just another column.
			noColumn := tbl.Lock == "required" && tbl.Column == ""
			want := (name != "fence-listed" || noColumn) && name != "call-in-row" && name != "short" && !strings.HasPrefix(name, "bad-row")
			if !copies && taken != want {
				t.Errorf("%s: fast path taken %v, want %v", name, taken, want)
			}
			full, _ := r.decideFull(sql, nil)
			got := r.decide(sql)
			if !reflect.DeepEqual(full, got) {
				t.Errorf("%s/%s: fast path differs:\n full %v %v %v\n got  %v %v %v", tbl.Mode+tbl.OnStale+tbl.MissingToken, name, full.Action, full.Err, full.Tok, got.Action, got.Err, got.Tok)
				if len(full.SQL) == len(got.SQL) {
					continue
				}
				for i := 0; i < len(full.SQL) && i < len(got.SQL); i++ {
					if full.SQL[i] != got.SQL[i] {
						t.Logf("first difference at %d: %q vs %q", i, full.SQL[max(0, i-60):min(len(full.SQL), i+60)], got.SQL[max(0, i-60):min(len(got.SQL), i+60)])
						break
					}
				}
			}
		}
	}
}

// The fast path is taken where it applies, and not where it must not be.
func TestValuesFastPathApplies(t *testing.T) {
	r, err := Compile(Config{Tables: []Table{{Table: "public.config"}}})
	if err != nil {
		t.Fatal(err)
	}
	plain := func(i int) string { return fmt.Sprintf("(%d, 'x')", i) }
	if _, ok, _ := r.decideValuesFast("INSERT INTO config (id, payload) VALUES " + rowsOf(500, plain)); !ok {
		t.Error("plain rows: not taken")
	}
	for name, sql := range map[string]string{
		"call":  "INSERT INTO config (id, payload) VALUES " + rowsOf(300, plain) + ", (1, upper('x'))",
		"name":  "INSERT INTO config (id, payload) VALUES " + rowsOf(300, plain) + ", (1, payload)",
		"width": "INSERT INTO config (id, payload) VALUES " + rowsOf(300, plain) + ", (1, 'x', 2)",
		"few":   "INSERT INTO config (id, payload) VALUES " + rowsOf(10, plain),
		"uesc":  "INSERT INTO config (id, payload) VALUES " + rowsOf(300, plain) + ", (1, U&'\\0041')",
	} {
		if _, ok, _ := r.decideValuesFast(sql); ok {
			t.Errorf("%s: taken", name)
		}
	}
}
