package rules

import (
	"math/big"
	"math/rand/v2"
	"regexp"
	"strconv"
	"strings"
	"testing"
)

// The token pattern must accept exactly the decimal strings of 1..2^63-1
// (zero-padded or not). Go's RE2 and PostgreSQL's regex engine agree on
// this subset of the syntax (anchors, classes, bounded repetition,
// alternation); the manual PostgreSQL validation runs the same edge cases.
func TestTokenPattern(t *testing.T) {
	re := regexp.MustCompile(tokenPattern)
	max, _ := new(big.Int).SetString(MaxToken, 10)
	valid := func(s string) bool {
		for _, c := range s {
			if c < '0' || c > '9' {
				return false
			}
		}
		n, ok := new(big.Int).SetString(s, 10)
		return s != "" && ok && n.Sign() > 0 && n.Cmp(max) <= 0
	}
	check := func(s string) {
		t.Helper()
		if got, want := re.MatchString(s), valid(s); got != want {
			t.Errorf("pattern match %q = %v, want %v", s, got, want)
		}
	}
	for _, s := range []string{"", "0", "00", "1", "01", "42", "0042", "-1", "+1", " 1", "1 ", "1\n", "4_2", "0x2A", "1e3",
		"999999999999999999", "1000000000000000000", "9223372036854775807", "09223372036854775807",
		"9223372036854775808", "9223372036854775810", "9999999999999999999", "10000000000000000000", "18446744073709551615"} {
		check(s)
	}
	// Around every digit of the maximum, and at random.
	for i := range MaxToken {
		for d := byte('0'); d <= '9'; d++ {
			s := MaxToken[:i] + string(d) + MaxToken[i+1:]
			check(s)
			check(strings.TrimLeft(s, "0"))
		}
	}
	rng := rand.New(rand.NewPCG(1, 2))
	for range 20000 {
		n := rng.Uint64()
		switch rng.IntN(3) {
		case 0:
			n >>= rng.UintN(64)
		case 1:
			n = 9223372036854775807 - n%1000 + rng.Uint64N(2000)
		}
		check(strconv.FormatUint(n, 10))
	}
}

// The short pattern accepts only valid tokens (the prepared form reads a
// token it accepts with a bare cast), every valid token of up to 18
// significant digits, and no longer one.
func TestShortTokenPattern(t *testing.T) {
	short, full := regexp.MustCompile(shortTokenPattern), regexp.MustCompile(tokenPattern)
	for _, s := range []string{"", "0", "00", "1", "01", "42", "0042", "-1", "+1", " 1", "1 ", "1\n", "4_2", "0x2A", "1e3",
		"999999999999999999", "0999999999999999999", "1000000000000000000", MaxToken, "9223372036854775808", "99999999999999999999"} {
		n := len(strings.TrimLeft(s, "0"))
		if got, want := short.MatchString(s), full.MatchString(s) && n <= len(MaxToken)-1; got != want {
			t.Errorf("short pattern match %q = %v, want %v", s, got, want)
		}
	}
	rng := rand.New(rand.NewPCG(3, 4))
	for range 20000 {
		s := strconv.FormatUint(rng.Uint64()>>rng.UintN(64), 10)
		if rng.IntN(4) == 0 {
			s = "00" + s
		}
		if short.MatchString(s) && !full.MatchString(s) || full.MatchString(s) && len(strings.TrimLeft(s, "0")) < len(MaxToken) && !short.MatchString(s) {
			t.Errorf("short pattern and full pattern disagree on %q", s)
		}
	}
}
