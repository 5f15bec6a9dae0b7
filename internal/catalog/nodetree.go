package catalog

// A reader of PostgreSQL's node trees as the catalog stores them
// (pg_rewrite.ev_action, pg_node_tree text), enough for the path graph.

import (
	"fmt"
	"strconv"
	"strings"
)

// pgNode is a value of a pg_node_tree as nodeToString writes it
// (outfuncs.c) and stringToNode reads it (read.c): a node {NAME :field
// value ...}, a list (value ...), or a token. The format is internal to
// PostgreSQL, but the few fields read here (Query's commandType,
// resultRelation, rtable and jointree; RangeTblEntry's rtekind, relid and
// inh; FromExpr's fromlist; RangeTblRef's rtindex) have kept their names
// and meaning for many releases.
type pgNode struct {
	name   string             // node type for a node: "QUERY", "RANGETBLENTRY", ...
	fields map[string]*pgNode // a node's fields; a field with several tokens keeps the first
	list   []*pgNode          // a list's items, or a node's fields in order
	atom   string             // a token
	isList bool
}

// field returns field name of node n, nil when n is nil or lacks it.
func (n *pgNode) field(name string) *pgNode {
	if n == nil {
		return nil
	}
	return n.fields[name]
}

// int returns n's token as an integer, -1 when it is not one.
func (n *pgNode) int() int {
	if n == nil {
		return -1
	}
	v, err := strconv.Atoi(n.atom)
	if err != nil {
		return -1
	}
	return v
}

// oid returns n's token as an OID, 0 when it is not one.
func (n *pgNode) oid() uint32 {
	if n == nil {
		return 0
	}
	v, err := strconv.ParseUint(n.atom, 10, 32)
	if err != nil {
		return 0
	}
	return uint32(v)
}

// walk calls fn for every node named name in n, n included, outermost
// first.
func (n *pgNode) walk(name string, fn func(*pgNode)) {
	if n == nil {
		return
	}
	if n.name == name {
		fn(n)
	}
	for _, c := range n.list {
		c.walk(name, fn)
	}
}

// parseNodeTree parses the text of a pg_node_tree.
func parseNodeTree(s string) (*pgNode, error) {
	p := &nodeTreeParser{s: s}
	n, err := p.value()
	if err != nil {
		return nil, err
	}
	if tok := p.next(); tok != "" {
		return nil, fmt.Errorf("node tree: unexpected %q after the end", tok)
	}
	return n, nil
}

// nodeTreeParser splits tokens as pg_strtok does: (, ), { and } alone,
// anything else up to white space or one of those, a backslash escaping the
// next character.
type nodeTreeParser struct {
	s   string
	pos int
	tok string // a token read ahead, if any
}

func (p *nodeTreeParser) next() string {
	if p.tok != "" {
		t := p.tok
		p.tok = ""
		return t
	}
	for p.pos < len(p.s) && (p.s[p.pos] == ' ' || p.s[p.pos] == '\n' || p.s[p.pos] == '\t') {
		p.pos++
	}
	if p.pos >= len(p.s) {
		return ""
	}
	start := p.pos
	switch p.s[p.pos] {
	case '(', ')', '{', '}':
		p.pos++
		return p.s[start:p.pos]
	}
	for p.pos < len(p.s) {
		switch p.s[p.pos] {
		case ' ', '\n', '\t', '(', ')', '{', '}':
			return p.s[start:p.pos]
		case '\\':
			p.pos++
		}
		p.pos++
	}
	if p.pos > len(p.s) {
		p.pos = len(p.s)
	}
	return p.s[start:p.pos]
}

func (p *nodeTreeParser) peek() string {
	if p.tok == "" {
		p.tok = p.next()
	}
	return p.tok
}

// value parses a node, a list or a token.
func (p *nodeTreeParser) value() (*pgNode, error) {
	switch tok := p.next(); tok {
	case "":
		return nil, fmt.Errorf("node tree: unexpected end")
	case ")", "}":
		return nil, fmt.Errorf("node tree: unexpected %q", tok)
	case "(":
		n := &pgNode{isList: true}
		for p.peek() != ")" {
			if p.peek() == "" {
				return nil, fmt.Errorf("node tree: unterminated list")
			}
			item, err := p.value()
			if err != nil {
				return nil, err
			}
			n.list = append(n.list, item)
		}
		p.next()
		return n, nil
	case "{":
		n := &pgNode{name: p.next(), fields: map[string]*pgNode{}}
		// Every field label is followed by at least one token, which may
		// itself start with ':' (a string); a datum takes several tokens.
		label := ""
		for p.peek() != "}" {
			tok := p.peek()
			if tok == "" {
				return nil, fmt.Errorf("node tree: unterminated %s node", n.name)
			}
			if strings.HasPrefix(tok, ":") && (label == "" || n.fields[label] != nil) {
				label = p.next()[1:]
				continue
			}
			item, err := p.value()
			if err != nil {
				return nil, err
			}
			if label != "" && n.fields[label] == nil {
				n.fields[label] = item
			}
			n.list = append(n.list, item)
		}
		p.next()
		return n, nil
	default:
		return &pgNode{atom: tok}, nil
	}
}
