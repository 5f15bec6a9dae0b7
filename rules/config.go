package rules

import (
	"fmt"
	"strings"
)

// Defaults applied by Compile.
const (
	DefaultTokenSetting = "fence.token"
	DefaultColumn       = "last_fence"
	DefaultCacheSize    = 4096
)

// maxIdentLen is PostgreSQL's NAMEDATALEN-1: longer identifiers are
// truncated by the server, so a longer configured name could never match.
const maxIdentLen = 63

// Table is one protected table, one entry of the `tables:` list of the YAML
// configuration.
type Table struct {
	// Table is the schema-qualified table name, e.g. public.config. Required.
	// Each part follows PostgreSQL's identifier rules: unquoted parts fold to
	// lower case, double-quoted parts ("My Schema"."Cfg") are taken exactly.
	Table string `yaml:"table"`
	// Column is the fence column (bigint NOT NULL DEFAULT 0). Default
	// "last_fence"; same identifier rules as Table.
	Column string `yaml:"column"`
	// OnStale is what happens to a write whose token is older than the row's
	// watermark: "error" (default) fails the statement with FP001, "skip"
	// leaves the row untouched and uncounted.
	OnStale string `yaml:"on_stale"`
	// Strict, when true, accepts a write only if watermark < token (each
	// grant writes a row once); the default accepts watermark <= token.
	Strict bool `yaml:"strict"`
	// MissingToken is what happens when the session has no valid token:
	// "reject" (default) fails the statement with FP002, "allow" lets the
	// write through unfenced (for staged adoption).
	MissingToken string `yaml:"missing_token"`
	// Mode is "enforce" (default) or "off" (the table is not protected).
	// "audit" is reserved and not supported yet.
	Mode string `yaml:"mode"`
}

// Config is the rewriter's configuration.
type Config struct {
	// TokenSetting is the custom session variable that carries the fencing
	// token. Default "fence.token". It must be a valid custom setting name:
	// two or more identifiers joined by dots.
	TokenSetting string `yaml:"token_setting"`
	// Tables lists the protected tables.
	Tables []Table `yaml:"tables"`
	// CacheSize bounds the number of decisions cached by statement text.
	// 0 means DefaultCacheSize; a negative value disables the cache.
	CacheSize int `yaml:"cache_size"`
}

// tableRule is a validated, normalised Table.
type tableRule struct {
	schema, rel string // exact (folded) names
	display     string // schema.rel, quoted where needed; used in messages
	column      string // exact fence column name
	skip        bool   // on_stale: skip
	strict      bool
	allow       bool // missing_token: allow
}

// sameFencing reports whether two rules fence a write identically, which
// lets an unqualified table name that matches both be rewritten.
func (t *tableRule) sameFencing(o *tableRule) bool {
	return t.column == o.column && t.skip == o.skip && t.strict == o.strict && t.allow == o.allow
}

// Compile validates and normalises cfg. Errors name the offending key, e.g.
// `tables[1].on_stale: must be "error" or "skip", got "x"`.
func Compile(cfg Config) (*Rules, error) {
	setting := cfg.TokenSetting
	if setting == "" {
		setting = DefaultTokenSetting
	}
	if !validCustomSetting(setting) {
		return nil, fmt.Errorf("token_setting: %q is not a valid custom setting name (two or more identifiers joined by dots, e.g. %q)", setting, DefaultTokenSetting)
	}
	// PostgreSQL looks setting names up case-insensitively and reports them
	// in lower case.
	setting = strings.ToLower(setting)

	r := &Rules{
		tokenSetting: setting,
		byRel:        make(map[string][]*tableRule),
	}
	seen := make(map[[2]string]int)
	for i, t := range cfg.Tables {
		key := fmt.Sprintf("tables[%d]", i)
		tr, enforce, err := compileTable(key, t)
		if err != nil {
			return nil, err
		}
		k := [2]string{tr.schema, tr.rel}
		if j, dup := seen[k]; dup {
			return nil, fmt.Errorf("%s.table: %s is already listed as tables[%d]", key, tr.display, j)
		}
		seen[k] = i
		if !enforce {
			continue
		}
		r.tables = append(r.tables, tr)
		r.byRel[tr.rel] = append(r.byRel[tr.rel], tr)
	}
	r.buildNeedles()

	size := cfg.CacheSize
	if size == 0 {
		size = DefaultCacheSize
	}
	if size > 0 {
		r.cache = newDecisionCache(size)
	}
	return r, nil
}

