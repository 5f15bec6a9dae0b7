package rules

import (
	"bytes"
	"errors"
	"fmt"
	"sort"
	"strconv"
	"strings"
	"sync"

	pg "github.com/pganalyze/pg_query_go/v6"
	"github.com/pganalyze/pg_query_go/v6/parser"
	"google.golang.org/protobuf/encoding/protowire"
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
// The check is done in two parts, so that it costs about one more parse of
// the client's statement however many fragments it gets: each distinct
// fragment is parsed once on its own, as "SELECT (fragment)", and must give
// the node it was printed from; and the statement is parsed with every
// fragment replaced by a short placeholder, "(zqN)", and
// must give the rewritten tree with the same placeholders in the fragments'
// places. A parenthesised expression stands wherever a parenthesised name
// does, and both start and end with a token that cannot join its
// neighbours, so the two checks together prove the real text's tree.
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
	frags  map[string]*fragInfo
	prefix string // of the placeholders' names (choosePrefix)
	// copied: some fragment holds a copy of the client's text (a WHERE
	// clause repeated in a check, a value kept in a dead branch).
	copied  bool
	version int32 // of the parse tree, which the deparser checks
	err     error
	// The token form (tokenform.go): tokForm asks for it; twins are the
	// fencers' expressions paired with their token-form builds, tokHoles
	// the token's places in those builds; tokFail says it could not be
	// made, and the decision then has none.
	tokForm  bool
	twins    map[*pg.Node]*twin
	tokHoles []*pg.Node
	tokFail  bool
	// fencedTables are the tables (display names) the statement's
	// fencers fence: a token form may raise their stale rows with
	// fenceproxy.stale_at, whose error names no table.
	fencedTables []string
	// staleAt: the fencers' token forms call stale_at (Rules.StaleAt).
	staleAt bool
}

type scanTok struct {
	start, end int
	tok        pg.Token
	kind       pg.KeywordKind // NO_KEYWORD for names, literals, punctuation
}

type edit struct {
	start, end int // bytes of the client's text replaced (start == end: insertion)
	text       txt
	seq        int
}

// txt is text to insert, in three versions: the real one, sent to the
// server; the one checked against the tree, with placeholders for the
// fragments (see verify); and the token form's, the real one with the
// fragments' token-form prints (tokenform.go).
type txt struct{ real, check, tok string }

// lit is text that is the same in every version.
func lit(s string) txt { return txt{s, s, s} }

// cat joins texts.
func cat(parts ...txt) txt {
	var out txt
	for _, p := range parts {
		out.real += p.real
		out.check += p.check
		out.tok += p.tok
	}
	return out
}

// fragInfo is a rendered fragment: its text split at the holes, and the
// number of its placeholder.
type fragInfo struct {
	pieces []string
	// tokPieces are the token form's pieces, nil when they are pieces.
	tokPieces []string
	id        int
}

// texts returns the fragment's texts, check the checked one, with the
// client's texts in its holes.
func (f *fragInfo) texts(check string, clients ...string) txt {
	t := txt{real: fill(f.pieces, clients...), check: check}
	t.tok = t.real
	if f.tokPieces != nil {
		t.tok = fill(f.tokPieces, clients...)
	}
	return t
}

func newSplicer(sql string) (*splicer, error) {
	toks, err := scan(sql)
	if err != nil {
		return nil, err
	}
	return &splicer{sql: sql, toks: toks, frags: map[string]*fragInfo{}}, nil
}

// scan returns the tokens of sql, comments left out. It decodes the
// scanner's protobuf output directly into a compact slice: a large
// statement has tens of thousands of tokens, and a message per token would
// cost more than the scan itself.
func scan(sql string) ([]scanTok, error) {
	b, err := parser.ScanToProtobuf(sql)
	if err != nil {
		return nil, err
	}
	toks := make([]scanTok, 0, len(b)/6+16) // a token takes 6 to 12 bytes of the scanner's output
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return nil, errors.New("malformed scanner output")
		}
		b = b[n:]
		if num != 2 || typ != protowire.BytesType { // ScanResult.tokens
			if n = protowire.ConsumeFieldValue(num, typ, b); n < 0 {
				return nil, errors.New("malformed scanner output")
			}
			b = b[n:]
			continue
		}
		m, n := protowire.ConsumeBytes(b)
		if n < 0 {
			return nil, errors.New("malformed scanner output")
		}
		b = b[n:]
		var t scanTok
		for len(m) > 0 {
			num, typ, n := protowire.ConsumeTag(m)
			if n < 0 || typ != protowire.VarintType {
				return nil, errors.New("malformed scanner token")
			}
			m = m[n:]
			v, n := protowire.ConsumeVarint(m)
			if n < 0 {
				return nil, errors.New("malformed scanner token")
			}
			m = m[n:]
			switch num {
			case 1:
				t.start = int(v)
			case 2:
				t.end = int(v)
			case 4:
				t.tok = pg.Token(v)
			case 5:
				t.kind = pg.KeywordKind(v)
			}
		}
		if t.tok == pg.Token_SQL_COMMENT || t.tok == pg.Token_C_COMMENT {
			continue
		}
		toks = append(toks, t)
	}
	return toks, nil
}

