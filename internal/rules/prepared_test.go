package rules_test

import (
	"reflect"
	"strings"
	"testing"

	"github.com/fenceproxy/fenceproxy/internal/rules"
)

func TestPreparedOps(t *testing.T) {
	tests := []struct {
		sql  string
		want []rules.PreparedOp
	}{
		{"SELECT 1", nil},
		{`PREPARE Upd(int) AS UPDATE config SET n = $1`, []rules.PreparedOp{
			{Kind: rules.OpPrepare, Name: "upd", Text: `PREPARE Upd(int) AS UPDATE config SET n = $1`}}},
		{`SET x = 1;  PREPARE "Upd" AS DELETE FROM config; EXECUTE "Upd"`, []rules.PreparedOp{
			{Kind: rules.OpPrepare, Name: "Upd", Stmt: 1, Text: `PREPARE "Upd" AS DELETE FROM config`},
			{Kind: rules.OpExecute, Name: "Upd", Stmt: 2}}},
		{"EXPLAIN (ANALYZE, COSTS OFF) EXECUTE upd(1)", []rules.PreparedOp{{Kind: rules.OpExecute, Name: "upd"}}},
		{"EXPLAIN ANALYZE EXECUTE upd(1)", []rules.PreparedOp{{Kind: rules.OpExecute, Name: "upd"}}},
		{"CREATE TABLE t AS EXECUTE upd(1)", []rules.PreparedOp{{Kind: rules.OpExecute, Name: "upd"}}},
		{"DEALLOCATE PREPARE upd; DEALLOCATE ALL; DISCARD ALL; DISCARD PLANS", []rules.PreparedOp{
			{Kind: rules.OpDeallocate, Name: "upd"},
			{Kind: rules.OpDeallocateAll, Stmt: 1},
			{Kind: rules.OpDeallocateAll, Stmt: 2}}},
	}
	for _, tt := range tests {
		got, err := rules.PreparedOps(tt.sql)
		if err != nil {
			t.Errorf("PreparedOps(%q): %v", tt.sql, err)
			continue
		}
		stmts := 0
		for i := range got {
			if i == 0 {
				stmts = got[i].Stmts
			}
			if got[i].Stmts != stmts || stmts < 1 {
				t.Errorf("PreparedOps(%q): statement counts %+v", tt.sql, got)
			}
			got[i].Stmts = 0
		}
		if want := strings.Count(tt.sql, ";") + 1; len(got) > 0 && stmts != want {
			t.Errorf("PreparedOps(%q): %d statements, want %d", tt.sql, stmts, want)
		}
		if !reflect.DeepEqual(got, tt.want) {
			t.Errorf("PreparedOps(%q) = %+v, want %+v", tt.sql, got, tt.want)
		}
	}
	if _, err := rules.PreparedOps("EXECUTE"); err == nil {
		t.Error("PreparedOps of a syntax error: no error")
	}
}

// TestPreparable: only a rewritten single INSERT, UPDATE, DELETE or MERGE
// without RETURNING and parameters may run as a named prepared statement
// in place of a simple Query, in every form the proxy writes.
func TestPreparable(t *testing.T) {
	rs, err := rules.Compile(rules.Config{Tables: []rules.Table{{Table: "public.config"}, {Table: "public.aud", Mode: rules.ModeAudit}}})
	if err != nil {
		t.Fatal(err)
	}
	for _, tt := range []struct {
		sql  string
		want bool
	}{
		{"UPDATE config SET n = 1 WHERE id = 7", true},
		{"/* a comment */ update config set n = n + 1;", true},
		{"INSERT INTO config (id, n) VALUES (1, 2) ON CONFLICT (id) DO UPDATE SET n = 3", true},
		{"DELETE FROM config WHERE id = 1", true},
		{"MERGE INTO config c USING src s ON c.id = s.id WHEN MATCHED THEN UPDATE SET n = s.n", true},
		{"WITH x AS (SELECT 1) UPDATE config SET n = 1", true},
		{"UPDATE config SET n = 1 RETURNING n", false},
		{"DELETE FROM config RETURNING *", false},
		{"INSERT INTO config (id) VALUES (1) RETURNING id", false},
		{"UPDATE config SET n = $1 WHERE id = 1", false},
		{"UPDATE config SET n = 1 WHERE id = (SELECT $1::int)", false},
		{"UPDATE config SET n = 1; UPDATE config SET n = 2", false},
		{"SELECT 1; UPDATE config SET n = 1", false},
		{"EXPLAIN ANALYZE UPDATE config SET n = 1", false},
		{"PREPARE p AS UPDATE config SET n = 1", false},
		{"WITH u AS (UPDATE config SET n = 1 RETURNING id) SELECT * FROM u", false},
		{"UPDATE config SET n = 1 WHERE CURRENT OF c", true},
		{"UPDATE config SET at = 'now' WHERE id = 1", false},
		{"UPDATE config SET at = 'Today 10:00'::timestamp WHERE id = 1", false},
		{"UPDATE config SET at = '2024-01-01'::date + 1, note = 'snow-known' WHERE id = 1", true},
		{"INSERT INTO config (id, at) VALUES (1, ' YESTERDAY ')", false},
		{"UPDATE config SET rel = 'config'::regclass WHERE id = 1", false},
		{"UPDATE config SET rel = CAST('config' AS pg_catalog.regclass) WHERE id = 1", false},
		{"WITH d AS (DELETE FROM aud WHERE CURRENT OF c) UPDATE config SET n = 1", false}, // an audit refusal
	} {
		for _, set := range []*rules.Rules{rs, rs.ServerFunctions(), rs.Prepared(), rs.ServerFunctions().Prepared()} {
			d := set.Decide(tt.sql)
			if strings.HasPrefix(tt.sql, "WITH d AS") && (d.Action != rules.Rewrite || d.AuditRefusal == nil) {
				t.Errorf("%q: %v, audit refusal %v; want a rewrite with an audit refusal", tt.sql, d.Action, d.AuditRefusal)
			}
			if got := d.Action == rules.Rewrite && d.Preparable; got != tt.want {
				t.Errorf("%q: %v, Preparable %v; want preparable %v", tt.sql, d.Action, d.Preparable, tt.want)
			}
		}
	}
}
