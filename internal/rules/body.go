package rules

import (
	"encoding/json"
	"fmt"
	"strings"
	"sync"

	"github.com/fenceproxy/fenceproxy/internal/sqllex"
	pg "github.com/pganalyze/pg_query_go/v6"
	"google.golang.org/protobuf/reflect/protoreflect"
)

// Stored code (a DO block, a function or procedure body) runs inside the
// server, where the proxy cannot fence its statements, so code that refers
// to a protected table is refused when it is created. The decision is made
// on the body as the parser delivers it (escapes and string continuations
// already processed), never on the client's raw text:
//
//   - LANGUAGE plpgsql: the body is compiled by pg_query's PL/pgSQL parser;
//     every embedded SQL statement and expression is parsed, and refused
//     when it names a protected table anywhere (a relation, a qualified
//     name), read or write. Every string constant in them is read as SQL
//     tokens too, since it may be run as dynamic SQL (EXECUTE, format(...),
//     or a variable assigned earlier): an identifier token naming a
//     protected table refuses the body.
//   - LANGUAGE sql (including BEGIN ATOMIC and RETURN bodies): the same on
//     its parsed statements.
//   - Other languages: the body is refused when a word in it spells a
//     protected table's name (ignoring ASCII case), or it contains "U&".
//
// Names are matched as PostgreSQL reads identifiers: unquoted folded to
// lower case, quoted exact, truncated to 63 bytes; a Unicode-escaped
// identifier (U&"...") or string (U&'...') can spell any name and refuses
// the body. Anything that cannot be compiled, parsed or scanned falls back
// to a stricter check, never to forwarding unseen.
//
// Stored code is also refused, where the session fences any table, when it
// can run a statement that reaches a table without naming it (DROP OWNED,
// REASSIGN OWNED, DROP or ALTER EXTENSION, DROP DATABASE, a DROP ...
// CASCADE: reachesUnnamed in ddl.go), since the function may run later,
// from any statement, where the proxy sees only its call:
//
//   - a statement the body's parse delivers (SQL bodies, every statement
//     and expression of a PL/pgSQL body) is judged by reachesUnnamed;
//   - text that may run as dynamic SQL (every string constant, at every
//     depth, after escape processing) and text that does not parse or
//     compile is judged on its words, taken together over the whole body
//     so that 'DROP ' || 'OWNED BY ' || r is seen: the word "owned", or
//     "drop" or "alter" with "cascade", "extension" or "database";
//   - bodies in other languages are judged on their words alike.
//
// The word rule refuses a few bodies that could not reach an unnamed
// table (a constant 'owned', a log message 'drop database ...'); it keeps
// to strings and unparsed text, so plain code is judged on its parse.
//
// What static analysis cannot see, and is therefore a documented limit:
// dynamic SQL whose table name is computed (concatenation such as
// 'UPDATE con' || 'fig', chr(), reading the name from a table or a
// parameter), code in other languages that builds the name, and functions
// created without the proxy.

// maxCodeDepth bounds the nesting of code in strings in code (EXECUTE of a
// string holding a DO block holding ...); deeper nesting is refused.
const maxCodeDepth = 16

// codeCheck collects the protected tables stored code refers to; a nil
// entry stands for "some table that cannot be named" (fail closed).
type codeCheck struct {
	r     *Rules
	found []*tableRule
	// reach is the first parsed statement that reaches unnamed tables;
	// seen gathers the words of dynamic or unparsed text (reachWord).
	reach *unnamedReach
	seen  reachWords
}

// reachWords are the words of the statements reachesUnnamed refuses, as
// bits.
type reachWords uint8

const (
	wordOwned     reachWords = 1 << iota // DROP OWNED, REASSIGN OWNED
	wordDropAlter                        // DROP ..., ALTER ...
	wordObject                           // CASCADE, EXTENSION, DATABASE
)