// fail records the first reason the statement cannot be spliced.
func (s *splicer) fail(format string, args ...any) {
	if s.err == nil {
		s.err = fmt.Errorf(format, args...)
	}
}

func (s *splicer) insert(pos int, text txt) { s.replace(pos, pos, text) }

func (s *splicer) replace(start, end int, text txt) {
	if start < 0 || end < start || end > len(s.sql) {
		s.fail("edit %d..%d outside the statement", start, end)
		return
	}
	s.edits = append(s.edits, edit{start: start, end: end, text: text, seq: len(s.edits)})
}

// apply returns the client's text with the edits made, and the same with
// placeholders for the fragments (see verify).
func (s *splicer) apply() (out, check, tok string, err error) {
	if s.err != nil {
		return "", "", "", s.err
	}
	sort.SliceStable(s.edits, func(i, j int) bool {
		a, b := s.edits[i], s.edits[j]
		if a.start != b.start {
			return a.start < b.start
		}
		return a.seq < b.seq
	})
	n, m := len(s.sql), len(s.sql)
	for _, e := range s.edits {
		n += len(e.text.real) - (e.end - e.start)
		m += len(e.text.check) - (e.end - e.start)
	}
	var b, c, t strings.Builder
	b.Grow(n)
	c.Grow(m)
	pos := 0
	for _, e := range s.edits {
		if e.start < pos {
			return "", "", "", fmt.Errorf("overlapping edits at byte %d", e.start)
		}
		b.WriteString(s.sql[pos:e.start])
		b.WriteString(e.text.real)
		c.WriteString(s.sql[pos:e.start])
		c.WriteString(e.text.check)
		if s.tokForm {
			t.WriteString(s.sql[pos:e.start])
			t.WriteString(e.text.tok)
		}
		pos = e.end
	}
	b.WriteString(s.sql[pos:])
	c.WriteString(s.sql[pos:])
	if s.tokForm {
		t.WriteString(s.sql[pos:])
	}
	return b.String(), c.String(), t.String(), nil
}

