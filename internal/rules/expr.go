package rules

import (
	"strconv"
	"strings"

	pg "github.com/pganalyze/pg_query_go/v6"
	"google.golang.org/protobuf/proto"
)

// This file builds the expressions the rewriter adds, as parse-tree nodes.
// Nothing here formats SQL text: names and constants become String and
// A_Const nodes, and the deparser quotes them.
//
// With s = pg_catalog.current_setting('<setting>', true) (NULL when the
// setting was never set in the session), F = <qual>.<fence column> and
// CMP = <= (or < when strict):
//
//	V     = (s ~ '<tokenPattern>') IS TRUE   -- true or false, never NULL
//	TOK   = s::bigint
//	TOK?  = CASE WHEN V THEN TOK END         -- NULL unless the token is valid
//	FRESH = F CMP TOK
//	RAISE = (<marker text>)::bigint          -- always fails with 22P02
//
// V contains no column reference, so in a WHERE clause the planner treats it
// as a pseudo-constant and evaluates it once ("One-Time Filter").
//
// Why TOK? and not TOK in WHERE clauses: when the planner estimates the
// selectivity of "F <= expr" it pre-evaluates stable functions in expr
// (estimate_expression_value), so a bare s::bigint would fail at plan time
// with a raw "invalid input syntax" error whenever the token is invalid,
// before the friendly FP002 check could run. Inside CASE it is never
// evaluated for an invalid token.
//
// Every RAISE contains a call of current_setting or a column reference:
// the planner folds immutable subexpressions, even inside CASE branches that
// are never taken, so a constant marker cast would fail at plan time.
//
// The expressions are kept small on purpose: every node costs time in the
// proxy (protobuf encoding for the deparser, the round-trip check) and in
// the server's parser, and an INSERT stamps every VALUES row.

// tokenPattern matches exactly the decimal strings of 1..2^63-1, with
// optional leading zeros: signs, spaces, underscores, exponents, and the hex
// and octal forms that bigint input would also accept are rejected. Being a
// single regular expression (rather than a pattern plus a numeric range
// check) it needs the setting only once.
var tokenPattern = rangePattern(MaxToken)

// TokenPattern returns the regular expression the rewrites validate the
// token with; fenceproxy setup's functions use the same one.
func TokenPattern() string { return tokenPattern }

// shortTokenPattern matches the valid tokens of up to len(MaxToken)-1
// significant digits, all in range, optionally zero-padded: a third of the
// full pattern's cost in PostgreSQL's regular expression engine, and every
// token a lock service hands out for a long time. The error raisers try
// it first, and so does the prepared form (Rules.Prepared), which leaves
// longer tokens to the full check (the raisers', or the full pattern in
// the inline form).
var shortTokenPattern = `^0*[1-9][0-9]{0,` + strconv.Itoa(len(MaxToken)-2) + `}$`

// ShortTokenPattern returns shortTokenPattern.
func ShortTokenPattern() string { return shortTokenPattern }

// rangePattern builds an anchored regular expression matching the decimal
// numbers 1..max (max without leading zeros), optionally zero-padded: all
// numbers with fewer digits than max, and for numbers with as many digits,
// one alternative per position where a smaller digit may stand.
func rangePattern(max string) string {
	n := len(max)
	alts := []string{`[1-9][0-9]{0,` + strconv.Itoa(n-2) + `}`}
	for i := 0; i < n; i++ {
		lo, hi := byte('0'), max[i]-1
		if i == 0 {
			lo = '1'
		}
		if hi < lo {
			continue
		}
		alt := max[:i] + digitClass(lo, hi)
		switch rest := n - 1 - i; rest {
		case 0:
		case 1:
			alt += `[0-9]`
		default:
			alt += `[0-9]{` + strconv.Itoa(rest) + `}`
		}
		alts = append(alts, alt)
	}
	alts = append(alts, max)
	return `^0*(` + strings.Join(alts, "|") + `)$`
}

func digitClass(lo, hi byte) string {
	if lo == hi {
		return string(lo)
	}
	return "[" + string(lo) + "-" + string(hi) + "]"
}

