package sqllex_test

import (
	"testing"

	"github.com/fenceproxy/fenceproxy/internal/sqllex"
)

func TestSkips(t *testing.T) {
	for _, c := range []struct {
		name string
		got  int
		want int
	}{
		{"quoted", sqllex.SkipQuoted(`'a''b' x`, 1, '\'', false), 6},
		{"escaped quote", sqllex.SkipQuoted(`'a\'b' x`, 1, '\'', true), 6},
		{"backslash literal", sqllex.SkipQuoted(`'a\' x`, 1, '\'', false), 4},
		{"unterminated", sqllex.SkipQuoted(`'abc`, 1, '\'', false), 4},
		{"nested comment", sqllex.SkipBlockComment("/* a /* b */ c */ x", 0), 17},
		{"unterminated comment", sqllex.SkipBlockComment("/* a", 0), 4},
		{"line comment", sqllex.SkipLineComment("-- a\nx", 0), 4},
		{"dollar quote", sqllex.SkipDollar("$t$ a $ b $t$ x", 0), 13},
		{"empty tag", sqllex.SkipDollar("$$a$$x", 0), 5},
		{"parameter", sqllex.SkipDollar("$12 x", 0), 3},
		{"lone dollar", sqllex.SkipDollar("$ x", 0), 1},
	} {
		if c.got != c.want {
			t.Errorf("%s: %d, want %d", c.name, c.got, c.want)
		}
	}
	if !sqllex.IsIdentStart(0x80) || sqllex.IsIdentStart('1') || !sqllex.IsIdentCont('$') || !sqllex.IsSpace('\v') {
		t.Error("character classes")
	}
}
