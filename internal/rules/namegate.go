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

// maxIdentBytes is the longest identifier PostgreSQL keeps (NAMEDATALEN -
// 1): a longer one is truncated to it, at a character boundary.
const maxIdentBytes = 63

// add adds a relation's exact name.
func (g *nameGate) add(name string) {
	n := asciiLower(name)
	if n != "" && len(n) <= maxIdentBytes && !strings.ContainsFunc(n, func(r rune) bool { return r < 0x80 && !wordByte(byte(r)) }) {
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
// as a word, or a word that PostgreSQL truncates to it, for the names
// made of identifier bytes; as a substring for the others.
func (g *nameGate) mayName(sql string) bool {
	if len(g.words) > 0 {
		var buf [maxIdentBytes]byte
		for i := 0; i < len(sql); {
			if !wordByte(sql[i]) {
				i++
				continue
			}
			j := i + 1
			for j < len(sql) && wordByte(sql[j]) {
				j++
			}
			w := sql[i:j]
			i = j
			if len(w) > maxIdentBytes {
				// Truncated at a character boundary: up to three bytes
				// of a UTF-8 character may go too.
				for k := maxIdentBytes; k >= maxIdentBytes-3; k-- {
					if g.hasWord(w[:k], &buf) {
						return true
					}
				}
				continue
			}
			if g.hasWord(w, &buf) {
				return true
			}
		}
	}
	for _, n := range g.needles {
		if indexFoldASCII(sql, n) >= 0 {
			return true
		}
	}
	return false
}

// hasWord looks w (at most maxIdentBytes) up in words, ASCII-lowered in buf.
func (g *nameGate) hasWord(w string, buf *[maxIdentBytes]byte) bool {
	for k := 0; k < len(w); k++ {
		buf[k] = lowerASCII(w[k])
	}
	_, ok := g.words[string(buf[:len(w)])]
	return ok
}

// wordByte reports whether c continues a word of mayName: an identifier
// byte other than '$'.
func wordByte(c byte) bool { return c != '$' && sqllex.IsIdentCont(c) }