type fencer struct {
	setting string
	tag     string // Config.AuditTag
	t       *tableRule
	// qual qualifies the fence column: the target's alias, or its relation
	// name when it has none.
	qual string
	// raisers: raise errors through the functions fenceproxy setup
	// installs (Rules.ServerFunctions).
	raisers bool
	// prepared: the form that costs less per execution (Rules.Prepared).
	prepared bool
	// sp is the splicer the fencer's fragments go into; when it makes the
	// token form (splicer.tokForm), dual records how to build each
	// expression's token form.
	sp *splicer
	// lit: the expressions being built are the token form's, with the
	// token a constant the proxy fills in (see tokenform.go).
	lit bool
	// staleAt: the token form raises a stale row's error with
	// fenceproxy.stale_at[_b] (Rules.StaleAt).
	staleAt bool
}

// dual returns the expression build makes and, when the splicer makes the
// token form, records build beside it, so that the fragment holding the
// expression can be printed with build's token-form expression in its
// place (splicer.tokText), which is built only when that print is not
// known yet.
func (f *fencer) dual(build func() *pg.Node) *pg.Node {
	n := build()
	if f.lit || f.sp == nil || !f.sp.tokForm {
		return n
	}
	// An expression that returns another's node (tokenGuard its guard's)
	// keeps the outer build: swapTwins needs pairs that share no node.
	if t, ok := f.sp.twins[n]; ok {
		t.build = build
		return n
	}
	if f.sp.twins == nil {
		f.sp.twins = map[*pg.Node]*twin{}
	}
	f.sp.twins[n] = &twin{f: f, build: build}
	return n
}

// twin is the token-form build of an expression dual made.
type twin struct {
	f     *fencer
	build func() *pg.Node
	lit   *pg.Node // built, when a print needed it
}

// litNode returns the token-form expression, building it on first use.
func (t *twin) litNode() *pg.Node {
	if t.lit == nil {
		t.f.lit = true
		t.lit = t.build()
		t.f.lit = false
	}
	return t.lit
}

// setting returns pg_catalog.current_setting('<setting>', true).
func (f *fencer) settingExpr() *pg.Node {
	return fn("current_setting", aStr(f.setting), aBool(true))
}

// valid returns V; in the prepared form (s ~ '<shortTokenPattern>' OR
// s ~ '<tokenPattern>') IS TRUE, which matches the same strings and spares
// most tokens the full pattern's cost when the statement executes.
func (f *fencer) valid() *pg.Node { return f.dual(f.validForm) }

// validForm builds valid's expression in the fencer's form: in the token
// form, true.
func (f *fencer) validForm() *pg.Node {
	if f.lit {
		return litBool(true)
	}
	full := op("~", f.settingExpr(), aStr(tokenPattern))
	if f.prepared {
		return isTrue(or(f.validShort(), full))
	}
	return isTrue(full)
}

// tok returns TOK.
func (f *fencer) tok() *pg.Node { return f.dual(f.tokForm) }

// tokForm builds tok's expression in the fencer's form: in the token
// form, the token's placeholder cast to bigint.
func (f *fencer) tokForm() *pg.Node {
	if f.lit {
		return cast(f.sp.tokHole(), "int8")
	}
	return cast(f.settingExpr(), "int8")
}

// validShort returns s ~ '<shortTokenPattern>': true for most valid
// tokens, false for the others and for invalid ones, NULL when unset.
func (f *fencer) validShort() *pg.Node {
	if f.lit {
		return litBool(true)
	}
	return op("~", f.settingExpr(), aStr(shortTokenPattern))
}

// guardedTok returns TOK?.
func (f *fencer) guardedTok() *pg.Node {
	return caseExpr([]*pg.Node{f.valid(), f.tok()}, nil)
}

// fence returns F, the qualified fence column.
func (f *fencer) fence() *pg.Node { return colRef(f.qual, f.t.column) }

func (f *fencer) cmp() string {
	if f.t.strict {
		return "<"
	}
	return "<="
}

// fresh returns F CMP TOK.
func (f *fencer) fresh() *pg.Node { return op(f.cmp(), f.fence(), f.tok()) }

