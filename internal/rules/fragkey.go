package rules

import (
	"encoding/binary"

	pg "github.com/pganalyze/pg_query_go/v6"
)

// fragmentKey is the key under which fragmentText keeps the proven print
// of an expression the rewriter built: an exact encoding of the node (two
// nodes get the same key only if they are equal in every field), written
// by hand for the node types the fence expressions are made of, because
// protobuf's reflective encoding of these large trees was a quarter of a
// first-seen rewrite. It returns false when n holds a node type or a field
// it does not encode (audit notifications, say); the caller then keys by
// the protobuf encoding, in a separate key space.
func fragmentKey(b []byte, n *pg.Node) ([]byte, bool) {
	e := keyEncoder{b: b, ok: true}
	e.node(n)
	return e.b, e.ok
}

type keyEncoder struct {
	b  []byte
	ok bool
}

// Type tags of the encoding. Every node starts with one; lists with their
// length; strings with theirs.
const (
	tagNil byte = iota
	tagEmpty
	tagFuncCall
	tagAConst
	tagAExpr
	tagTypeCast
	tagCaseExpr
	tagCaseWhen
	tagBoolExpr
	tagBooleanTest
	tagColumnRef
	tagString
	tagCoalesce
	// A_Const values
	tagNoVal
	tagIval
	tagFval
	tagBoolval
	tagSval
	tagBsval
)

func (e *keyEncoder) tag(t byte) { e.b = append(e.b, t) }
func (e *keyEncoder) bool(v bool) {
	if v {
		e.b = append(e.b, 1)
	} else {
		e.b = append(e.b, 0)
	}
}
func (e *keyEncoder) int(v int64)     { e.b = binary.AppendVarint(e.b, v) }
func (e *keyEncoder) uint(v uint64)   { e.b = binary.AppendUvarint(e.b, v) }
func (e *keyEncoder) str(s string)    { e.uint(uint64(len(s))); e.b = append(e.b, s...) }
func (e *keyEncoder) fail()           { e.ok = false }
func (e *keyEncoder) none(n *pg.Node) { e.ok = e.ok && n == nil }

func (e *keyEncoder) list(ns []*pg.Node) {
	e.uint(uint64(len(ns)))
	for _, n := range ns {
		e.node(n)
	}
}

func (e *keyEncoder) node(n *pg.Node) {
	if !e.ok {
		return
	}
	if n == nil {
		e.tag(tagNil)
		return
	}
	switch v := n.Node.(type) {
	case nil:
		e.tag(tagEmpty)
	case *pg.Node_FuncCall:
		f := v.FuncCall
		if len(f.AggOrder) > 0 || f.AggFilter != nil || f.Over != nil {
			e.fail()
			return
		}
		e.tag(tagFuncCall)
		e.list(f.Funcname)
		e.list(f.Args)
		e.bool(f.AggWithinGroup)
		e.bool(f.AggStar)
		e.bool(f.AggDistinct)
		e.bool(f.FuncVariadic)
		e.int(int64(f.Funcformat))
		e.int(int64(f.Location))
	case *pg.Node_AConst:
		c := v.AConst
		e.tag(tagAConst)
		switch val := c.Val.(type) {
		case nil:
			e.tag(tagNoVal)
		case *pg.A_Const_Ival:
			e.tag(tagIval)
			e.int(int64(val.Ival.GetIval()))
		case *pg.A_Const_Fval:
			e.tag(tagFval)
			e.str(val.Fval.GetFval())
		case *pg.A_Const_Boolval:
			e.tag(tagBoolval)
			e.bool(val.Boolval.GetBoolval())
		case *pg.A_Const_Sval:
			e.tag(tagSval)
			e.str(val.Sval.GetSval())
		case *pg.A_Const_Bsval:
			e.tag(tagBsval)
			e.str(val.Bsval.GetBsval())
		default:
			e.fail()
			return
		}
		e.bool(c.Isnull)
		e.int(int64(c.Location))
	case *pg.Node_AExpr:
		a := v.AExpr
		e.tag(tagAExpr)
		e.int(int64(a.Kind))
		e.list(a.Name)
		e.node(a.Lexpr)
		e.node(a.Rexpr)
		e.int(int64(a.Location))
	case *pg.Node_TypeCast:
		c := v.TypeCast
		t := c.TypeName
		if t == nil {
			e.fail()
			return
		}
		e.tag(tagTypeCast)
		e.node(c.Arg)
		e.list(t.Names)
		e.uint(uint64(t.TypeOid))
		e.bool(t.Setof)
		e.bool(t.PctType)
		e.list(t.Typmods)
		e.int(int64(t.Typemod))
		e.list(t.ArrayBounds)
		e.int(int64(t.Location))
		e.int(int64(c.Location))
	case *pg.Node_CaseExpr:
		c := v.CaseExpr
		e.none(c.Xpr)
		e.tag(tagCaseExpr)
		e.uint(uint64(c.Casetype))
		e.uint(uint64(c.Casecollid))
		e.node(c.Arg)
		e.list(c.Args)
		e.node(c.Defresult)
		e.int(int64(c.Location))
	case *pg.Node_CaseWhen:
		w := v.CaseWhen
		e.none(w.Xpr)
		e.tag(tagCaseWhen)
		e.node(w.Expr)
		e.node(w.Result)
		e.int(int64(w.Location))
	case *pg.Node_BoolExpr:
		x := v.BoolExpr
		e.none(x.Xpr)
		e.tag(tagBoolExpr)
		e.int(int64(x.Boolop))
		e.list(x.Args)
		e.int(int64(x.Location))
	case *pg.Node_BooleanTest:
		x := v.BooleanTest
		e.none(x.Xpr)
		e.tag(tagBooleanTest)
		e.node(x.Arg)
		e.int(int64(x.Booltesttype))
		e.int(int64(x.Location))
	case *pg.Node_ColumnRef:
		e.tag(tagColumnRef)
		e.list(v.ColumnRef.Fields)
		e.int(int64(v.ColumnRef.Location))
	case *pg.Node_String_:
		e.tag(tagString)
		e.str(v.String_.GetSval())
	case *pg.Node_CoalesceExpr:
		c := v.CoalesceExpr
		e.none(c.Xpr)
		e.tag(tagCoalesce)
		e.uint(uint64(c.Coalescetype))
		e.uint(uint64(c.Coalescecollid))
		e.list(c.Args)
		e.int(int64(c.Location))
	default:
		e.fail()
	}
}
