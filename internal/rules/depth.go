package rules

import (
	"fmt"
	"strings"

	"github.com/fenceproxy/fenceproxy/internal/sqllex"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/reflect/protoreflect"
)

// Deeply nested statements.
//
// libpg_query turns its parse tree into protobuf, and back for the
// deparser, with recursive C code that has no stack check, on the stack of
// whichever OS thread runs the cgo call: a tree nested deeply enough (for
// instance SELECT 1+1+…+1 with 24,000 terms on an 8 MB thread stack, 6,000
// on 2 MB) kills the whole process with SIGSEGV, which recover cannot
// catch. Nesting is not bounded by the grammar: left-associative chains
// (binary operators, casts, COLLATE, AT TIME ZONE, UNION, JOIN) nest one
// level per term. So the rules package never hands the parser a statement
// without first bounding its depth from the text (nestingEstimate). The
// deparser, which needs about five times the stack per level (protobuf-c's
// unpacker keeps a 1 KB array on the stack per message), only ever prints
// the fence fragments, small trees the rewriter builds itself, never the
// client's statement. The stack each step needs per protobuf nesting level
// was measured on x86-64: about 180 bytes to parse. The limit is chosen to
// hold with a margin of two on a 2 MB thread stack (what glibc gives
// threads under ulimit -s unlimited; the usual 8 MB gives a margin of
// eight) and to still hold, narrowly, on 1 MB.

// maxNestingEstimate bounds nestingEstimate. A statement whose estimate is
// this high has a parse tree at most about 2×maxNestingEstimate protobuf
// messages deep (TestNestingEstimateBoundsTree), which parses within
// 1 MB of stack. Real statements stay far below it: lists (IN lists,
// multi-row VALUES, select lists, AND/OR chains, CASE arms) are flat and
// cost one term's depth, not the sum of their terms.
const maxNestingEstimate = 2500

// bracketWeight is what an opening bracket (or CASE) adds to the estimate:
// a parenthesised subquery, a function call or a CASE adds up to six
// protobuf levels for one bracket token and a keyword.
const bracketWeight = 3

// nestingLevel is the state of nestingEstimate for one open bracket.
type nestingLevel struct {
	closer byte // ')', ']' or 'e' (CASE … END); 0 for the statement level
	base   int  // estimate where the bracket opened (outer depth + bracketWeight)
	chain  int  // set operations and joins at this level: they nest left-deep
	pmax   int  // largest finished piece at this level
	piece  int  // tokens in the current piece (since the last separator)
	hi     int  // highest closed bracket in the current piece, bracket included
	nots   int  // NOT keywords in the current piece
	max    int  // largest estimate seen at this level
}

// cur is the estimate at this level: its pieces may all sit under its set
// operations and joins, and every token of a piece may sit above its
// deepest bracket (left-associative operators after it).
func (l *nestingLevel) cur() int {
	return l.base + l.chain + max(l.pmax, l.piece+l.hi)
}

// endPiece finishes the current piece; the next one starts at start.
func (l *nestingLevel) endPiece(start int) {
	l.pmax = max(l.pmax, l.piece+l.hi)
	l.piece, l.hi, l.nots = start, 0, 0
}

