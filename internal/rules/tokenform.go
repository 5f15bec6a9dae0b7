package rules

import (
	"errors"
	"strconv"
	"strings"
	"sync"

	pg "github.com/pganalyze/pg_query_go/v6"
	"google.golang.org/protobuf/reflect/protoreflect"
)

// The token form of a rewrite is the same statement with the session's
// token written into it as a constant, where the rewrite reads it from the
// setting: the proxy knows the token (it keeps the session's record and
// applies it, transaction-locally, before every fenced statement), so the
// server need not read, validate and cast it for every fence. With a valid
// token, the checks that only an invalid one fails fall away, and so do
// the raisers' calls that exist for it: an UPDATE's fence is then
//
//	CASE WHEN F <= '<token>'::bigint THEN '<token>'::bigint ELSE fenceproxy.stale(...) END
//
// which costs the server about what the hand-written conditional UPDATE
// does. The stale branch still reads the setting for its message: the
// applied value is the token.
//
// Every fence expression can be built a second time by the same code
// (fencer.dual), with the token's validity a constant true (folded by the
// constructors) and the token a placeholder string, tokHoleName, cast to
// bigint. Each fragment is printed a second time with the token-form
// expressions in place (tokText; a print already proven for the same
// expression is reused, and then nothing is built), its placeholders found with PostgreSQL's own scanner and
// the print proven, with a constant in their places, to parse into the
// expression it stands for. The placeholders' contents are then NUL
// bytes, which no statement text can hold, and Decision.Tok keeps the
// statement split at them. A WHERE conjunct that folded to true is left
// out (addConds). The fragments take the same places as the real form's, which verify
// proves for both (the checked text has placeholders for the fragments).
//
// A relay may send the token form only where the record is what the
// statement would read: a simple Query sent with the session's values
// applied in front of it, whose text changes no fence setting, in a
// session whose token is valid (CanonicalToken). The decision has a token
// form only when every statement of the text runs at once (INSERT, UPDATE,
// DELETE, MERGE, SELECT and transaction commands): a PREPARE's, a rule's or
// a function's body would keep the constant for later runs.
//
// A named statement cannot hold the token as a constant: the server keeps
// it, and stored code can run it by name (EXECUTE inside a function) after
// the session's token changed, where no relay sees the run. (Guarding each
// fence with the setting was measured and cost more than reading it.) Its
// token is a parameter instead (ParamText): the token's places become
// $k::bigint, k after every parameter the statement has, and the relay
// binds the session's token at every Bind. Stored code running it by name
// must then give a token itself, which the proxy cannot forge for it.

// tokHoleName is the token's placeholder in a token-form print. A text
// that holds it (in any case) gets no token form; a configured name that
// is it fails the proof (proveTokText), and the decision has none.
const tokHoleName = "fenceproxy_token_hole"

// TokenForm is a rewritten text in its token form.
type TokenForm struct {
	// real is the decided text (Decision.SQL) it is the token form of.
	real string
	// pieces are the token form's text split at the token's places.
	pieces []string
	size   int
	// staleTable is the table whose stale rows the form's calls of
	// fenceproxy.stale_at are for, "" when it has none.
	staleTable string
	// param is the parameter form (ParamText), made and proven once.
	param    sync.Once
	paramPcs []string // the pieces without the quotes of the token's constant
	paramMax int      // the highest parameter number the text refers to
	paramOK  bool
}

// StaleTable returns the table (display name) that the form's stale-row
// errors are for, "" when its errors name their table. A StaleAt set's
// token form raises a stale row's error with the watermark alone
// (fenceproxy:stale_at:<watermark>, FP001); the relay that sends the form
// knows the token it filled in and this table, and gives both to
// ExpandStaleAt for the error that comes back. A statement whose stale
// rows may be of several tables gets no token form in such a set.
func (t *TokenForm) StaleTable() string {
	if t == nil {
		return ""
	}
	return t.staleTable
}