// raiseStale returns an expression of type typ that always fails with the
// stale-token marker carrying the token setting's text and F:
//
//	('<marker>' || COALESCE(s, '') || ':' || COALESCE(F::text, '') || ':<table>')::typ
//
// Text concatenation with explicit text operands and COALESCE cost
// PostgreSQL's parse analysis far less than concat() or substr() (whose
// overloads it must resolve). COALESCE keeps the text from being NULL, so
// the cast always fails: a NULL fence or token still raises.
//
// With the server's error raisers it is instead
//
//	fenceproxy.stale[_b]('<setting>', F, '<n>:<table>')
//
// which raises FP001 with the same marker as its message. In the token
// form of a StaleAt set it is fenceproxy.stale_at[_b](F), whose message
// has the watermark only: the relay that sent the form knows the token and
// the table (TokenForm.StaleTable), and the two constants cost every
// statement's analysis more than the stale row's error needs.
func (f *fencer) raiseStale(typ string) *pg.Node {
	if f.raisers {
		if f.lit && f.staleAt {
			return raiserCall("stale_at", typ, f.fence())
		}
		return raiserCall("stale", typ, aStr(f.setting), f.fence(), aStr(sized(f.t.display)))
	}
	return cast(cat3(
		aStr(markerPrefix+markerStale+":"),
		coalesce(f.settingExpr(), aStr("")),
		aStr(":"),
		coalesce(cast(f.fence(), "text"), aStr("")),
		aStr(":"+sized(f.t.display)),
	), typ)
}

// raiseToken returns an expression of type typ that always fails with the
// missing-token marker, carrying the setting's value as an SQL literal
// (quote_nullable gives NULL when unset); the proxy echoes at most
// tokenEchoLen characters of it.
//
// With the server's error raisers it is
// fenceproxy.no_token[_b]('<setting>', '<n>:<table>:<n>:<setting>:'), which
// raises FP002 with the same marker.
func (f *fencer) raiseToken(typ string) *pg.Node {
	if f.raisers {
		return raiserCall("no_token", typ, aStr(f.setting), aStr(f.sizedNames()))
	}
	return cast(op("||",
		aStr(markerPrefix+markerToken+":"+f.sizedNames()),
		fn("quote_nullable", f.settingExpr()),
	), typ)
}

// sizedNames is the invalid-token marker's table and setting fields.
func (f *fencer) sizedNames() string {
	return sized(f.t.display) + ":" + sized(f.setting) + ":"
}

// raiserCall calls the error raiser fenceproxy.<name> (bigint) or
// fenceproxy.<name>_b (boolean) for a value of type typ ("int8" or
// "bool").
func raiserCall(name, typ string, args ...*pg.Node) *pg.Node {
	if typ == "bool" {
		name += "_b"
	}
	return pg.MakeFuncCallNode([]*pg.Node{pg.MakeStrNode("fenceproxy"), pg.MakeStrNode(name)}, args, -1)
}

// cat3 joins text expressions with the qualified || operator.
func cat3(parts ...*pg.Node) *pg.Node {
	out := parts[0]
	for _, p := range parts[1:] {
		out = op("||", out, p)
	}
	return out
}

// coalesce builds COALESCE(args...).
func coalesce(args ...*pg.Node) *pg.Node {
	return &pg.Node{Node: &pg.Node_CoalesceExpr{CoalesceExpr: &pg.CoalesceExpr{Args: args, Location: -1}}}
}

// sized renders a length-prefixed marker field.
func sized(s string) string { return strconv.Itoa(len(s)) + ":" + s }

// guard returns CASE WHEN V THEN true ELSE RAISE(token) END, the
// pseudo-constant WHERE conjunct that fails a statement with an invalid
// token before any row is read.
//
// With the server's error raisers it is fenceproxy.tok_b('<setting>',
// '<n>:<table>:<n>:<setting>:'), which returns true or raises FP002 as
// raiseToken does; in the prepared form the call is made only for a token
// the short pattern does not accept:
//
//	s ~ '<shortTokenPattern>' OR fenceproxy.tok_b(...)
//
// (NULL OR x is x: an unset token calls it too).
func (f *fencer) guard() *pg.Node { return f.dual(func() *pg.Node { return f.guardForm() }) }

// guardForm builds guard's expression in the fencer's form (lit or not).
func (f *fencer) guardForm() *pg.Node {
	if f.lit {
		return litBool(true)
	}
	if f.raisers {
		call := raiserCall("tok", "bool", aStr(f.setting), aStr(f.sizedNames()))
		if f.prepared {
			return or(f.validShort(), call)
		}
		return call
	}
	return caseExpr([]*pg.Node{f.valid(), aBool(true)}, f.raiseToken("bool"))
}

// lenient reports whether an invalid token lets the write through:
// missing_token: allow, or audit mode.
func (f *fencer) lenient() bool { return f.t.allow || f.t.audit }