// text returns the client's text of tokens i..j-1, to be copied into a
// fragment; copied records that it was.
func (s *splicer) text(i, j int) string {
	if i >= j {
		return ""
	}
	s.copied = true
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
// after AS or "." is never taken for a keyword (a column label or field
// name may be a reserved word), and neither is FROM after DISTINCT
// (IS [NOT] DISTINCT FROM).
func (s *splicer) level(i int, stop func(j int) bool) int {
	depth := 0
	for j := i; j < len(s.toks); j++ {
		t := s.toks[j].tok
		if j > i {
			// A word after AS or "." is a label or a field name, even a
			// reserved one (SELECT 1 AS end, r.case): no keyword there.
			if p := s.toks[j-1].tok; p == pg.Token_AS || p == pg.Token_ASCII_46 {
				continue
			}
		}
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

// placeholderName names the placeholder of fragment id in the checked text.
func (s *splicer) placeholderName(id int) string { return s.prefix + strconv.Itoa(id) }

// placeholderPrefixes are candidates for the placeholders' names: short,
// and rare in SQL.
var placeholderPrefixes = []string{"zq", "qz", "xq", "qx", "zx", "xz", "jq", "qj", "vq", "qv", "zj", "jz"}

// choosePrefix picks a placeholder prefix that no name of the client's
// statement starts with, so that a placeholder can only be one of the
// rewriter's: the checked text must then hold each of them exactly where
// the rewritten tree has it. A name spelled with Unicode escapes is only
// visible in the tree, which is searched too when the text has U&.
func (s *splicer) choosePrefix(tree *pg.ParseResult, escaped bool) {
	// Statements full of random text (encoded blobs) may hold every short
	// candidate; longer ones, base followed by "j"s, are then tried.
	for k := 0; k <= 6; k++ {
		for _, base := range placeholderPrefixes {
			p := base + strings.Repeat("j", k)
			if containsFoldASCII(s.sql, p) {
				continue
			}
			if escaped && treeHasNamePrefix(tree, p) {
				continue
			}
			s.prefix = p
			return
		}
	}
	s.fail("no placeholder name is free in this statement")
}

// treeHasNamePrefix reports whether a string in tree starts with p,
// ignoring ASCII case.
func treeHasNamePrefix(tree *pg.ParseResult, p string) bool {
	found := false
	walkMessages(tree.ProtoReflect(), func(m protoreflect.Message) bool {
		if found {
			return false
		}
		if str, ok := m.Interface().(*pg.String); ok && hasPrefixFoldASCII(str.Sval, p) {
			found = true
		}
		return !found
	})
	return found
}

// fragment returns the expression build makes, rendered (build is given
// hole(i) for the i-th hole), and checked on its own: "SELECT (text)" must
// parse into exactly that expression. It is cached under key, so the same
// key must always build the same expression.
func (s *splicer) fragment(key string, holes int, build func(h []*pg.Node) *pg.Node) *fragInfo {
	if f, ok := s.frags[key]; ok {
		return f
	}
	f := &fragInfo{pieces: make([]string, holes+1), id: len(s.frags)}
	s.frags[key] = f
	hs := make([]*pg.Node, holes)
	for i := range hs {
		hs[i] = hole(i)
	}
	node := build(hs)
	text, key, err := fragmentTextKey(s.version, node)
	if err != nil {
		s.fail("%v", err)
		return f
	}
	if s.tokForm && !s.tokFail && len(s.twins) > 0 {
		f.tokPieces = s.tokText(node, key, holes, text)
	}
	for i := 0; i < holes; i++ {
		k := strings.Index(text, holeName(i))
		if k < 0 {
			s.fail("fragment lost a hole")
			return f
		}
		f.pieces[i] = text[:k]
		text = text[k+len(holeName(i)):]
	}
	f.pieces[holes] = text
	return f
}

// fill joins fragment pieces with the client's texts, each parenthesised,
// and parenthesises the whole.
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

// selectOf wraps an expression in a SELECT statement.
func selectOf(n *pg.Node) *pg.ParseResult {
	return &pg.ParseResult{Stmts: []*pg.RawStmt{{Stmt: &pg.Node{Node: &pg.Node_SelectStmt{SelectStmt: &pg.SelectStmt{
		TargetList:  []*pg.Node{pg.MakeResTargetNodeWithVal(n, -1)},
		LimitOption: pg.LimitOption_LIMIT_OPTION_DEFAULT,
		Op:          pg.SetOperation_SETOP_NONE,
	}}}}}}
}

// checkFragment proves that text, parenthesised, is exactly node.
func checkFragment(version int32, node *pg.Node, text string) error {
	tree := selectOf(node)
	tree.Version = version
	return verify("SELECT ("+text+")", tree)
}

// deparseExpr prints one expression with the deparser, as the target of a
// SELECT.
func deparseExpr(version int32, n *pg.Node) (string, error) {
	tree := selectOf(n)
	tree.Version = version
	text, err := pg.Deparse(tree)
	if err != nil {
		return "", err
	}
	const prefix = "SELECT "
	if !strings.HasPrefix(text, prefix) {
		return "", fmt.Errorf("unexpected fragment print %.40q", text)
	}
	return text[len(prefix):], nil
}

// verify parses out and checks that it holds exactly the statements of
// tree, source positions aside.
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
	a, okA := canonical(make([]byte, 0, len(built)), built, md)
	b, okB := canonical(make([]byte, 0, len(back)), back, md)
	if !okA || !okB || !bytes.Equal(a, b) {
		return fmt.Errorf("the fence could not be inserted into the statement's text faithfully")
	}
	return nil
}

// fragmentText prints node and proves the print parses back into it
// (deparseExpr, checkFragment). Fragments repeat across statements (the
// same fence expressions for the same table), so proven prints are kept,
// keyed by an exact encoding of the node (fragmentKey, or else protobuf's):
// a hit skips a deparse and a parse.
func fragmentText(version int32, node *pg.Node) (string, error) {
	text, _, err := fragmentTextKey(version, node)
	return text, err
}

// fragmentTextKey is fragmentText, also returning the node's key ("" when
// it has none).
func fragmentTextKey(version int32, node *pg.Node) (text, key string, err error) {
	kb := strconv.AppendInt(make([]byte, 0, 512), int64(version), 10)
	if enc, ok := fragmentKey(append(kb, "|f|"...), node); ok {
		key = string(enc)
	} else if enc, err := (proto.MarshalOptions{Deterministic: true}).MarshalAppend(append(kb, "|p|"...), node); err == nil {
		key = string(enc)
	}
	if key != "" {
		if t, ok := provenFragments.get(key); ok {
			return t, key, nil
		}
	}
	text, err = deparseExpr(version, node)
	if err == nil {
		err = checkFragment(version, node, text)
	}
	if err != nil {
		return "", "", err
	}
	if key != "" {
		provenFragments.put(key, text)
	}
	return text, key, nil
}

// fragmentCache holds proven fragment prints; when full it starts over
// (the fence expressions of a configuration are few).
type fragmentCache struct {
	mu sync.RWMutex
	m  map[string]string
}

const maxProvenFragments = 4096

var provenFragments = &fragmentCache{m: make(map[string]string)}

func (c *fragmentCache) get(k string) (string, bool) {
	c.mu.RLock()
	defer c.mu.RUnlock()
	t, ok := c.m[k]
	return t, ok
}

func (c *fragmentCache) put(k, t string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if len(c.m) >= maxProvenFragments {
		c.m = make(map[string]string)
	}
	c.m[k] = t
}
