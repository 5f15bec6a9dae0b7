package rules_test

import (
	"strings"
	"testing"

	"github.com/fenceproxy/fenceproxy/internal/rules"
)

// Statements whose text is unusual around the places fragments go are
// still rewritten, with the client's text kept.
func TestSpliceUnusualText(t *testing.T) {
	r := mustCompile(t, rules.Config{Tables: []rules.Table{{Table: "public.config"}}})
	for _, sql := range []string{
		"UPDATE config SET a = (r).end, b = s.case FROM src s, LATERAL (SELECT 1 AS end) r WHERE config.id = s.id",
		"UPDATE config SET a = b IS DISTINCT FROM c WHERE id = 1 -- trailing comment",
		"UPDATE config SET a = CASE WHEN x THEN 1 END WHERE id = 1 /* c */",
		"INSERT INTO config (id, payload) SELECT id, 'x' AS from FROM src ORDER BY 1",
		"INSERT INTO config (id, payload) VALUES ((1+2), (SELECT 'x')), (3, r.end)",
		"DELETE FROM config USING src WHERE config.id = src.id RETURNING config.*",
		"WITH u AS (UPDATE config SET a = 1 RETURNING *) SELECT * FROM u",
		"MERGE INTO config c USING src s ON c.id = s.id WHEN MATCHED AND s.v > 1 THEN DELETE WHEN NOT MATCHED THEN INSERT (id) VALUES (s.id)",
	} {
		d := r.Decide(sql)
		if d.Action != rules.Rewrite {
			t.Errorf("%s: %v %+v", sql, d.Action, d.Err)
			continue
		}
		// Every client byte survives, in order.
		j := 0
		for i := 0; i < len(d.SQL) && j < len(sql); i++ {
			if d.SQL[i] == sql[j] {
				j++
			}
		}
		if j != len(sql) || !strings.Contains(d.SQL, "OPERATOR(pg_catalog.") {
			t.Errorf("%s:\n%s", sql, d.SQL)
		}
	}
}

// The placeholders of the check must not be names the client uses: a
// statement that spells them, even with Unicode escapes, is checked with
// other names, and one that uses every candidate is refused, not guessed.
func TestSplicePlaceholdersAvoidClientNames(t *testing.T) {
	r := mustCompile(t, rules.Config{Tables: []rules.Table{{Table: "public.config"}}})
	for _, sql := range []string{
		"UPDATE config SET a = zq0 WHERE zq1 = 1",
		`UPDATE config SET a = U&"\007Aq0" WHERE id = 1`,
	} {
		if d := r.Decide(sql); d.Action != rules.Rewrite {
			t.Errorf("%s: %v %+v", sql, d.Action, d.Err)
		}
	}
	// Random text holding every short candidate gets a longer one.
	short := "UPDATE config SET a = 'zq qz xq qx zx xz jq qj vq qv zj jz' WHERE id = 1"
	if d := r.Decide(short); d.Action != rules.Rewrite {
		t.Errorf("every short candidate used: %v %+v", d.Action, d.Err)
	}
	var b strings.Builder
	for _, base := range []string{"zq", "qz", "xq", "qx", "zx", "xz", "jq", "qj", "vq", "qv", "zj", "jz"} {
		b.WriteString(base + "jjjjjj ")
	}
	if d := r.Decide("UPDATE config SET a = '" + b.String() + "' WHERE id = 1"); d.Action != rules.Refuse {
		t.Errorf("every candidate used: %v", d.Action)
	}
}
