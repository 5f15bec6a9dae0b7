package lock

import (
	"fmt"
	"strings"
)

// Default names of the PostgreSQL settings that carry a grant to the
// database; fenceproxy's token_setting and its lock setting default to the
// same names.
const (
	DefaultTokenSetting = "fence.token"
	DefaultLockSetting  = "fence.lock"
)

// Settings names the PostgreSQL settings that carry the fencing token and
// the lock's name. The zero value uses the defaults.
type Settings struct {
	// Token is the setting for the fencing token. Default
	// DefaultTokenSetting.
	Token string
	// Lock is the setting for the lock's name. Default DefaultLockSetting.
	Lock string
}

// Names returns the setting names in force: Token and Lock, each or its
// default when empty.
func (s Settings) Names() (token, lock string) { return s.token(), s.lock() }

func (s Settings) token() string {
	if s.Token == "" {
		return DefaultTokenSetting
	}
	return s.Token
}

func (s Settings) lock() string {
	if s.Lock == "" {
		return DefaultLockSetting
	}
	return s.Lock
}

// Validate reports whether both names are custom setting names PostgreSQL
// accepts from a client: two or more identifiers (letters, digits, "_",
// "$", not starting with a digit or "$") joined by dots.
func (s Settings) Validate() error {
	for _, name := range []string{s.token(), s.lock()} {
		if !validSettingName(name) {
			return fmt.Errorf("lock: %q is not a custom setting name (want a dotted name such as %q)", name, DefaultTokenSetting)
		}
	}
	if s.token() == s.lock() {
		return fmt.Errorf("lock: token and lock settings are both %q", s.token())
	}
	return nil
}

func validSettingName(name string) bool {
	parts := strings.Split(name, ".")
	if len(parts) < 2 {
		return false
	}
	for _, p := range parts {
		if p == "" {
			return false
		}
		for i, r := range p {
			switch {
			case r == '_' || 'a' <= r && r <= 'z' || 'A' <= r && r <= 'Z':
			case i > 0 && (r == '$' || '0' <= r && r <= '9'):
			default:
				return false
			}
		}
	}
	return true
}

// AppendPGOptions appends opts to an existing PGOPTIONS value. Options
// later in the string win, so opts override settings of the same name in
// existing.
func AppendPGOptions(existing, opts string) string {
	if strings.TrimSpace(existing) == "" {
		return opts
	}
	// A trailing unpaired backslash escapes nothing at the end of the
	// string, but would escape the separating space and glue opts onto
	// the last option.
	if n := len(existing) - len(strings.TrimRight(existing, `\`)); n%2 == 1 {
		existing = existing[:len(existing)-1]
	}
	return existing + " " + opts
}

// escapeOption escapes one command-line option for PostgreSQL, which
// splits the options string at unescaped white space and drops the
// backslash before any character (pg_split_opts; see "options" under
// "Parameter Key Words" in the libpq documentation).
func escapeOption(s string) string {
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		switch c := s[i]; c {
		case '\\', ' ', '\t', '\n', '\v', '\f', '\r':
			b.WriteByte('\\')
			b.WriteByte(c)
		default:
			b.WriteByte(c)
		}
	}
	return b.String()
}