// mode is the "m" field of the table's notifications.
func (f *fencer) mode() string {
	if f.t.audit {
		return ModeAudit
	}
	return ModeEnforce
}

// tokenGuard returns the pseudo-constant WHERE conjunct that deals with an
// invalid token once per statement, before any row is read, whether or not
// a row matches (as enforce's FP002 does):
//
//	reject:       GUARD (raises FP002)
//	allow, audit: CASE WHEN V THEN true ELSE NOTIFY(missing_token, true) END (never false)
func (f *fencer) tokenGuard() *pg.Node { return f.dual(func() *pg.Node { return f.tokenGuardForm() }) }

// tokenGuardForm builds tokenGuard's expression in the fencer's form (lit or not).
func (f *fencer) tokenGuardForm() *pg.Node {
	if !f.lenient() {
		return f.guard()
	}
	return caseExpr([]*pg.Node{f.valid(), aBool(true)}, f.notify(AuditMissingToken, aBool(true)))
}

// stamp returns the fence value for a new row:
//
//	reject:       CASE WHEN V THEN TOK ELSE RAISE(token) END
//	allow, audit: CASE WHEN V THEN TOK ELSE NOTIFY(missing_token, 0) END
//
// (0 is the fence column's documented default). record false leaves the
// NOTIFY out (ELSE 0): every row of a multi-row VALUES list is computed, so
// recording the first one is enough, and a sub-select per row would cost
// the server a sub-plan per row.
//
// With the server's error raisers, reject's is fenceproxy.tok('<setting>',
// '<n>:<table>:<n>:<setting>:'), which returns TOK or raises FP002; in the
// prepared form CASE WHEN s ~ '<shortTokenPattern>' THEN TOK ELSE
// fenceproxy.tok(...) END.
func (f *fencer) stamp(record bool) *pg.Node {
	return f.dual(func() *pg.Node { return f.stampForm(record) })
}

// stampForm builds stamp's expression in the fencer's form (lit or not).
func (f *fencer) stampForm(record bool) *pg.Node {
	if f.lit {
		return f.tok()
	}
	var invalid *pg.Node
	switch {
	case !f.lenient() && f.raisers && f.prepared:
		return caseExpr([]*pg.Node{f.validShort(), f.tok()}, raiserCall("tok", "int8", aStr(f.setting), aStr(f.sizedNames())))
	case !f.lenient() && f.raisers:
		return raiserCall("tok", "int8", aStr(f.setting), aStr(f.sizedNames()))
	case !f.lenient():
		invalid = f.raiseToken("int8")
	case record:
		invalid = f.notify(AuditMissingToken, aInt(0))
	default:
		invalid = aInt(0)
	}
	return caseExpr([]*pg.Node{f.valid(), f.tok()}, invalid)
}

// rowStamp returns the stamp of a row of a multi-row VALUES list (first:
// the first row) and its fragment kind. The first row's is stamp(true).
// With missing_token: reject the later rows' is the bare TOK: VALUES rows
// are computed in order, so the first row's stamp has already failed the
// statement if the token is invalid, and the token cannot change within
// the statement (statements that call set_config are refused). This keeps
// a large INSERT's text within a small constant of the client's. Otherwise
// it is stamp(false).
// rowStampKey is the fragment kind of rowStamp(first).
func (f *fencer) rowStampKey(first bool) string {
	switch {
	case first:
		return "stamp"
	case !f.lenient():
		return "stamp-tok"
	}
	return "stamp-quiet"
}

func (f *fencer) rowStamp(first bool) (string, *pg.Node) {
	switch {
	case first:
		return "stamp", f.stamp(true)
	case !f.lenient():
		return "stamp-tok", f.tok()
	}
	return "stamp-quiet", f.stamp(false)
}