// reachWord returns the bit of word w (any ASCII case), 0 for others.
func reachWord(w string) reachWords {
	switch {
	case len(w) == 5 && hasPrefixFoldASCII(w, "owned"):
		return wordOwned
	case len(w) == 4 && hasPrefixFoldASCII(w, "drop"), len(w) == 5 && hasPrefixFoldASCII(w, "alter"):
		return wordDropAlter
	case len(w) == 7 && hasPrefixFoldASCII(w, "cascade"), len(w) == 9 && hasPrefixFoldASCII(w, "extension"),
		len(w) == 8 && hasPrefixFoldASCII(w, "database"):
		return wordObject
	}
	return 0
}

// reaches reports whether the words seen are those of a statement
// reachesUnnamed may refuse: "owned", or "drop" or "alter" with an object
// word.
func (w reachWords) reaches() bool {
	return w&wordOwned != 0 || w&(wordDropAlter|wordObject) == wordDropAlter|wordObject
}

// reachWordsIn adds the words of s (maximal runs of identifier bytes).
func (c *codeCheck) reachWordsIn(s string) {
	for i := 0; i < len(s); {
		if !sqllex.IsIdentCont(s[i]) {
			i++
			continue
		}
		j := i + 1
		for j < len(s) && sqllex.IsIdentCont(s[j]) {
			j++
		}
		c.seen |= reachWord(s[i:j])
		i = j
	}
}

// reaches returns how the code checked can reach a table it does not
// name, or nil.
func (c *codeCheck) reaches() *unnamedReach {
	if c.reach != nil {
		return c.reach
	}
	if c.seen.reaches() {
		return &unnamedReach{"dynamic SQL that may be DROP OWNED, REASSIGN OWNED, DROP or ALTER EXTENSION, DROP DATABASE or a DROP ... CASCADE",
			"its strings or unparsed text hold the words of those statements (\"owned\", or \"drop\" or \"alter\" with \"cascade\", \"extension\" or \"database\"), which drop or give away objects they do not name, possibly a protected table",
			"Create the code on a direct connection to PostgreSQL as a DBA."}
	}
	return nil
}

func (c *codeCheck) unknown() { c.found = append(c.found, nil) }

// name records the protected tables an identifier (already folded) may
// name: every protected table of that relation name, whatever its schema.
func (c *codeCheck) name(id string) {
	c.found = append(c.found, c.r.byRel[id]...)
}

// storedCode refuses a DO block or CREATE FUNCTION/PROCEDURE whose code
// refers to a protected table. kind names it in the refusal.
func (w *walker) storedCode(kind string, stmt protoreflect.ProtoMessage) {
	if w.err != nil {
		return
	}
	c := &codeCheck{r: w.r}
	c.stmt(stmt, 0)
	if u := c.reaches(); u != nil {
		if u.hint == hintCascade {
			u.hint = "Drop the dependent objects by name and use RESTRICT (the default), or create the code on a direct connection to PostgreSQL as a DBA."
		} else if u.hint == hintDirect {
			u.hint = "Create the code on a direct connection to PostgreSQL as a DBA."
		}
		if w.refuseUnnamed(u, kind) {
			return
		}
	}
	if len(c.found) == 0 {
		return
	}
	var named []*tableRule
	for _, t := range c.found {
		if t != nil {
			named = append(named, t)
		}
	}
	names := displays(named)
	w.refuseNames(c.found, names, fmt.Sprintf("fenceproxy: %s mentions %s; statements inside it cannot be fenced", kind, describeTables(names)),
		"fenceproxy rewrites the SQL it sees; it cannot rewrite statements run inside stored or anonymous code.",
		"Send the writes as plain statements through the proxy, or create the code without the proxy.")
}