// nestingEstimate returns a conservative estimate of how deeply the parse
// tree of sql nests, or a value above limit as soon as it exceeds limit.
// It reads the text once, from left to right, without recursion and with
// memory proportional to the bracket nesting (at most limit/bracketWeight
// levels), lexing like PostgreSQL's scanner as libpg_query configures it
// (standard_conforming_strings on): '…' strings without backslash escapes,
// E'…' with them, B'…', X'…', N'…', U&'…', "…" and U&"…" identifiers,
// $tag$…$tag$ strings, -- and nested /* */ comments. Those are skipped;
// where it is unsure, it reads more as code, never less, which can only
// raise the estimate.
//
// The estimate counts every token that can make a tree node (operators,
// keywords, identifiers; not literals or parameters), but resets at the
// separators of flat lists: commas, AND and OR (their operands are
// siblings under one BoolExpr), CASE's WHEN, THEN and ELSE, and between
// statements. A bracketed group counts as a token of its enclosing piece,
// so operators around it are still counted.
func nestingEstimate(sql string, limit int) int {
	var buf [16]nestingLevel
	e := nestingScan{limit: limit, levels: append(buf[:0], nestingLevel{})}
	for i := 0; i < len(sql); {
		c := sql[i]
		over := false
		switch {
		case c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v':
			i++
		case c == '-' && i+1 < len(sql) && sql[i+1] == '-':
			for i < len(sql) && sql[i] != '\n' && sql[i] != '\r' {
				i++
			}
		case c == '/' && i+1 < len(sql) && sql[i+1] == '*':
			i = sqllex.SkipBlockComment(sql, i)
		case c == '\'':
			i = sqllex.SkipQuoted(sql, i+1, '\'', false)
		case c == '"':
			i = sqllex.SkipQuoted(sql, i+1, '"', false)
			over = e.count(1)
		case c == '$':
			i = sqllex.SkipDollar(sql, i)
		case sqllex.IsIdentStart(c):
			j := i + 1
			for j < len(sql) && sqllex.IsIdentCont(sql[j]) {
				j++
			}
			word := sql[i:j]
			i = j
			if j < len(sql) && len(word) == 1 {
				// String prefixes: E'…' has backslash escapes; B, X, N
				// and U& strings end at the first lone quote.
				switch lowerASCII(word[0]) {
				case 'e':
					if sql[j] == '\'' {
						i = sqllex.SkipQuoted(sql, j+1, '\'', true)
						continue
					}
				case 'b', 'x', 'n':
					if sql[j] == '\'' {
						i = sqllex.SkipQuoted(sql, j+1, '\'', false)
						continue
					}
				case 'u':
					if sql[j] == '&' && j+1 < len(sql) && (sql[j+1] == '\'' || sql[j+1] == '"') {
						q := sql[j+1]
						i = sqllex.SkipQuoted(sql, j+2, q, false)
						if q == '"' {
							over = e.count(1)
						}
						break
					}
					over = e.word(word)
				default:
					over = e.word(word)
				}
			} else {
				over = e.word(word)
			}
		case c >= '0' && c <= '9' || c == '.' && i+1 < len(sql) && sql[i+1] >= '0' && sql[i+1] <= '9':
			// A number: a leaf. Letters and dots after it are taken
			// along (PostgreSQL rejects trailing junk).
			for i++; i < len(sql) && (sqllex.IsIdentCont(sql[i]) || sql[i] == '.'); i++ {
			}
		case c == '(':
			i++
			over = e.open(')')
		case c == '[':
			i++
			over = e.open(']')
		case c == ')' || c == ']':
			i++
			e.close(c)
		case c == ',':
			i++
			e.top().endPiece(0)
		case c == ';':
			i++
			t := e.top()
			t.endPiece(0)
			if len(e.levels) == 1 {
				// Statements are independent trees. (Inside brackets:
				// the statements of a rule action, siblings.)
				t.chain, t.pmax = 0, 0
			}
		case c == ':':
			i++
			if i < len(sql) && (sql[i] == ':' || sql[i] == '=') {
				i++
			}
			over = e.count(1)
		case c == '.':
			i++ // qualified names are flat lists
		case isOpChar(c):
			// One operator token, or several when PostgreSQL splits off
			// trailing + and -: at most one per + or -, plus one. It
			// ends where a comment starts.
			var pm, other int
			i, pm, other = operatorRun(sql, i)
			over = e.count(pm + other)
		default:
			i++
			over = e.count(1)
		}
		if over {
			break
		}
	}
	return e.best
}

// nestingScan is the state of nestingEstimate.
type nestingScan struct {
	limit  int
	best   int            // the estimate so far
	levels []nestingLevel // [0] is the statement level
}

func (e *nestingScan) top() *nestingLevel { return &e.levels[len(e.levels)-1] }

// count adds n tokens to the current piece and reports whether the
// estimate is over the limit.
func (e *nestingScan) count(n int) bool {
	t := e.top()
	t.piece += n
	c := t.cur()
	t.max = max(t.max, c)
	e.best = max(e.best, c)
	return e.best > e.limit
}

