package rules

import (
	"strings"

	"github.com/fenceproxy/fenceproxy/internal/sqllex"
)

// nameGate tells, without parsing and without allocating, whether a text
// may name one of a set of relations. A relation name made only of
// letters, digits, underscores and bytes >= 0x80 can only be named by a
// word of the text (a maximal run of such bytes: an unquoted identifier,
// or a quoted one's body, or a name in a function's body), so those
// names are looked up word by word in a map, which costs the same for ten
// names as for ten thousand (a partitioned table's partitions). '$' ends
// a word: it continues an unquoted identifier, but it also closes a
// dollar-quoted body ($$SELECT * FROM v$$). Other names (with a '$', a
// space or a quote, say) are looked for as substrings.
type nameGate struct {
	words   map[string]struct{} // ASCII-lowered names of identifier bytes only
	needles []string            // the other names, ASCII-lowered, and with "" for "
}

// add adds a relation's exact name.
func (g *nameGate) add(name string) {
	n := asciiLower(name)
	if len(n) <= sqllex.MaxIdentBytes && sqllex.IsWord(n) {
		if g.words == nil {
			g.words = make(map[string]struct{})
		}
		g.words[n] = struct{}{}
		return
	}
	g.needles = append(g.needles, n)
	if strings.Contains(n, `"`) {
		g.needles = append(g.needles, strings.ReplaceAll(n, `"`, `""`))
	}
}

// mayName reports whether sql holds one of the names, ASCII case ignored:
// as a word, or a word that PostgreSQL truncates to it (sqllex.Words),
// for the names made of word bytes; as a substring for the others.
func (g *nameGate) mayName(sql string) bool {
	if len(g.words) > 0 {
		var buf [sqllex.MaxIdentBytes]byte
		if sqllex.Words(sql, func(w string) bool { return g.hasWord(w, &buf) }) {
			return true
		}
	}
	for _, n := range g.needles {
		if indexFoldASCII(sql, n) >= 0 {
			return true
		}
	}
	return false
}

// hasWord looks w (at most MaxIdentBytes) up in words, ASCII-lowered in
// buf.
func (g *nameGate) hasWord(w string, buf *[sqllex.MaxIdentBytes]byte) bool {
	for k := 0; k < len(w); k++ {
		buf[k] = lowerASCII(w[k])
	}
	_, ok := g.words[string(buf[:len(w)])]
	return ok
}