// errorSetValue returns the new fence value for an updated row in
// on_stale: error mode:
//
//	CASE [WHEN NOT V THEN RAISE(token) | F | NOTIFY(missing_token, F)] WHEN FRESH THEN TOK ELSE RAISE(stale) END
//
// checkV is true when the statement does not otherwise deal with an
// invalid token (no WHERE guard, no stamp): then the NOT V branch raises,
// or with missing_token: allow records the write and keeps F. When checkV
// is false it is left out, or with missing_token: allow keeps F.
//
// With the server's error raisers and missing_token: reject it is one call,
//
//	fenceproxy.advance('<setting>', F, <strict>, '<n>:<table>', '<n>:<table>:<n>:<setting>:')
//
// which returns TOK for a fresh row and raises as RAISE(stale) and
// RAISE(token) do, checking the token whatever checkV says (when the
// statement checks it elsewhere first, that check has raised already).
// The prepared form keeps the call only where checkV is true; otherwise
// the statement has checked the token before any row's value is computed
// (the guard, the first row's stamp), and the value is the CASE above with
// fenceproxy.stale raising.
func (f *fencer) errorSetValue(checkV bool) *pg.Node {
	return f.dual(func() *pg.Node { return f.errorSetValueForm(checkV) })
}

// errorSetValueForm builds errorSetValue's expression in the fencer's form (lit or not).
func (f *fencer) errorSetValueForm(checkV bool) *pg.Node {
	if f.raisers && !f.t.allow && !(f.prepared && !checkV) && !f.lit {
		return pg.MakeFuncCallNode([]*pg.Node{pg.MakeStrNode("fenceproxy"), pg.MakeStrNode("advance")},
			[]*pg.Node{aStr(f.setting), f.fence(), aBool(f.t.strict), aStr(sized(f.t.display)), aStr(f.sizedNames())}, -1)
	}
	var whens []*pg.Node
	switch {
	case f.t.allow:
		whens = append(whens, not(f.valid()), f.missingKeep(checkV))
	case checkV:
		whens = append(whens, not(f.valid()), f.raiseToken("int8"))
	}
	whens = append(whens, f.fresh(), f.tok())
	return caseExpr(whens, f.raiseStale("int8"))
}

// auditSetValue returns the new fence value for an updated row in audit
// mode, which never moves the watermark backwards:
//
//	CASE WHEN NOT V THEN F | NOTIFY(missing_token, F) WHEN FRESH THEN TOK ELSE NOTIFY(stale, F) END
//
// with the NOT V branch recording the write when checkV is true, as in
// errorSetValue.
func (f *fencer) auditSetValue(checkV bool) *pg.Node {
	return f.dual(func() *pg.Node { return f.auditSetValueForm(checkV) })
}

// auditSetValueForm builds auditSetValue's expression in the fencer's form (lit or not).
func (f *fencer) auditSetValueForm(checkV bool) *pg.Node {
	return caseExpr([]*pg.Node{not(f.valid()), f.missingKeep(checkV), f.fresh(), f.tok()},
		f.notify(AuditStale, f.fence()))
}

// missingKeep returns F, or NOTIFY(missing_token, F) when record is true.
func (f *fencer) missingKeep(record bool) *pg.Node {
	if record {
		return f.notify(AuditMissingToken, f.fence())
	}
	return f.fence()
}

// skipSetValue returns the new fence value for an updated row in
// on_stale: skip mode, where the WHERE clause has already dropped stale rows:
// TOK, or with missing_token: allow, CASE WHEN V THEN TOK ELSE F END (with
// the write recorded in the ELSE branch when checkV is true).
func (f *fencer) skipSetValue(checkV bool) *pg.Node {
	return f.dual(func() *pg.Node { return f.skipSetValueForm(checkV) })
}

// skipSetValueForm builds skipSetValue's expression in the fencer's form (lit or not).
func (f *fencer) skipSetValueForm(checkV bool) *pg.Node {
	if f.t.allow {
		return caseExpr([]*pg.Node{f.valid(), f.tok()}, f.missingKeep(checkV))
	}
	return f.tok()
}

// skipCond returns the WHERE conjunct of on_stale: skip mode:
// reject: F CMP TOK?            (an invalid token matches no row)
// allow:  CASE WHEN V THEN FRESH ELSE true END
func (f *fencer) skipCond() *pg.Node { return f.dual(func() *pg.Node { return f.skipCondForm() }) }

// skipCondForm builds skipCond's expression in the fencer's form (lit or not).
func (f *fencer) skipCondForm() *pg.Node {
	if f.t.allow {
		return caseExpr([]*pg.Node{f.valid(), f.fresh()}, aBool(true))
	}
	return op(f.cmp(), f.fence(), f.guardedTok())
}