// open enters a bracket closed by closer ('e' for CASE … END).
func (e *nestingScan) open(closer byte) bool {
	t := e.top()
	b := t.base + t.chain + t.piece + bracketWeight
	e.best = max(e.best, b)
	if b > e.limit {
		return true
	}
	e.levels = append(e.levels, nestingLevel{closer: closer, base: b, max: b})
	return false
}

// close leaves the innermost bracket closed by closer, and the CASEs
// inside it; a closer nothing opened is ignored (the parser rejects it).
func (e *nestingScan) close(closer byte) {
	n := len(e.levels) - 1
	for n > 0 && e.levels[n].closer != closer {
		n--
	}
	if n == 0 {
		return
	}
	for len(e.levels) > n {
		c := e.levels[len(e.levels)-1]
		e.levels = e.levels[:len(e.levels)-1]
		p := e.top()
		// The closed bracket's height above where it opened. The group
		// also counts as a token of the enclosing piece: whatever
		// follows it may sit above it.
		p.hi = max(p.hi, c.max-c.base+bracketWeight)
		p.piece++
		v := p.cur()
		p.max = max(p.max, v)
		e.best = max(e.best, v)
	}
}

// word handles one identifier or keyword.
func (e *nestingScan) word(word string) bool {
	t := e.top()
	if len(word) > 9 {
		return e.count(1)
	}
	var lw [9]byte
	for k := 0; k < len(word); k++ {
		lw[k] = lowerASCII(word[k])
	}
	switch string(lw[:len(word)]) {
	case "and", "or":
		// Operands of AND and OR are siblings under one BoolExpr, one
		// level below an enclosing OR. The AND of BETWEEN … AND also
		// lands here: what sits above its upper bound is the BETWEEN,
		// the comparison or IS after it (counted in the new piece) and
		// the NOTs before it.
		t.endPiece(t.nots + 2)
		return e.count(0)
	case "union", "intersect", "except", "join":
		t.chain++
		t.endPiece(0)
		return e.count(0)
	case "case":
		return e.open('e')
	case "end":
		if t.closer == 'e' {
			e.close('e')
			return false
		}
	case "when", "then", "else":
		if t.closer == 'e' {
			t.endPiece(0)
			return e.count(0)
		}
	case "not":
		t.nots++
	}
	return e.count(1)
}

// isOpChar reports whether c may be part of an operator (op_chars in
// PostgreSQL's scan.l).
func isOpChar(c byte) bool {
	return strings.IndexByte("~!@#^&|`?+-*/%<>=", c) >= 0
}

// tooDeep is the refusal for a statement whose nesting estimate is over
// the limit, or that is larger than Config.MaxCheckBytes (refuseTooLarge),
// or nil when it is neither. A statement that names no
// protected relation (MayTouch fired on a schema name) is forwarded, and so
// is one that concerns only audit-mode tables, with the refusal recorded,
// like a statement that does not parse.
func (r *Rules) tooDeep(sql string) *Decision {
	if r.tooLarge(sql) {
		return r.refuseTooLarge(sql)
	}
	est := nestingEstimate(sql, maxNestingEstimate)
	if est <= maxNestingEstimate {
		return nil
	}
	tables := r.mentioned(sql)
	if len(tables) == 0 && !r.unicodeEscape(sql) {
		return &Decision{Action: Forward}
	}
	names := displays(tables)
	d := refuse(names,
		fmt.Sprintf("fenceproxy: statement nests too deeply for fenceproxy to check it for writes to %s", describeTables(names)),
		fmt.Sprintf("Its operators, brackets, set operations or joins nest more than %d levels deep (estimated from the text), and parsing it could exhaust the proxy's stack.", maxNestingEstimate),
		"Split long chains of operators, UNIONs or JOINs into lists (IN (...), multi-row VALUES, AND/OR) or into several statements, or nest fewer subqueries.")
	if allAudit(tables) && !r.unicodeEscape(sql) {
		d = Decision{Action: Forward, Tables: d.Tables, AuditRefusal: d.Err}
	}
	return &d
}

// tooLarge reports whether sql is larger than Config.MaxCheckBytes: if it
// may touch a protected table, it is refused (refuseTooLarge), not parsed.
func (r *Rules) tooLarge(sql string) bool {
	return r.maxCheck > 0 && len(sql) > r.maxCheck
}

