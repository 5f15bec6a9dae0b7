package rules

import (
	"bytes"
	"fmt"
	"sort"
	"strconv"
	"strings"

	pg "github.com/pganalyze/pg_query_go/v6"
	"github.com/pganalyze/pg_query_go/v6/parser"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
)

// The rewriter never re-prints the client's statement. It sends the
// client's own bytes with the fence fragments inserted at token boundaries
// (docs/rewrite.md, "Splicing", explains why):
//
//   - every byte the client sent reaches the server unchanged, so string
//     literals, comments and identifiers are read by the server under the
//     session's own client_encoding and string settings exactly as they
//     would be without the proxy;
//   - the fragments are ASCII text printed from parse-tree nodes by the
//     deparser, wrapped in parentheses, so they cannot merge with the
//     client's tokens;
//   - the spliced text is parsed again and must give exactly the tree the
//     rewriter built (source positions aside); otherwise the statement is
//     refused. So a misplaced fragment can never reach the server.
//
// Positions come from PostgreSQL's own scanner (pg.Scan) and the parse
// tree's locations; nesting is followed with ( ) [ ] and CASE ... END.

// splicer collects the text edits of one SQL string.
type splicer struct {
	sql   string
	toks  []scanTok
	edits []edit
	// frags caches rendered fragments by key: an N-row INSERT renders its
	// stamp once, not N times.
	frags   map[string][]string
	version int32 // of the parse tree, which the deparser checks
	err     error
}

type scanTok struct {
	start, end int
	tok        pg.Token
}

type edit struct {
	start, end int // bytes of the client's text replaced (start == end: insertion)
	text       string
	seq        int
}

func newSplicer(sql string) (*splicer, error) {
	res, err := pg.Scan(sql)
	if err != nil {
		return nil, err
	}
	toks := make([]scanTok, 0, len(res.Tokens))
	for _, t := range res.Tokens {
		if t.Token == pg.Token_SQL_COMMENT || t.Token == pg.Token_C_COMMENT {
			continue
		}
		toks = append(toks, scanTok{start: int(t.Start), end: int(t.End), tok: t.Token})
	}
	return &splicer{sql: sql, toks: toks, frags: map[string][]string{}}, nil
}

// fail records the first reason the statement cannot be spliced.
func (s *splicer) fail(format string, args ...any) {
	if s.err == nil {
		s.err = fmt.Errorf(format, args...)
	}
}

func (s *splicer) insert(pos int, text string) { s.replace(pos, pos, text) }

func (s *splicer) replace(start, end int, text string) {
	if start < 0 || end < start || end > len(s.sql) {
		s.fail("edit %d..%d outside the statement", start, end)
		return
	}
	s.edits = append(s.edits, edit{start: start, end: end, text: text, seq: len(s.edits)})
}

// apply returns the client's text with the edits made.
func (s *splicer) apply() (string, error) {
	if s.err != nil {
		return "", s.err
	}
	sort.SliceStable(s.edits, func(i, j int) bool {
		a, b := s.edits[i], s.edits[j]
		if a.start != b.start {
			return a.start < b.start
		}
		return a.seq < b.seq
	})
	n := len(s.sql)
	for _, e := range s.edits {
		n += len(e.text) - (e.end - e.start)
	}
	var b strings.Builder
	b.Grow(n)
	pos := 0
	for _, e := range s.edits {
		if e.start < pos {
			return "", fmt.Errorf("overlapping edits at byte %d", e.start)
		}
		b.WriteString(s.sql[pos:e.start])
		b.WriteString(e.text)
		pos = e.end
	}
	b.WriteString(s.sql[pos:])
	return b.String(), nil
}

// text returns the client's text of tokens i..j-1.
func (s *splicer) text(i, j int) string {
	if i >= j {
		return ""
	}
	return s.sql[s.toks[i].start:s.toks[j-1].end]
}