// freshOrRaise returns a boolean that is true for a fresh row and raises
// the stale error otherwise (and, with missing_token: allow, is true when
// the token is invalid). extra, if not nil, is a condition that must also
// hold before the stale error is raised; rows failing it yield false.
func (f *fencer) freshOrRaise(extra *pg.Node) *pg.Node {
	return f.dual(func() *pg.Node { return f.freshOrRaiseForm(extra) })
}

// freshOrRaiseForm builds freshOrRaise's expression in the fencer's form (lit or not).
func (f *fencer) freshOrRaiseForm(extra *pg.Node) *pg.Node {
	var whens []*pg.Node
	if f.t.allow {
		whens = append(whens, not(f.valid()), aBool(true))
	}
	whens = append(whens, f.fresh(), aBool(true))
	if extra == nil {
		return caseExpr(whens, f.raiseStale("bool"))
	}
	whens = append(whens, extra, f.raiseStale("bool"))
	return caseExpr(whens, aBool(false))
}

// freshOrNotify is freshOrRaise for audit mode: it records a stale row
// instead of raising, and is never false:
//
//	CASE WHEN NOT V THEN true WHEN FRESH THEN true [WHEN extra] THEN NOTIFY(stale, true) [ELSE true] END
//
// (the invalid token is recorded by tokenGuard).
func (f *fencer) freshOrNotify(extra *pg.Node) *pg.Node {
	return f.dual(func() *pg.Node { return f.freshOrNotifyForm(extra) })
}

// freshOrNotifyForm builds freshOrNotify's expression in the fencer's form (lit or not).
func (f *fencer) freshOrNotifyForm(extra *pg.Node) *pg.Node {
	whens := []*pg.Node{not(f.valid()), aBool(true), f.fresh(), aBool(true)}
	if extra == nil {
		return caseExpr(whens, f.notify(AuditStale, aBool(true)))
	}
	whens = append(whens, extra, f.notify(AuditStale, aBool(true)))
	return caseExpr(whens, aBool(true))
}

// auditCheck returns the self-contained audit check of a MERGE ... DELETE
// action, which has no WHERE clause for tokenGuard; it is never false:
//
//	CASE WHEN NOT V THEN NOTIFY(missing_token, true) WHEN FRESH THEN true ELSE NOTIFY(stale, true) END
func (f *fencer) auditCheck() *pg.Node { return f.dual(func() *pg.Node { return f.auditCheckForm() }) }

// auditCheckForm builds auditCheck's expression in the fencer's form (lit or not).
func (f *fencer) auditCheckForm() *pg.Node {
	return caseExpr([]*pg.Node{not(f.valid()), f.notify(AuditMissingToken, aBool(true)), f.fresh(), aBool(true)},
		f.notify(AuditStale, aBool(true)))
}