// What deciding a text holds.
//
// Deciding a text at or under Config.MaxCheckBytes parses it with
// pg_query (its C parse tree, the protobuf-c tree and the packed protobuf,
// then the Go tree unmarshalled from it), rewrites it, splices the
// rewrite into the client's text and proves the splice by parsing it
// again while the first tree is still alive. What that holds at its peak
// follows the tree's nodes, so the tokens, not the bytes: a long IN list
// of one-digit numbers holds about 400 times its size, a RETURNING list
// of one-letter columns 800, a text of short fenced statements up to
// 3,100 (5,300 on a table in audit mode), a long string literal 10. So
// DecisionCost estimates from a scan of the text, lexed as PostgreSQL's
// scanner does as libpg_query configures it (like nestingEstimate),
// without allocating:
//
//	costFixed + costPerByte·bytes + costPerToken·tokens
//	  + costPerStatement·(statements) + costPerLight·(light statements)
//	  + costPerRow·(dropped rows) + costPerRowToken·(their tokens)
//
// times 3/2 when the set fences a table in audit mode (and the rows' part
// three times). A string literal, a quoted identifier, a comment or a
// dollar-quoted string is one token whatever its size (its bytes cost
// costPerByte), except in a text that may hold stored code (DO, FUNCTION,
// PROCEDURE), whose string bodies are parsed or scanned as code: there
// every run of identifier bytes and every other byte but white space,
// quoted or not, counts as a token. A light statement is one that starts
// with a word that cannot begin a write (SELECT, SET, BEGIN, …: nothing
// in it is rewritten). The rows of a long VALUES list that the values
// fast path drops (decideValuesFast) cost only what that path holds for
// them, when the text shows the path will take them: one VALUES list,
// of at least valuesFastMinRows rows of one width, from the second on
// plain (literals and parameters, signs, casts to common type names,
// DEFAULT), in a text that names no fence column and has no DELETE or
// MERGE (whose rewrites copy the client's text, which makes the fast
// path give up) and no U&; otherwise every row is parsed, and costs its
// tokens.
//
// The constants are the peak memory measured per unit, with a margin
// (TestDecisionCostCoversThePeak: the growth of the process's peak
// resident size over the decision, in a process of its own, with GOGC=10
// so that the heap holds little garbage beyond the live data; pg_query's
// C memory and the goroutine's stack included), at 60 KiB and 1 MiB, in
// the plain, ServerFunctions, Prepared and lock forms and audit mode:
//
//   - per token: up to 850 bytes (an operator chain 1+1+…+1; 800 a
//     RETURNING list, 510 an IN list of names, 410 of numbers, 730
//     VALUES rows whose fence values the client gives, in which every row
//     is parsed); 1,060 in audit mode;
//   - per statement: a short fenced statement 55 to 75 KB, its tokens
//     included (UPDATE config SET a = 1 WHERE id = 7; DELETE FROM
//     config), 100 to 115 KB in audit mode; a light one 2 to 3 KB beyond
//     its tokens;
//   - per dropped VALUES row: 400 to 620 bytes ((1), and (1, 'k', 2));
//     1,300 to 1,570 in audit mode;
//   - per byte: 8 to 13 for long literals, identifiers and dollar-quoted
//     strings at 1 MiB, 4 to 9 for comments (up to 15 at 60 KiB, with
//     the fixed part);
//   - fixed: 160 KB for the smallest fenced statement.
//
// The estimate is then at least 1.2 times every peak measured, and at
// most about twice it for bulk VALUES rows (95 times their size against
// 47), two to four times for IN lists, and 16 times their size for long
// literals (against 9). A text over Config.MaxCheckBytes is decided in place, neither
// copied nor parsed, for about its own size.
const (
	costFixed        = 256 << 10
	costPerByte      = 16
	costPerToken     = 1 << 10
	costPerStatement = 96 << 10
	costPerLight     = 8 << 10
	costPerRow       = 512
	costPerRowToken  = 64
)

// costUnrefined is the bound under which DecisionCost does not scan the
// text: a text at most that costly is not charged by the relay unless it
// is over 64 KiB (proxy.smallDecisionCharge), so a coarser bound does.
const costUnrefined = 4 << 20