// Fill returns sent, a text that ends with the decided text (the relay may
// have put a registration or the session's values in front of it), with
// that end in its token form for token, a canonical token
// (CanonicalToken). It returns false when sent does not end so, or when
// token is not canonical.
func (t *TokenForm) Fill(sent, token string) (string, bool) {
	n, ok := t.FilledLen(sent, token)
	if !ok {
		return "", false
	}
	var b strings.Builder
	b.Grow(n)
	t.FillTo(&b, sent, token)
	return b.String(), true
}

// FilledLen returns the length of what Fill returns for sent and token,
// and false where Fill returns false.
func (t *TokenForm) FilledLen(sent, token string) (int, bool) {
	if t == nil || !strings.HasSuffix(sent, t.real) {
		return 0, false
	}
	// The token goes between quotes: only canonical digits may.
	if c, ok := CanonicalToken(token); !ok || c != token {
		return 0, false
	}
	return len(sent) - len(t.real) + t.size + len(token)*(len(t.pieces)-1), true
}

// FillTo writes to b what Fill returns, for sent and token for which
// FilledLen reports true: callers that build a larger text around it
// spare the copy.
func (t *TokenForm) FillTo(b *strings.Builder, sent, token string) {
	b.WriteString(sent[:len(sent)-len(t.real)])
	for i, p := range t.pieces {
		if i > 0 {
			b.WriteString(token)
		}
		b.WriteString(p)
	}
}

// MaxParams is the most parameters a prepared statement may have: the
// protocol counts them in 16 bits.
const MaxParams = 65535

// ParamText returns the token form with the token a parameter of the
// statement, $k, in place of the constant, for a relay that binds the
// session's token as the statement's last parameter at every Bind: the
// parameter form of a Parse message, which the server analyses once and
// executes with whatever token each Bind supplies, so that nothing of one
// token stays in the statement. declared is the number of parameter types
// the Parse declares; k is one more than the statement's own parameters
// (the declared ones and those its text refers to). It returns false when
// the form has no parameter form: k would be over MaxParams, or the print
// could not be proven to take a parameter where it takes the constant.
//
// The relay must bind only a canonical token (CanonicalToken) as $k, of
// type bigint, and strip $k from what it reports of the statement's
// parameters: the statement is otherwise the token form, which is right
// for a valid token alone.
func (t *TokenForm) ParamText(declared int) (text string, k int, ok bool) {
	if t == nil {
		return "", 0, false
	}
	t.param.Do(t.proveParam)
	if !t.paramOK {
		return "", 0, false
	}
	k = max(declared, t.paramMax) + 1
	if k > MaxParams {
		return "", 0, false
	}
	return strings.Join(t.paramPcs, "$"+strconv.Itoa(k)), k, true
}

// proveParam makes the parameter form's pieces: each place of the token
// is a string constant, '<token>', which a parameter replaces as one
// token of the grammar for another. The print, with the parameter one
// number above the text's own, must parse into one statement that refers
// to that number exactly at the token's places, and to no other number
// above the text's own.
func (t *TokenForm) proveParam() {
	n := len(t.pieces)
	if n < 2 {
		return
	}
	pcs := make([]string, n)
	for i, p := range t.pieces {
		if i > 0 {
			if !strings.HasPrefix(p, "'") {
				return
			}
			p = p[1:]
		}
		if i < n-1 {
			if !strings.HasSuffix(p, "'") {
				return
			}
			p = p[:len(p)-1]
			// A letter, digit, underscore, & or $ before the quote would
			// make it another kind of constant (B'', X'', E'', U&'') or
			// join the parameter to the word before it.
			if j := len(p) - 1; j >= 0 {
				switch c := p[j]; {
				case c == '_' || c == '&' || c == '$' || c >= '0' && c <= '9' || c|0x20 >= 'a' && c|0x20 <= 'z' || c >= 0x80:
					return
				}
			}
		}
		pcs[i] = p
	}
	real, err := pg.Parse(t.real)
	if err != nil || len(real.Stmts) != 1 {
		return
	}
	m, _ := paramRefs(real, 0)
	if m >= MaxParams {
		return
	}
	got, err := pg.Parse(strings.Join(pcs, "$"+strconv.Itoa(m+1)))
	if err != nil || len(got.Stmts) != 1 {
		return
	}
	if top, at := paramRefs(got, m+1); top != m+1 || at != n-1 {
		return
	}
	t.paramPcs, t.paramMax, t.paramOK = pcs, m, true
}

