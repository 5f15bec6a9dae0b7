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
			pm, other := 0, 0
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

// ParseCost is how many times its size deciding a text that is parsed is
// charged for: what a long VALUES list of plain rows, the largest batch
// drivers and ORMs send, allocates while it is parsed, rewritten and
// proven (about 66 times; a long string about 10), rounded up. Long IN
// lists and texts of many small statements allocate more over their
// decision (up to about 200 and 1,600 times), mostly short-lived;
// max_check_bytes bounds those.
const ParseCost = 80

// DecisionCost returns the memory, in bytes, that deciding sql may hold
// while it is decided, for a text that may touch a protected table
// (MayTouch): a text over Config.MaxCheckBytes is decided in place,
// neither copied nor parsed (about its own size, rounded up); one at or
// under it is parsed (ParseCost times its size).
func (r *Rules) DecisionCost(sql string) int64 {
	if r.tooLarge(sql) {
		return int64(len(sql))
	}
	return ParseCost * int64(len(sql))
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