// DecisionCost returns an upper bound of the memory, in bytes, that
// deciding sql holds at its peak, for a text that may touch a protected
// table (MayTouch); see costFixed. It allocates nothing, and reads the
// text once, or only counts its semicolons when the coarse bound that
// every byte is a token is under costUnrefined (texts of a few KiB). A
// text over Config.MaxCheckBytes costs its size: it is decided in place,
// neither copied nor parsed.
func (r *Rules) DecisionCost(sql string) int64 {
	if r.tooLarge(sql) {
		return int64(len(sql))
	}
	audit := false
	for _, t := range r.tables {
		audit = audit || t.audit
	}
	// Every token is at least a byte, every statement but the first ends
	// at a semicolon, and a dropped VALUES row costs less than its tokens.
	n := costFixed + (costPerByte+costPerToken)*int64(len(sql)) + costPerStatement*int64(strings.Count(sql, ";")+1)
	if audit {
		n += n / 2
	}
	if n <= costUnrefined {
		return n
	}
	c := scanCost(sql)
	if c.rows > 0 && (c.body || !r.valuesFastLikely(sql, &c)) {
		c.tokens += c.rowTokens
		c.rows, c.rowTokens = 0, 0
	}
	if c.body {
		c.tokens = max(c.tokens, rawTokens(sql))
	}
	n = costFixed + costPerByte*int64(len(sql)) + costPerToken*int64(c.tokens) +
		costPerStatement*int64(c.statements) + costPerLight*int64(c.light) +
		costPerRow*int64(c.rows) + costPerRowToken*int64(c.rowTokens)
	if audit {
		// Audit rewrites are larger; a dropped row's stamp about three
		// times.
		n += n/2 + costPerRow*3/2*int64(c.rows)
	}
	return n
}

// valuesFastLikely reports whether the values fast path will decide sql
// through its reduced statement, given the scan c found one long VALUES
// list of plain rows: the text is long enough, names no fence column
// (whose client values the rewrite keeps, copying them) and no DELETE or
// MERGE (whose conditions the rewrite repeats), has no U& escape (which
// may spell either) and no literal or comment that runs to its end.
func (r *Rules) valuesFastLikely(sql string, c *costInfo) bool {
	if len(sql) < valuesFastMinBytes || c.copies || c.open || strings.Contains(sql, "&") {
		return false
	}
	for _, t := range r.tables {
		if t.column != "" && (strings.IndexByte(t.column, '"') >= 0 || indexFoldASCII(sql, t.column) >= 0) {
			return false
		}
	}
	return true
}

// costInfo is what scanCost counts in a text.
type costInfo struct {
	tokens     int  // tokens, but for rowTokens
	rows       int  // rows the values fast path would drop
	rowTokens  int  // their tokens, the comma before each included
	statements int  // non-empty statements but the light ones
	light      int  // statements that cannot write: SELECT, SET, BEGIN, …
	body       bool // may hold stored code (DO, FUNCTION, PROCEDURE)
	copies     bool // DELETE or MERGE: the fast path may give up
	open       bool // a literal, identifier or comment runs to the end
}

// valuesScan follows the first VALUES list of a text for scanCost.
type valuesScan struct {
	state int8 // vsNone, …
	item  int8 // itemStart, … within a row
	depth int  // bracket depth of the VALUES keyword
	rows  int  // rows seen, the current one included
	width int  // items of row 1 (the second row)
	items int  // items of the current row so far
	plain bool // rows from 1 on, the current one included, are plain
	row   int  // tokens of the current row, its leading comma included
	drop  int  // tokens of rows 2 and on
	lists int  // VALUES keywords seen
}

const (
	vsNone      = iota // no list yet
	vsRow              // expecting "(" of a row
	vsIn               // inside a row
	vsAfter            // after a row's ")": a comma continues the list
	vsEnded            // the list has ended
	itemStart   = iota // (item states) expecting signs, a literal or DEFAULT
	itemLiteral        // after a literal: "::", "," or ")"
	itemCast           // after "::": a type name
	itemDefault        // after DEFAULT: "," or ")"
)