func compileTable(key string, t Table) (*tableRule, bool, error) {
	if strings.TrimSpace(t.Table) == "" {
		return nil, false, fmt.Errorf("%s.table: required", key)
	}
	parts, err := parseQualifiedName(t.Table)
	if err != nil {
		return nil, false, fmt.Errorf("%s.table: %q: %v", key, t.Table, err)
	}
	if len(parts) != 2 {
		return nil, false, fmt.Errorf("%s.table: must be schema-qualified (e.g. public.config), got %q", key, t.Table)
	}
	tr := &tableRule{schema: parts[0], rel: parts[1]}
	tr.display = quoteIdent(tr.schema) + "." + quoteIdent(tr.rel)

	tr.column = DefaultColumn
	if t.Column != "" {
		col, err := parseQualifiedName(t.Column)
		if err != nil {
			return nil, false, fmt.Errorf("%s.column: %q: %v", key, t.Column, err)
		}
		if len(col) != 1 {
			return nil, false, fmt.Errorf("%s.column: must be a plain column name, got %q", key, t.Column)
		}
		tr.column = col[0]
	}

	switch t.OnStale {
	case "", "error":
	case "skip":
		tr.skip = true
	default:
		return nil, false, fmt.Errorf("%s.on_stale: must be \"error\" or \"skip\", got %q", key, t.OnStale)
	}
	tr.strict = t.Strict
	switch t.MissingToken {
	case "", "reject":
	case "allow":
		tr.allow = true
	default:
		return nil, false, fmt.Errorf("%s.missing_token: must be \"reject\" or \"allow\", got %q", key, t.MissingToken)
	}
	enforce := true
	switch t.Mode {
	case "", "enforce":
	case "off":
		enforce = false
	case "audit":
		return nil, false, fmt.Errorf("%s.mode: \"audit\" is not supported yet; use \"enforce\" or \"off\"", key)
	default:
		return nil, false, fmt.Errorf("%s.mode: must be \"enforce\" or \"off\", got %q", key, t.Mode)
	}
	return tr, enforce, nil
}

// parseQualifiedName splits a dotted name into identifiers following
// PostgreSQL's rules: unquoted identifiers fold ASCII letters to lower case;
// "quoted" identifiers are exact, with "" standing for one double quote.
// Whitespace around parts is allowed, as in SQL.
func parseQualifiedName(s string) ([]string, error) {
	var parts []string
	i := 0
	for {
		for i < len(s) && isSpace(s[i]) {
			i++
		}
		if i >= len(s) {
			return nil, fmt.Errorf("missing identifier")
		}
		var part string
		if s[i] == '"' {
			var b strings.Builder
			i++
			closed := false
			for i < len(s) {
				if s[i] == '"' {
					if i+1 < len(s) && s[i+1] == '"' {
						b.WriteByte('"')
						i += 2
						continue
					}
					i++
					closed = true
					break
				}
				b.WriteByte(s[i])
				i++
			}
			if !closed {
				return nil, fmt.Errorf("unterminated quoted identifier")
			}
			part = b.String()
			if part == "" {
				return nil, fmt.Errorf("zero-length quoted identifier")
			}
		} else {
			start := i
			if !isIdentStart(s[i]) {
				return nil, fmt.Errorf("unexpected character %q", s[i])
			}
			for i < len(s) && isIdentCont(s[i]) {
				i++
			}
			part = asciiLower(s[start:i])
		}
		if len(part) > maxIdentLen {
			return nil, fmt.Errorf("identifier %q is longer than %d bytes", part, maxIdentLen)
		}
		parts = append(parts, part)
		for i < len(s) && isSpace(s[i]) {
			i++
		}
		if i == len(s) {
			return parts, nil
		}
		if s[i] != '.' {
			return nil, fmt.Errorf("unexpected character %q", s[i])
		}
		i++
	}
}

// validCustomSetting mirrors PostgreSQL's valid_custom_variable_name: two or
// more identifiers (letters, '_', high-bit bytes, then also digits and '$')
// joined by dots.
func validCustomSetting(name string) bool {
	sawSep, nameStart := false, true
	for i := 0; i < len(name); i++ {
		c := name[i]
		switch {
		case c == '.':
			if nameStart {
				return false
			}
			sawSep, nameStart = true, true
		case isIdentStart(c):
			nameStart = false
		case !nameStart && (c >= '0' && c <= '9' || c == '$'):
		default:
			return false
		}
	}
	return !nameStart && sawSep
}

func isSpace(c byte) bool { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' }

func isIdentStart(c byte) bool {
	return c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c == '_' || c >= 0x80
}

func isIdentCont(c byte) bool {
	return isIdentStart(c) || c >= '0' && c <= '9' || c == '$'
}

// asciiLower folds ASCII letters only, as PostgreSQL does for unquoted
// identifiers in multi-byte encodings.
func asciiLower(s string) string {
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

// quoteIdent quotes an identifier for display when it would not survive
// being read back unquoted. Keywords are not quoted (there is no keyword list
// here); the result is for messages, never for SQL.
func quoteIdent(s string) string {
	plain := s != "" && s[0] >= 'a' && s[0] <= 'z' || s != "" && s[0] == '_'
	for i := 0; plain && i < len(s); i++ {
		c := s[i]
		plain = c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '_' || c == '$'
	}
	if plain {
		return s
	}
	return `"` + strings.ReplaceAll(s, `"`, `""`) + `"`
}
