package rules

import (
	"fmt"
	"strings"

	pg "github.com/pganalyze/pg_query_go/v6"
)

// PreparedOpKind is what a statement does to the session's prepared
// statements.
type PreparedOpKind uint8

const (
	// OpPrepare is PREPARE name AS ...: it defines name.
	OpPrepare PreparedOpKind = iota + 1
	// OpExecute runs name: EXECUTE name, EXPLAIN [ANALYZE] EXECUTE name,
	// CREATE TABLE ... AS EXECUTE name.
	OpExecute
	// OpDeallocate is DEALLOCATE [PREPARE] name.
	OpDeallocate
	// OpDeallocateAll is DEALLOCATE [PREPARE] ALL or DISCARD ALL.
	OpDeallocateAll
)

// PreparedOp is one statement of a SQL text that defines, runs or removes a
// prepared statement.
type PreparedOp struct {
	Kind PreparedOpKind
	// Name is the prepared statement's name as the server stores it
	// (unquoted names are folded to lower case by the parser).
	Name string
	// Stmt is the index of the statement in the text (0-based).
	Stmt int
	// Text is the statement's own text, for OpPrepare: deciding on it
	// alone gives what the proxy sends for it.
	Text string
	// Stmts is the number of statements in the text.
	Stmts int
}

// PreparedOps lists the statements of sql that define, run or remove
// prepared statements, in order. The relay uses it to know which SQL-level
// prepared statements exist and under which rules each was prepared. An
// error means sql does not parse.
func PreparedOps(sql string) ([]PreparedOp, error) {
	tree, err := pg.Parse(sql)
	if err != nil {
		return nil, err
	}
	var ops []PreparedOp
	for i, raw := range tree.Stmts {
		n := raw.GetStmt()
		if n == nil {
			continue
		}
		switch {
		case n.GetPrepareStmt() != nil:
			start, end := int(raw.StmtLocation), int(raw.StmtLocation+raw.StmtLen)
			if raw.StmtLen == 0 && i == len(tree.Stmts)-1 {
				end = len(sql)
			}
			if start < 0 || start >= end || end > len(sql) {
				return nil, fmt.Errorf("statement %d has bounds %d..%d outside the input", i+1, start, end)
			}
			ops = append(ops, PreparedOp{Kind: OpPrepare, Name: n.GetPrepareStmt().GetName(), Stmt: i,
				Text: strings.TrimLeft(sql[start:end], " \t\r\n\f")})
		case n.GetDeallocateStmt() != nil:
			d := n.GetDeallocateStmt()
			if d.GetIsall() || d.GetName() == "" {
				ops = append(ops, PreparedOp{Kind: OpDeallocateAll, Stmt: i})
			} else {
				ops = append(ops, PreparedOp{Kind: OpDeallocate, Name: d.GetName(), Stmt: i})
			}
		case n.GetDiscardStmt() != nil:
			if n.GetDiscardStmt().GetTarget() == pg.DiscardMode_DISCARD_ALL {
				ops = append(ops, PreparedOp{Kind: OpDeallocateAll, Stmt: i})
			}
		default:
			if name, ok := executedName(n); ok {
				ops = append(ops, PreparedOp{Kind: OpExecute, Name: name, Stmt: i})
			}
		}
	}
	for i := range ops {
		ops[i].Stmts = len(tree.Stmts)
	}
	return ops, nil
}

// executedName finds the EXECUTE of a statement, directly or under EXPLAIN
// or CREATE TABLE AS (the only places the grammar allows it).
func executedName(n *pg.Node) (string, bool) {
	for depth := 0; n != nil && depth < 8; depth++ {
		switch {
		case n.GetExecuteStmt() != nil:
			return n.GetExecuteStmt().GetName(), true
		case n.GetExplainStmt() != nil:
			n = n.GetExplainStmt().GetQuery()
		case n.GetCreateTableAsStmt() != nil:
			n = n.GetCreateTableAsStmt().GetQuery()
		default:
			return "", false
		}
	}
	return "", false
}