// stmt checks a DoStmt or CreateFunctionStmt.
func (c *codeCheck) stmt(m protoreflect.ProtoMessage, depth int) {
	if depth > maxCodeDepth {
		c.unknown()
		return
	}
	var (
		opts   []*pg.Node
		lang   string
		bodies []string
		hasAs  bool
	)
	switch n := m.(type) {
	case *pg.DoStmt:
		opts, lang = n.Args, "plpgsql" // DO's default language
	case *pg.CreateFunctionStmt:
		opts = n.Options
		if n.SqlBody != nil {
			// BEGIN ATOMIC ... END or RETURN expr: parsed already.
			lang = "sql"
			c.tree(n.SqlBody.ProtoReflect(), depth)
		}
	default:
		return
	}
	for _, o := range opts {
		d := o.GetDefElem()
		if d == nil {
			continue
		}
		switch d.Defname {
		case "language":
			lang = d.Arg.GetString_().GetSval()
		case "as":
			hasAs = true
			if s := d.Arg.GetString_(); s != nil {
				bodies = append(bodies, s.Sval)
			}
			for _, item := range d.Arg.GetList().GetItems() {
				bodies = append(bodies, item.GetString_().GetSval())
			}
		}
	}
	if !hasAs {
		return
	}
	switch lang {
	case "plpgsql":
		c.plpgsql(m, bodies, depth)
	case "sql":
		for _, b := range bodies {
			c.sql(b, depth)
		}
	default:
		// Other languages (C, internal, plpython, ...): the proxy cannot
		// read their code; any word that spells a protected name, in any
		// ASCII case, refuses it.
		for _, b := range bodies {
			c.words(b)
		}
	}
}

// substring is the strictest check: every protected table whose name s
// contains, ignoring ASCII case, and "some table" when s contains U&.
func (c *codeCheck) substring(s string) {
	c.reachWordsIn(s)
	c.found = append(c.found, c.r.mentioned(s)...)
	if c.r.unicodeEscape(s) {
		c.unknown()
	}
}

// words records every protected table whose name appears in s as a word
// (a maximal run of identifier characters), ignoring ASCII case; a name
// with other characters counts as a substring. U& counts as any table.
func (c *codeCheck) words(s string) {
	c.reachWordsIn(s)
	ls := asciiLower(s)
	for _, t := range c.r.tables {
		n := asciiLower(t.rel)
		if !identWord(n) {
			if strings.Contains(ls, n) {
				c.found = append(c.found, t)
			}
			continue
		}
		for i := 0; ; {
			j := strings.Index(ls[i:], n)
			if j < 0 {
				break
			}
			j += i
			if (j == 0 || !sqllex.IsIdentCont(ls[j-1])) && (j+len(n) == len(ls) || !sqllex.IsIdentCont(ls[j+len(n)])) {
				c.found = append(c.found, t)
				break
			}
			i = j + 1
		}
	}
	if c.r.unicodeEscape(s) {
		c.unknown()
	}
}

func identWord(s string) bool {
	for i := 0; i < len(s); i++ {
		if !sqllex.IsIdentCont(s[i]) {
			return false
		}
	}
	return s != ""
}

// plpgsql compiles the PL/pgSQL body of stmt with pg_query and checks every
// SQL statement and expression in it. The statement is deparsed from its
// parse tree for the compiler, so the compiler reads the body the parser
// delivered. A body that does not compile is read as SQL tokens.
func (c *codeCheck) plpgsql(stmt protoreflect.ProtoMessage, bodies []string, depth int) {
	fallback := func() {
		for _, b := range bodies {
			c.text(b, depth)
		}
	}
	node := &pg.Node{}
	switch n := stmt.(type) {
	case *pg.DoStmt:
		node.Node = &pg.Node_DoStmt{DoStmt: n}
	case *pg.CreateFunctionStmt:
		node.Node = &pg.Node_CreateFunctionStmt{CreateFunctionStmt: n}
	}
	text, err := pg.Deparse(&pg.ParseResult{Version: parserVersion(), Stmts: []*pg.RawStmt{{Stmt: node}}})
	if err != nil {
		fallback()
		return
	}
	out, err := pg.ParsePlPgSqlToJSON(text)
	if err != nil {
		fallback()
		return
	}
	var funcs []any
	if err := json.Unmarshal([]byte(out), &funcs); err != nil || len(funcs) != 1 {
		fallback()
		return
	}
	c.plpgsqlJSON(funcs[0], depth)
}