// scanCost counts sql's tokens and statements for DecisionCost, lexing as
// nestingEstimate does, and finds the first VALUES list's rows.
func scanCost(sql string) costInfo {
	var c costInfo
	v := valuesScan{state: vsNone}
	depth := 0
	stmtOpen := false
	for i := 0; i < len(sql); {
		ch := sql[i]
		start := i
		n := 1 // tokens this step
		kind := byte(0)
		var word string
		switch {
		case ch == ' ' || ch == '\t' || ch == '\n' || ch == '\r' || ch == '\f' || ch == '\v':
			i++
			continue
		case ch == '-' && i+1 < len(sql) && sql[i+1] == '-':
			i = sqllex.SkipLineComment(sql, i)
			continue
		case ch == '/' && i+1 < len(sql) && sql[i+1] == '*':
			i = sqllex.SkipBlockComment(sql, i)
			c.open = c.open || i == len(sql)
			continue
		case ch == '\'':
			i = sqllex.SkipQuoted(sql, i+1, '\'', false)
			kind = 's'
		case ch == '"':
			i = sqllex.SkipQuoted(sql, i+1, '"', false)
		case ch == '$':
			i = sqllex.SkipDollar(sql, i)
			kind = 's'
			if i > start+1 && sql[start+1] >= '0' && sql[start+1] <= '9' {
				kind = 'p'
				for k := start + 1; k < i; k++ {
					if sql[k] < '0' || sql[k] > '9' {
						kind = 0
					}
				}
			} else if i == start+1 {
				kind = 0
			}
		case sqllex.IsIdentStart(ch):
			j := i + 1
			for j < len(sql) && sqllex.IsIdentCont(sql[j]) {
				j++
			}
			word = sql[i:j]
			i = j
			kind = 'w'
			if j < len(sql) && len(word) == 1 {
				switch lowerASCII(word[0]) {
				case 'e':
					if sql[j] == '\'' {
						i = sqllex.SkipQuoted(sql, j+1, '\'', true)
						kind = 's'
						if strings.IndexByte(sql[j:i], '\\') >= 0 {
							kind = 0 // escapes the scanner may reject
						}
					}
				case 'b', 'x':
					if sql[j] == '\'' {
						i = sqllex.SkipQuoted(sql, j+1, '\'', false)
						kind = 's'
					}
				case 'n':
					if sql[j] == '\'' {
						i = sqllex.SkipQuoted(sql, j+1, '\'', false)
						kind = 0
					}
				case 'u':
					if sql[j] == '&' && j+1 < len(sql) && (sql[j+1] == '\'' || sql[j+1] == '"') {
						i = sqllex.SkipQuoted(sql, j+2, sql[j+1], false)
						kind = 0
					}
				}
			}
		case ch >= '0' && ch <= '9' || ch == '.' && i+1 < len(sql) && sql[i+1] >= '0' && sql[i+1] <= '9':
			kind = 'n'
			dots := 0
			for ; i < len(sql) && (sqllex.IsIdentCont(sql[i]) || sql[i] == '.'); i++ {
				switch {
				case sql[i] == '.':
					dots++
				case sql[i] < '0' || sql[i] > '9':
					kind = 0 // 1e5, 0x1F, 1_000: plain to PostgreSQL, not here
				}
			}
			if dots > 1 {
				kind = 0
			}
		case ch == ':':
			i++
			kind = ':'
			if i < len(sql) && (sql[i] == ':' || sql[i] == '=') {
				if sql[i] == '=' {
					kind = 0
				}
				i++
			} else {
				kind = 0
			}
		case isOpChar(ch):
			// As nestingEstimate: an operator may split at each + or -.
			var pm, other int
			i, pm, other = operatorRun(sql, i)
			n = pm + other
			if i == start+1 && pm == 1 {
				kind = '+'
			}
		default:
			// ( ) [ ] , ; . and any other byte: one token each.
			i++
			kind = ch
		}
		if i == len(sql) && (sql[start] == '\'' || sql[start] == '"' || sql[start] == '$' || i > start+1 && (sql[start+1] == '\'' || sql[start+1] == '&')) {
			c.open = true // a literal or identifier that may run to the end
		}
		if kind == ';' {
			stmtOpen = false
			c.tokens++
			v.step(kind, "", depth)
			continue
		}
		if !stmtOpen {
			stmtOpen = true
			switch {
			case kind == 'w' && lightStatement(word):
				c.light++
			default:
				c.statements++
			}
			if kind == 'w' && equalFoldASCII(word, "do") {
				c.body = true
			}
		}
		if kind == 'w' {
			switch {
			case equalFoldASCII(word, "function"), equalFoldASCII(word, "procedure"):
				c.body = true
			case equalFoldASCII(word, "delete"), equalFoldASCII(word, "merge"):
				c.copies = true
			}
		}
		c.tokens += n
		if v.state != vsEnded || kind == 'w' {
			v.step(kind, word, depth)
		}
		switch kind {
		case '(', '[':
			depth++
		case ')', ']':
			depth = max(depth-1, 0)
		}
	}
	if v.state == vsIn || v.state == vsRow {
		v.end()
	}
	if v.state == vsAfter {
		v.end()
	}
	if v.lists == 1 && v.rows >= valuesFastMinRows && v.plain {
		c.tokens -= v.drop
		c.rows, c.rowTokens = v.rows-2, v.drop
	}
	return c
}

