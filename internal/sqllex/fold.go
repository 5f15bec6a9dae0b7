package sqllex

import "strings"

// ASCII case folding, as PostgreSQL's downcase_identifier does for
// unquoted identifiers in a multibyte encoding: only the letters A to Z
// are lowered, every other byte is left as it is. The needles below are
// in lower case already; none of these functions allocates but Fold.

// FoldByte lowers c if it is an ASCII capital letter.
func FoldByte(c byte) byte {
	if c >= 'A' && c <= 'Z' {
		return c + 'a' - 'A'
	}
	return c
}

// Fold returns s with its ASCII letters lowered (s itself when it has no
// capital letter).
func Fold(s string) string {
	for i := 0; i < len(s); i++ {
		if c := s[i]; c >= 'A' && c <= 'Z' {
			b := []byte(s)
			for j := i; j < len(b); j++ {
				if b[j] >= 'A' && b[j] <= 'Z' {
					b[j] += 'a' - 'A'
				}
			}
			return string(b)
		}
	}
	return s
}

// HasPrefixFold reports whether s starts with the lower-case needle n,
// folding only ASCII letters of s.
func HasPrefixFold(s, n string) bool {
	if len(s) < len(n) {
		return false
	}
	for i := 0; i < len(n); i++ {
		if FoldByte(s[i]) != n[i] {
			return false
		}
	}
	return true
}

// IndexFold returns the index of the first occurrence in s of the
// lower-case needle n, folding only ASCII letters of s, or -1.
func IndexFold(s, n string) int {
	if len(n) == 0 {
		return 0
	}
	c := n[0]
	best := indexPrefixFold(s, n, c)
	if c >= 'a' && c <= 'z' {
		if i := indexPrefixFold(s, n, c-'a'+'A'); i >= 0 && (best < 0 || i < best) {
			best = i
		}
	}
	return best
}

// indexPrefixFold returns the first index i where s[i] == c and s[i:]
// starts with n (folded), or -1.
func indexPrefixFold(s, n string, c byte) int {
	for off := 0; off+len(n) <= len(s); {
		i := strings.IndexByte(s[off:len(s)-len(n)+1], c)
		if i < 0 {
			return -1
		}
		if HasPrefixFold(s[off+i+1:], n[1:]) {
			return off + i
		}
		off += i + 1
	}
	return -1
}

// ContainsFold reports whether s contains the lower-case needle n,
// folding only ASCII letters of s.
func ContainsFold(s, n string) bool { return IndexFold(s, n) >= 0 }

// ContainsWordFold reports whether s contains the lower-case word n, not
// preceded or followed by an identifier byte (IsIdentCont).
func ContainsWordFold(s, n string) bool {
	if !isWord(n) {
		for i := 0; i+len(n) <= len(s); i++ {
			if HasPrefixFold(s[i:], n) && (i == 0 || !IsIdentCont(s[i-1])) && (i+len(n) == len(s) || !IsIdentCont(s[i+len(n)])) {
				return true
			}
		}
		return false
	}
	return ContainsAnyWordFold(s, []string{n})
}

// ContainsAnyWordFold reports whether s contains one of the lower-case
// words, each made of identifier bytes only (IsIdentCont), as
// ContainsWordFold finds it. It reads s once: a word of identifier bytes
// with no identifier byte on either side is a whole run of them, so each
// run is compared with the words of its length, and nothing else is.
func ContainsAnyWordFold(s string, words []string) bool {
	for i := 0; i < len(s); {
		if !identCont[s[i]] {
			i++
			continue
		}
		j := i + 1
		for j < len(s) && identCont[s[j]] {
			j++
		}
		for _, w := range words {
			if len(w) == j-i && HasPrefixFold(s[i:j], w) {
				return true
			}
		}
		i = j
	}
	return false
}

// identCont is IsIdentCont as a table.
var identCont = func() (t [256]bool) {
	for c := range t {
		t[c] = IsIdentCont(byte(c))
	}
	return t
}()

// isWord reports whether n is non-empty and made of identifier bytes.
func isWord(n string) bool {
	if n == "" {
		return false
	}
	for i := 0; i < len(n); i++ {
		if !IsIdentCont(n[i]) {
			return false
		}
	}
	return true
}

// MayEndTx reports whether code, a procedure's body or a DO block's, may
// commit or roll back its transaction when it runs outside a transaction
// block: it holds "commit" or "rollback" anywhere, ASCII case ignored
// (PL/pgSQL's COMMIT and ROLLBACK, PL/Python's plpy.commit(), PL/Perl's
// spi_commit), or the word CALL (a procedure it calls may). A name, a
// string or a comment that holds them counts too.
func MayEndTx(code string) bool {
	return ContainsFold(code, "commit") || ContainsFold(code, "rollback") || ContainsWordFold(code, "call")
}