// tokAt returns the index of the token that contains byte pos, or -1.
func (s *splicer) tokAt(pos int) int {
	i := sort.Search(len(s.toks), func(i int) bool { return s.toks[i].end > pos })
	if i < len(s.toks) && s.toks[i].start <= pos {
		return i
	}
	return -1
}

// nodeTok returns the index of the first token of the source text of n as
// far as its locations tell (the leftmost location in its subtree), or
// fails.
func (s *splicer) nodeTok(n proto.Message) int {
	loc := leftmost(n.ProtoReflect())
	if loc < 0 {
		s.fail("a node has no source position")
		return -1
	}
	i := s.tokAt(loc)
	if i < 0 {
		s.fail("no token at byte %d", loc)
	}
	return i
}

// leftmost returns the smallest location under m, or -1.
func leftmost(m protoreflect.Message) int {
	best := -1
	walkMessages(m, func(m protoreflect.Message) bool {
		fd := m.Descriptor().Fields().ByName("location")
		if fd != nil && fd.Kind() == protoreflect.Int32Kind {
			if l := int(m.Get(fd).Int()); l >= 0 && (best < 0 || l < best) {
				best = l
			}
		}
		return true
	})
	return best
}

// walkMessages calls f for m and every message under it, in pre-order,
// descending only where f returns true.
func walkMessages(m protoreflect.Message, f func(protoreflect.Message) bool) {
	if !m.IsValid() || !f(m) {
		return
	}
	m.Range(func(fd protoreflect.FieldDescriptor, v protoreflect.Value) bool {
		if fd.Message() == nil || fd.IsMap() {
			return true
		}
		if fd.IsList() {
			l := v.List()
			for i := 0; i < l.Len(); i++ {
				walkMessages(l.Get(i).Message(), f)
			}
		} else {
			walkMessages(v.Message(), f)
		}
		return true
	})
}

func opens(t pg.Token) bool {
	return t == pg.Token_ASCII_40 || t == pg.Token_ASCII_91 || t == pg.Token_CASE
}

func closes(t pg.Token) bool {
	return t == pg.Token_ASCII_41 || t == pg.Token_ASCII_93 || t == pg.Token_END_P
}

// level walks the tokens from index i at the nesting depth of token i and
// returns the index of the first token at that depth for which stop
// reports true, or of the token that ends the level: a closing token
// beyond it, or ";" at it; len(s.toks) at the end of the text. The token
// after AS is skipped (a column label may be a reserved word), and so is
// FROM after DISTINCT (IS [NOT] DISTINCT FROM).
func (s *splicer) level(i int, stop func(j int) bool) int {
	depth := 0
	for j := i; j < len(s.toks); j++ {
		t := s.toks[j].tok
		switch {
		case opens(t):
			depth++
			continue
		case closes(t):
			if depth == 0 {
				return j
			}
			depth--
			continue
		}
		if depth != 0 {
			continue
		}
		if t == pg.Token_ASCII_59 {
			return j
		}
		if t == pg.Token_FROM && j > 0 && s.toks[j-1].tok == pg.Token_DISTINCT {
			continue
		}
		if stop != nil && stop(j) {
			return j
		}
		if t == pg.Token_AS {
			j++
		}
	}
	return len(s.toks)
}

// is returns a stop function for level matching any of ts.
func (s *splicer) is(ts ...pg.Token) func(int) bool {
	return func(j int) bool {
		for _, t := range ts {
			if s.toks[j].tok == t {
				return true
			}
		}
		return false
	}
}

// endOf is the byte offset just after token j-1 (where text ending before
// token j can be appended without landing in a trailing comment).
func (s *splicer) endOf(j int) int {
	if j <= 0 {
		return 0
	}
	return s.toks[j-1].end
}