var parserVersion = sync.OnceValue(func() int32 {
	res, err := pg.Parse("SELECT 1")
	if err != nil {
		return 0
	}
	return res.Version
})

// plpgsqlJSON visits a compiled PL/pgSQL function (pg_query's JSON form)
// and checks the query text of every PLpgSQL_expr: embedded statements,
// expressions, assignments, cursor queries, EXECUTE strings. Other strings
// (RAISE messages, declared type names, labels) are never run as SQL.
func (c *codeCheck) plpgsqlJSON(v any, depth int) {
	switch x := v.(type) {
	case map[string]any:
		for k, e := range x {
			if k == "PLpgSQL_expr" {
				m, _ := e.(map[string]any)
				q, _ := m["query"].(string)
				mode, _ := m["parseMode"].(float64)
				c.plExpr(q, int(mode), depth)
				continue
			}
			c.plpgsqlJSON(e, depth)
		}
	case []any:
		for _, e := range x {
			c.plpgsqlJSON(e, depth)
		}
	}
}

// plExpr checks the text of one PL/pgSQL expression, parsed in PL/pgSQL's
// raw parse mode (see RawParseMode in PostgreSQL's parser/parser.h).
func (c *codeCheck) plExpr(q string, mode int, depth int) {
	switch mode {
	case 0: // RAW_PARSE_DEFAULT: SQL statements
		c.sql(q, depth)
	case 2: // RAW_PARSE_PLPGSQL_EXPR: a SELECT target list and clauses
		c.sql("SELECT "+q, depth)
	case 3, 4, 5: // RAW_PARSE_PLPGSQL_ASSIGNn: target := expression
		sc, err := pg.Scan(q)
		if err != nil {
			c.text(q, depth)
			return
		}
		for _, tk := range sc.Tokens {
			if tk.Token == pg.Token_COLON_EQUALS || tk.Token == pg.Token_ASCII_61 {
				c.text(q[:tk.Start], depth) // the target: a variable, or fields of one
				c.sql("SELECT "+q[tk.End:], depth)
				return
			}
		}
		c.text(q, depth)
	default:
		c.text(q, depth)
	}
}

// sql checks SQL text: its parse tree when it parses, its tokens otherwise.
func (c *codeCheck) sql(s string, depth int) {
	tree, err := pg.Parse(s)
	if err != nil {
		c.text(s, depth)
		return
	}
	for _, raw := range tree.Stmts {
		c.tree(raw.ProtoReflect(), depth)
	}
}

// tree checks a parse tree: relations and qualified names naming a
// protected table, string constants read as SQL, nested stored code.
func (c *codeCheck) tree(m protoreflect.Message, depth int) {
	walkMessages(m, func(m protoreflect.Message) bool { return c.node(m, depth) })
}

// node checks one node of a tree for tree, and reports whether its
// children are still to be looked at.
func (c *codeCheck) node(m protoreflect.Message, depth int) bool {
	switch n := m.Interface().(type) {
	case *pg.RangeVar:
		c.found = append(c.found, c.r.relMatches(n.Schemaname, n.Relname)...)
		return false
	case *pg.A_Const:
		if s := n.GetSval(); s != nil {
			c.constant(s.Sval, depth)
		}
		return false
	case *pg.ColumnRef:
		// The last field is a column (or variable) name, never a table;
		// the ones before it may be.
		for i, f := range n.Fields {
			if s := f.GetString_(); s != nil && i < len(n.Fields)-1 {
				c.name(s.Sval)
			}
		}
		return false
	case *pg.String:
		// An element of a qualified name (DROP TABLE, a function or type
		// name, ...).
		c.name(n.Sval)
		return false
	case *pg.DoStmt, *pg.CreateFunctionStmt:
		c.stmt(n, depth+1)
		return false
	}
	if c.reach == nil && strings.HasSuffix(string(m.Descriptor().Name()), "Stmt") {
		c.reach = reachesUnnamed(m.Interface())
	}
	return true
}