// end finishes the first list.
func (v *valuesScan) end() {
	if v.state == vsIn || v.state == vsRow && v.rows > 0 {
		// A row left open, or a comma with no row after it.
		v.plain = false
	}
	v.state = vsEnded
}

// step takes one token (kind as scanCost classifies it, word for a word)
// at bracket depth depth, before depth changes for it.
func (v *valuesScan) step(kind byte, word string, depth int) {
	if kind == 'w' && equalFoldASCII(word, "values") {
		v.lists++
		if v.lists == 1 {
			v.state, v.depth, v.plain = vsRow, depth, true
		}
		return
	}
	switch v.state {
	case vsRow:
		if kind != '(' {
			v.end()
			return
		}
		v.state, v.item, v.items = vsIn, itemStart, 0
		v.row++
		v.rows++
	case vsIn:
		v.row++
		if kind == ')' && depth == v.depth+1 {
			if v.item == itemLiteral || v.item == itemDefault {
				v.items++
			} else {
				v.notPlain()
			}
			if v.rows == 2 {
				v.width = v.items
			} else if v.rows > 2 && v.items != v.width {
				v.notPlain()
			}
			if v.rows > 2 {
				v.drop += v.row
			}
			v.row = 0
			v.state = vsAfter
			return
		}
		if depth != v.depth+1 {
			v.notPlain()
			return
		}
		switch {
		case kind == '(' || kind == '[':
			v.notPlain()
		case v.item == itemStart && kind == '+':
		case v.item == itemStart && (kind == 's' || kind == 'n' || kind == 'p'):
			v.item = itemLiteral
		case v.item == itemStart && kind == 'w' && (equalFoldASCII(word, "null") || equalFoldASCII(word, "true") || equalFoldASCII(word, "false")):
			v.item = itemLiteral
		case v.item == itemStart && kind == 'w' && equalFoldASCII(word, "default"):
			v.item = itemDefault
		case v.item == itemLiteral && kind == ':':
			v.item = itemCast
		case v.item == itemCast && kind == 'w' && plainTypeWord(word):
			v.item = itemLiteral
		case (v.item == itemLiteral || v.item == itemDefault) && kind == ',':
			v.items++
			v.item = itemStart
		default:
			v.notPlain()
		}
	case vsAfter:
		if kind == ',' {
			v.row = 1
			v.state = vsRow
			return
		}
		v.end()
	}
}

// notPlain records that the current row is not plain (which matters
// from row 1 on).
func (v *valuesScan) notPlain() {
	if v.rows >= 2 {
		v.plain = false
	}
	v.item = -1 // nothing more makes this row plain
}

// plainTypeWord reports whether word is one of the one-word type names a
// plain VALUES item may be cast to here: names PostgreSQL's scanner gives
// as an identifier, an unreserved or a column-name keyword (typeWord).
func plainTypeWord(word string) bool {
	if len(word) > 11 {
		return false
	}
	var lw [11]byte
	for k := 0; k < len(word); k++ {
		lw[k] = lowerASCII(word[k])
	}
	switch string(lw[:len(word)]) {
	case "int", "int2", "int4", "int8", "integer", "smallint", "bigint", "numeric", "decimal", "real", "float", "float4", "float8",
		"text", "varchar", "bool", "boolean", "date", "time", "timestamp", "timestamptz", "uuid", "json", "jsonb", "bytea":
		return true
	}
	return false
}