// notify returns NOTIFY(reason, val), an expression that sends an audit
// notification and yields val:
//
//	(SELECT val FROM pg_catalog.pg_notify('fenceproxy_audit', PAYLOAD) AS n [WHERE NOT V])
//	PAYLOAD = pg_catalog.json_build_object('v', 1, 'i', <tag>, 'm', <mode>, 'r', <reason>,
//	            't', <table>, 'tok', pg_catalog.substr(s, 1, 32), 'w', F | NULL)::pg_catalog.text
//
// pg_notify returns void, so it is called in the FROM clause of a scalar
// sub-select. It is volatile, so the planner never evaluates it ahead of
// time, and the executor evaluates a CASE branch only when it is taken, so
// only the rows (or statements) that take the branch send a notification.
// PostgreSQL delivers the notification on commit, and drops it on
// rollback.
//
// When val and PAYLOAD do not depend on the row (missing_token), the
// sub-select is an InitPlan, run at most once per statement, when first
// needed; but EvalPlanQual (the re-check of a row updated concurrently)
// runs every InitPlan the plan refers to, needed or not
// (ExecSetParamPlanMulti in EvalPlanQualBegin). So a missing_token NOTIFY
// carries WHERE NOT V, a pseudo-constant the planner turns into a
// One-Time Filter above the function scan: run with a valid token it
// returns no row and sends nothing. (A stale NOTIFY refers to F, so it is a
// correlated SubPlan, which is never run ahead of need.)
//
// The stored watermark "w" is F for a stale row, NULL for missing_token.
// The sub-select's alias is not the target's qualifier, so that F in val
// still names the target's column.
func (f *fencer) notify(reason string, val *pg.Node) *pg.Node {
	w := aNull()
	if reason == AuditStale {
		w = f.fence()
	}
	payload := cast(fn("json_build_object",
		aStr("v"), aInt(AuditVersion),
		aStr("i"), aStr(f.tag),
		aStr("m"), aStr(f.mode()),
		aStr("r"), aStr(reason),
		aStr("t"), aStr(f.t.display),
		aStr("tok"), fn("substr", f.settingExpr(), aInt(1), aInt(tokenEchoLen)),
		aStr("w"), w,
	), "text")
	alias := "n"
	if f.qual == alias {
		alias = "n_"
	}
	from := &pg.Node{Node: &pg.Node_RangeFunction{RangeFunction: &pg.RangeFunction{
		// Each function of a FROM item is a (call, column definitions)
		// pair; the parser leaves an empty node for "no definitions".
		Functions: []*pg.Node{pg.MakeListNode([]*pg.Node{fn("pg_notify", aStr(AuditChannel), payload), {}})},
		Alias:     &pg.Alias{Aliasname: alias},
	}}}
	var where *pg.Node
	if reason == AuditMissingToken {
		where = not(f.valid())
	}
	return &pg.Node{Node: &pg.Node_SubLink{SubLink: &pg.SubLink{
		SubLinkType: pg.SubLinkType_EXPR_SUBLINK,
		Subselect: &pg.Node{Node: &pg.Node_SelectStmt{SelectStmt: &pg.SelectStmt{
			TargetList:  []*pg.Node{pg.MakeResTargetNodeWithVal(val, -1)},
			FromClause:  []*pg.Node{from},
			WhereClause: where,
			LimitOption: pg.LimitOption_LIMIT_OPTION_DEFAULT,
			Op:          pg.SetOperation_SETOP_NONE,
		}}},
		Location: -1,
	}}}
}

// notFresh returns CASE WHEN V THEN FRESH IS NOT TRUE ELSE <invalid> END: true
// for a stale row (a NULL fence counts as stale), <invalid> when the token
// is invalid.
func (f *fencer) notFresh(invalid *pg.Node) *pg.Node {
	return f.dual(func() *pg.Node { return f.notFreshForm(invalid) })
}

// notFreshForm builds notFresh's expression in the fencer's form (lit or not).
func (f *fencer) notFreshForm(invalid *pg.Node) *pg.Node {
	return caseExpr([]*pg.Node{f.valid(), isNotTrue(f.fresh())}, invalid)
}

// --- node constructors ---

func aStr(s string) *pg.Node { return pg.MakeAConstStrNode(s, -1) }

func aInt(i int32) *pg.Node {
	return &pg.Node{Node: &pg.Node_AConst{AConst: &pg.A_Const{Val: &pg.A_Const_Ival{Ival: &pg.Integer{Ival: i}}, Location: -1}}}
}

// litLocation marks the boolean constants of the token form (litBool),
// which the constructors fold: no client node and no other node the
// rewriter builds has this location.
const litLocation = -2

// litBool is a boolean constant of the token form: what the validity of a
// token the proxy has checked, say, becomes.
func litBool(b bool) *pg.Node {
	n := aBool(b)
	n.GetAConst().Location = litLocation
	return n
}

// litValue reports the value of a litBool node.
func litValue(n *pg.Node) (v, ok bool) {
	c := n.GetAConst()
	if c == nil || c.Location != litLocation {
		return false, false
	}
	b, isBool := c.Val.(*pg.A_Const_Boolval)
	if !isBool {
		return false, false
	}
	return b.Boolval.Boolval, true
}

func aNull() *pg.Node {
	return &pg.Node{Node: &pg.Node_AConst{AConst: &pg.A_Const{Isnull: true, Location: -1}}}
}

func aBool(b bool) *pg.Node {
	return &pg.Node{Node: &pg.Node_AConst{AConst: &pg.A_Const{Val: &pg.A_Const_Boolval{Boolval: &pg.Boolean{Boolval: b}}, Location: -1}}}
}

// fn calls a pg_catalog function: qualified, so that a same-named function
// earlier on the session's search_path cannot stand in for it.
func fn(name string, args ...*pg.Node) *pg.Node {
	return pg.MakeFuncCallNode([]*pg.Node{pg.MakeStrNode("pg_catalog"), pg.MakeStrNode(name)}, args, -1)
}