// constant checks a string constant's value as SQL that may be executed
// dynamically. A constant with a backslash is also read with escape
// processing: code that runs with standard_conforming_strings off reads
// '...\x66...' that way.
func (c *codeCheck) constant(s string, depth int) {
	c.text(s, depth+1)
	if strings.Contains(s, `\`) {
		tree, err := pg.Parse("SELECT E'" + strings.ReplaceAll(s, "'", "''") + "'")
		if err != nil {
			c.substring(s)
			return
		}
		var esc *pg.String
		if len(tree.Stmts) == 1 {
			if sel := tree.Stmts[0].Stmt.GetSelectStmt(); sel != nil && len(sel.TargetList) == 1 {
				esc = sel.TargetList[0].GetResTarget().GetVal().GetAConst().GetSval()
			}
		}
		if esc == nil {
			c.substring(s)
			return
		}
		c.text(esc.Sval, depth+1)
	}
}

// text reads s as SQL tokens: every identifier or keyword that names a
// protected table counts, and every string constant is read the same way
// in turn. Text that does not scan gets the substring check.
func (c *codeCheck) text(s string, depth int) {
	if depth > maxCodeDepth {
		c.unknown()
		return
	}
	sc, err := pg.Scan(s)
	if err != nil {
		c.substring(s)
		return
	}
	for _, tk := range sc.Tokens {
		if tk.Start < 0 || tk.End > int32(len(s)) || tk.Start > tk.End {
			c.substring(s)
			return
		}
		raw := s[tk.Start:tk.End]
		switch {
		case tk.Token == pg.Token_UIDENT || tk.Token == pg.Token_USCONST:
			c.unknown() // U&"..." / U&'...' can spell any name
		case tk.Token == pg.Token_IDENT:
			c.name(foldIdent(raw))
		case tk.KeywordKind != pg.KeywordKind_NO_KEYWORD:
			c.seen |= reachWord(raw)
			// Unreserved and column-name keywords are valid table names
			// (a table may be called "data" or "configuration").
			c.name(truncIdent(asciiLower(raw)))
		case tk.Token == pg.Token_SCONST:
			v, ok := constValue(raw)
			if !ok {
				c.substring(raw)
				continue
			}
			c.constant(v, depth)
		}
	}
}

// constValue returns the value of a string constant token (with escapes
// and continuations processed), as the parser reads it.
func constValue(raw string) (string, bool) {
	tree, err := pg.Parse("SELECT " + raw)
	if err != nil || len(tree.Stmts) != 1 {
		return "", false
	}
	sel := tree.Stmts[0].Stmt.GetSelectStmt()
	if sel == nil || len(sel.TargetList) != 1 {
		return "", false
	}
	s := sel.TargetList[0].GetResTarget().GetVal().GetAConst().GetSval()
	if s == nil {
		return "", false
	}
	return s.Sval, true
}

// foldIdent returns the name an identifier token denotes: a quoted one
// without its quotes (doubled quotes undoubled), an unquoted one with ASCII
// letters lowered (PostgreSQL's downcase_identifier for a multibyte
// encoding), both truncated like the server does.
func foldIdent(raw string) string {
	if len(raw) >= 2 && raw[0] == '"' && raw[len(raw)-1] == '"' {
		return truncIdent(strings.ReplaceAll(raw[1:len(raw)-1], `""`, `"`))
	}
	return truncIdent(asciiLower(raw))
}

// truncIdent truncates an identifier to NAMEDATALEN-1 (63) bytes without
// splitting a UTF-8 character, as the server's scanner does.
func truncIdent(s string) string {
	const max = 63
	if len(s) <= max {
		return s
	}
	n := max
	for n > 0 && s[n]&0xC0 == 0x80 {
		n--
	}
	return s[:n]
}