// groupItems splits the parenthesised group opened by token open (a "(")
// into its comma-separated items, as token ranges [a, b); it returns the
// index of the closing ")".
func (s *splicer) groupItems(open int) (items [][2]int, close int) {
	if open < 0 || open >= len(s.toks) || s.toks[open].tok != pg.Token_ASCII_40 {
		s.fail("expected ( at token %d", open)
		return nil, -1
	}
	a := open + 1
	for {
		j := s.level(a, s.is(pg.Token_ASCII_44))
		if j >= len(s.toks) || s.toks[j].tok == pg.Token_ASCII_59 {
			s.fail("unterminated group")
			return nil, -1
		}
		if a < j {
			items = append(items, [2]int{a, j})
		}
		if s.toks[j].tok != pg.Token_ASCII_44 {
			return items, j
		}
		a = j + 1
	}
}

// --- fragments ---

// holeName is the column name standing for the i-th piece of client text
// in a fragment.
func holeName(i int) string { return "fenceproxy_hole_" + strconv.Itoa(i) }

func hole(i int) *pg.Node { return pg.MakeColumnRefNode([]*pg.Node{pg.MakeStrNode(holeName(i))}, -1) }

// fragment returns the text of the expression build makes, split at its
// holes (build is given hole(i) for the i-th): len(pieces) = holes+1. The
// text is cached under key.
func (s *splicer) fragment(key string, holes int, build func(h []*pg.Node) *pg.Node) []string {
	if p, ok := s.frags[key]; ok {
		return p
	}
	hs := make([]*pg.Node, holes)
	for i := range hs {
		hs[i] = hole(i)
	}
	text, err := deparseExpr(s.version, build(hs))
	if err != nil {
		s.fail("%v", err)
		return make([]string, holes+1)
	}
	pieces := make([]string, 0, holes+1)
	for i := 0; i < holes; i++ {
		k := strings.Index(text, holeName(i))
		if k < 0 {
			s.fail("fragment lost a hole")
			return make([]string, holes+1)
		}
		pieces = append(pieces, text[:k])
		text = text[k+len(holeName(i)):]
	}
	pieces = append(pieces, text)
	s.frags[key] = pieces
	return pieces
}

// fill joins fragment pieces with the client's texts, each parenthesised.
func fill(pieces []string, texts ...string) string {
	var b strings.Builder
	b.WriteString("(")
	for i, p := range pieces {
		b.WriteString(p)
		if i < len(texts) {
			b.WriteString("(")
			b.WriteString(texts[i])
			b.WriteString(")")
		}
	}
	b.WriteString(")")
	return b.String()
}

// deparseExpr prints one expression with the deparser, as the target of a
// SELECT.
func deparseExpr(version int32, n *pg.Node) (string, error) {
	stmt := &pg.Node{Node: &pg.Node_SelectStmt{SelectStmt: &pg.SelectStmt{
		TargetList:  []*pg.Node{pg.MakeResTargetNodeWithVal(n, -1)},
		LimitOption: pg.LimitOption_LIMIT_OPTION_DEFAULT,
		Op:          pg.SetOperation_SETOP_NONE,
	}}}
	text, err := pg.Deparse(&pg.ParseResult{Version: version, Stmts: []*pg.RawStmt{{Stmt: stmt}}})
	if err != nil {
		return "", err
	}
	const prefix = "SELECT "
	if !strings.HasPrefix(text, prefix) {
		return "", fmt.Errorf("unexpected fragment print %.40q", text)
	}
	return text[len(prefix):], nil
}

// verify parses out, the spliced text, and checks that it holds exactly
// the statements of tree (as rewritten), source positions aside.
func verify(out string, tree *pg.ParseResult) error {
	back, err := parser.ParseToProtobuf(out)
	if err != nil {
		return fmt.Errorf("the rewritten statement does not parse: %v", err)
	}
	built, err := proto.Marshal(tree)
	if err != nil {
		return err
	}
	md := tree.ProtoReflect().Descriptor()
	a, okA := canonical(nil, built, md)
	b, okB := canonical(nil, back, md)
	if !okA || !okB || !bytes.Equal(a, b) {
		return fmt.Errorf("the fence could not be inserted into the statement's text faithfully")
	}
	return nil
}