// paramRefs returns the highest parameter number tree refers to and how
// many of its references are to number k.
func paramRefs(tree *pg.ParseResult, k int) (top, at int) {
	walkMessages(tree.ProtoReflect(), func(m protoreflect.Message) bool {
		if p, ok := m.Interface().(*pg.ParamRef); ok {
			top = max(top, int(p.Number))
			if int(p.Number) == k {
				at++
			}
		}
		return true
	})
	return top, at
}

// newTokenForm splits tok, the token form of real with NUL bytes in the
// token's places; nil when there are none. With staleAt, stale rows' errors
// name no table: there is a form only for a statement that fences one
// table or none (tables, those its fencers fence).
func newTokenForm(real, tok string, staleAt bool, tables []string) *TokenForm {
	if strings.IndexByte(tok, 0) < 0 {
		return nil
	}
	t := &TokenForm{real: real}
	if staleAt {
		switch len(tables) {
		case 0:
		case 1:
			t.staleTable = tables[0]
		default:
			return nil
		}
	}
	t.pieces = strings.Split(tok, "\x00")
	t.size = len(tok) - (len(t.pieces) - 1)
	return t
}

// CanonicalToken returns a valid token's decimal digits without leading
// zeros, the constant the token form is filled with; false for an invalid
// token (the rewrites' TokenPattern says which are valid).
func CanonicalToken(s string) (string, bool) {
	i := 0
	for i < len(s)-1 && s[i] == '0' {
		i++
	}
	d := s[i:]
	if d == "" || d[0] < '1' || d[0] > '9' || len(d) > len(MaxToken) {
		return "", false
	}
	for j := 1; j < len(d); j++ {
		if d[j] < '0' || d[j] > '9' {
			return "", false
		}
	}
	if len(d) == len(MaxToken) && d > MaxToken {
		return "", false
	}
	return d, true
}

// tokenFormStatements reports whether every statement of tree runs when
// the text is sent, keeping nothing of it for later.
func tokenFormStatements(tree *pg.ParseResult) bool {
	for _, raw := range tree.Stmts {
		switch raw.Stmt.GetNode().(type) {
		case *pg.Node_InsertStmt, *pg.Node_UpdateStmt, *pg.Node_DeleteStmt, *pg.Node_MergeStmt,
			*pg.Node_SelectStmt, *pg.Node_TransactionStmt:
		default:
			return false
		}
	}
	return true
}

// tokHole returns a new placeholder for the token, for a token-form build:
// a string constant, which the token form casts to bigint. An unknown-type
// constant is converted when the statement is analysed, where an integer
// one would need the int4-to-int8 cast looked up.
func (s *splicer) tokHole() *pg.Node {
	h := aStr(tokHoleName)
	s.tokHoles = append(s.tokHoles, h)
	return h
}

// swapTwins exchanges each expression in pairs with its token-form
// build; a second call undoes the first.
func swapTwins(pairs [][2]*pg.Node) {
	for _, p := range pairs {
		p[0].Node, p[1].Node = p[1].Node, p[0].Node
	}
}