// lightStatement reports whether a statement that starts with word
// cannot write a table (nothing in it is rewritten): its decision holds a
// few kilobytes beyond its tokens, not the tens a fenced write does.
func lightStatement(word string) bool {
	if len(word) > 9 {
		return false
	}
	var lw [9]byte
	for k := 0; k < len(word); k++ {
		lw[k] = lowerASCII(word[k])
	}
	switch string(lw[:len(word)]) {
	case "select", "values", "table", "set", "show", "reset", "begin", "start", "commit", "end", "rollback", "abort", "savepoint", "release":
		return true
	}
	return false
}

// equalFoldASCII reports whether word is lower, ASCII case ignored.
func equalFoldASCII(word, lower string) bool {
	return len(word) == len(lower) && hasPrefixFoldASCII(word, lower)
}

// rawTokens counts the tokens of sql as if no byte were quoted or in a
// comment: each run of identifier bytes and each other byte that is not
// white space. Stored code's strings are parsed or scanned as code.
func rawTokens(sql string) int {
	n := 0
	word := false
	for i := 0; i < len(sql); i++ {
		c := sql[i]
		switch {
		case sqllex.IsIdentCont(c):
			if !word {
				n++
			}
			word = true
		case c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v':
			word = false
		default:
			n++
			word = false
		}
	}
	return n
}

// refuseTooLarge refuses a statement larger than Config.MaxCheckBytes that
// may touch a protected table: parsing and rewriting it would take memory
// in proportion to its size, many times over. The tables it names are
// found as in a statement that does not parse, without a copy of the text;
// the decision refers to none of its bytes (Decide does not copy it).
func (r *Rules) refuseTooLarge(sql string) *Decision {
	tables := r.mentioned(sql)
	if len(tables) == 0 && !r.unicodeEscape(sql) {
		return &Decision{Action: Forward}
	}
	names := displays(tables)
	d := refuse(names,
		fmt.Sprintf("fenceproxy: statement of %d bytes is too large for fenceproxy to check it for writes to %s", len(sql), describeTables(names)),
		fmt.Sprintf("fenceproxy checks statements that may touch a protected table up to %d bytes (max_check_bytes).", r.maxCheck),
		"Send the rows in several smaller statements, or raise max_check_bytes.")
	if allAudit(tables) && !r.unicodeEscape(sql) {
		d = Decision{Action: Forward, Tables: d.Tables, AuditRefusal: d.Err}
	}
	return &d
}

// protoDepth returns the nesting depth of the protobuf message b of type md:
// 1 for a message without message fields. It reports -1 for malformed
// input. Its recursion is Go's, whose stacks grow as needed.
func protoDepth(b []byte, md protoreflect.MessageDescriptor) int {
	fields := md.Fields()
	depth := 1
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return -1
		}
		b = b[n:]
		if typ == protowire.BytesType {
			v, n := protowire.ConsumeBytes(b)
			if n < 0 {
				return -1
			}
			b = b[n:]
			if fd := fields.ByNumber(num); fd != nil && fd.Kind() == protoreflect.MessageKind {
				d := protoDepth(v, fd.Message())
				if d < 0 {
					return -1
				}
				depth = max(depth, d+1)
			}
			continue
		}
		n = protowire.ConsumeFieldValue(num, typ, b)
		if n < 0 {
			return -1
		}
		b = b[n:]
	}
	return depth
}

// operatorRun reads the run of operator characters at sql[i:], up to the
// start of a comment, and returns where it ends, how many of its
// characters are + or - (PostgreSQL may split a token off at each), and
// 1 if it has any other character, else 0.
func operatorRun(sql string, i int) (end, pm, other int) {
	for i < len(sql) && isOpChar(sql[i]) {
		if i+1 < len(sql) && (sql[i] == '-' && sql[i+1] == '-' || sql[i] == '/' && sql[i+1] == '*') {
			break
		}
		if sql[i] == '+' || sql[i] == '-' {
			pm++
		} else {
			other = 1
		}
		i++
	}
	return i, pm, other
}