// op applies a pg_catalog operator: qualified (OPERATOR(pg_catalog.<=)),
// so that a same-named operator earlier on the session's search_path cannot
// stand in for it.
func op(name string, l, r *pg.Node) *pg.Node {
	return pg.MakeAExprNode(pg.A_Expr_Kind_AEXPR_OP, []*pg.Node{pg.MakeStrNode("pg_catalog"), pg.MakeStrNode(name)}, l, r, -1)
}

// cast builds arg::pg_catalog.typ (typ is the internal name: int8, bool,
// text).
func cast(arg *pg.Node, typ string) *pg.Node {
	return &pg.Node{Node: &pg.Node_TypeCast{TypeCast: &pg.TypeCast{
		Arg: arg,
		TypeName: &pg.TypeName{
			Names:   []*pg.Node{pg.MakeStrNode("pg_catalog"), pg.MakeStrNode(typ)},
			Typemod: -1,
		},
		Location: -1,
	}}}
}

// caseExpr builds CASE WHEN w0 THEN r0 WHEN w1 THEN r1 ... ELSE def END from
// whens = [w0, r0, w1, r1, ...]; def may be nil.
//
// Conditions that are the token form's constants (litBool) are folded: a
// false one's branch is left out, a true one's result becomes the ELSE and
// ends the list, and a CASE left with no branch is its ELSE.
func caseExpr(whens []*pg.Node, def *pg.Node) *pg.Node {
	args := make([]*pg.Node, 0, len(whens)/2)
	for i := 0; i+1 < len(whens); i += 2 {
		if v, ok := litValue(whens[i]); ok {
			if !v {
				continue
			}
			def = whens[i+1]
			break
		}
		args = append(args, pg.MakeCaseWhenNode(whens[i], whens[i+1], -1))
	}
	if len(args) == 0 {
		if def == nil {
			return aNull()
		}
		return def
	}
	n := pg.MakeCaseExprNode(nil, args, -1)
	n.GetCaseExpr().Defresult = def
	return n
}

func not(x *pg.Node) *pg.Node {
	if v, ok := litValue(x); ok {
		return litBool(!v)
	}
	return pg.MakeBoolExprNode(pg.BoolExprType_NOT_EXPR, []*pg.Node{x}, -1)
}

func isNotTrue(x *pg.Node) *pg.Node {
	return &pg.Node{Node: &pg.Node_BooleanTest{BooleanTest: &pg.BooleanTest{Arg: x, Booltesttype: pg.BoolTestType_IS_NOT_TRUE, Location: -1}}}
}

func isTrue(x *pg.Node) *pg.Node {
	if _, ok := litValue(x); ok {
		return x
	}
	return &pg.Node{Node: &pg.Node_BooleanTest{BooleanTest: &pg.BooleanTest{Arg: x, Booltesttype: pg.BoolTestType_IS_TRUE, Location: -1}}}
}

func or(x, y *pg.Node) *pg.Node {
	if v, ok := litValue(x); ok {
		if v {
			return x
		}
		return y
	}
	return pg.MakeBoolExprNode(pg.BoolExprType_OR_EXPR, []*pg.Node{x, y}, -1)
}

// and conjoins the non-nil args, flattening nested ANDs so the output reads
// like hand-written SQL. It returns nil when all args are nil.
func and(args ...*pg.Node) *pg.Node {
	var flat []*pg.Node
	for _, a := range args {
		if a == nil {
			continue
		}
		if b := a.GetBoolExpr(); b != nil && b.Boolop == pg.BoolExprType_AND_EXPR {
			flat = append(flat, b.Args...)
			continue
		}
		flat = append(flat, a)
	}
	switch len(flat) {
	case 0:
		return nil
	case 1:
		return flat[0]
	}
	return pg.MakeBoolExprNode(pg.BoolExprType_AND_EXPR, flat, -1)
}

func colRef(qual, name string) *pg.Node {
	return pg.MakeColumnRefNode([]*pg.Node{pg.MakeStrNode(qual), pg.MakeStrNode(name)}, -1)
}

func setTarget(name string, val *pg.Node) *pg.Node {
	return pg.MakeResTargetNodeWithNameAndVal(name, val, -1)
}

func cloneNode(n *pg.Node) *pg.Node {
	if n == nil {
		return nil
	}
	return proto.Clone(n).(*pg.Node)
}