// twinsIn returns the expressions dual made that node holds, paired with
// their token-form builds (built now if need be).
func (s *splicer) twinsIn(node *pg.Node) [][2]*pg.Node {
	var pairs [][2]*pg.Node
	walkMessages(node.ProtoReflect(), func(m protoreflect.Message) bool {
		n, ok := m.Interface().(*pg.Node)
		if !ok {
			return true
		}
		if t := s.twins[n]; t != nil {
			pairs = append(pairs, [2]*pg.Node{n, t.litNode()})
			return false // its token form replaces all of it
		}
		return true
	})
	return pairs
}

// tokText returns the token form's pieces of a fragment printed as text
// from node, whose key (fragmentTextKey) is key and which has the given
// number of client holes: nil when the form is the same text, or when it
// cannot be made (tokFail is then set).
//
// The token form of an expression is defined by the expression: any
// print proven for an expression with the same key serves. So proven
// token forms are kept by the real expression's key, and a hit builds and
// prints nothing.
func (s *splicer) tokText(node *pg.Node, key string, holes int, text string) []string {
	form, ok := "", false
	// The same expression has one token form in a StaleAt set and another
	// in the others.
	prefix := "lit|"
	if s.staleAt {
		prefix = "lit-at|"
	}
	if key != "" {
		form, ok = provenFragments.get(prefix + key)
	}
	if !ok {
		pairs := s.twinsIn(node)
		if len(pairs) == 0 {
			form = text
		} else {
			swapTwins(pairs)
			var err error
			form, err = fragmentText(s.version, node)
			if err == nil && form != text {
				form, err = s.proveTokText(node, form)
			}
			swapTwins(pairs)
			if err != nil {
				s.tokFail = true
				return nil
			}
		}
		if key != "" {
			provenFragments.put(prefix+key, form)
		}
	}
	if form == text {
		return nil
	}
	pieces := make([]string, holes+1)
	for i := 0; i < holes; i++ {
		k := strings.Index(form, holeName(i))
		if k < 0 {
			s.tokFail = true
			return nil
		}
		pieces[i] = form[:k]
		form = form[k+len(holeName(i)):]
	}
	pieces[holes] = form
	return pieces
}

// proveTokText finds the token's placeholders in form, the print of node
// (its token-form expressions in place), as string constants the scanner
// reads, and proves that the print with '1' in their places parses into
// node with that constant in the placeholders' nodes. It returns the
// form with NUL bytes in the token's places.
func (s *splicer) proveTokText(node *pg.Node, form string) (string, error) {
	// The proof depends on form alone: form parses into exactly the node
	// it was printed from (fragmentText proved it). So proven forms are
	// kept, with their NUL form, and a hit needs no scan.
	key := "tok|" + form
	if out, ok := provenFragments.get(key); ok {
		return out, nil
	}
	toks, err := scan(form)
	if err != nil {
		return "", err
	}
	var b, p strings.Builder
	pos, n := 0, 0
	const quoted = "'" + tokHoleName + "'"
	for _, t := range toks {
		if t.tok == pg.Token_SCONST && form[t.start:t.end] == quoted {
			b.WriteString(form[pos:t.start])
			b.WriteString("'\x00'")
			p.WriteString(form[pos:t.start])
			p.WriteString("'1'")
			pos = t.end
			n++
		}
	}
	b.WriteString(form[pos:])
	p.WriteString(form[pos:])
	if n == 0 {
		provenFragments.put(key, form)
		return form, nil
	}
	if containsFoldASCII(b.String(), tokHoleName) {
		return "", errors.New("a token placeholder is left in the token form")
	}
	ones := make([]*pg.Node, len(s.tokHoles))
	for i, h := range s.tokHoles {
		ones[i] = aStr("1")
		h.Node, ones[i].Node = ones[i].Node, h.Node
	}
	err = checkFragment(s.version, node, p.String())
	for i, h := range s.tokHoles {
		h.Node, ones[i].Node = ones[i].Node, h.Node
	}
	if err != nil {
		return "", err
	}
	provenFragments.put(key, b.String())
	return b.String(), nil
}
