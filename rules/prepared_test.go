package rules_test

import (
	"reflect"
	"strings"
	"testing"

	"github.com/fenceproxy/fenceproxy/rules"
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
