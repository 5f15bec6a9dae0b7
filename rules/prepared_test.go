package rules_test

import (
	"reflect"
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
		if !reflect.DeepEqual(got, tt.want) {
			t.Errorf("PreparedOps(%q) = %+v, want %+v", tt.sql, got, tt.want)
		}
	}
	if _, err := rules.PreparedOps("EXECUTE"); err == nil {
		t.Error("PreparedOps of a syntax error: no error")
	}
}
