package rules

import (
	"fmt"
	"strings"
	"unicode/utf8"

	"github.com/fenceproxy/fenceproxy/internal/sqllex"
)

// Defaults applied by Compile.
const (
	DefaultTokenSetting = "fence.token"
	DefaultLockSetting  = "fence.lock"
	DefaultColumn       = "last_fence"
	DefaultCacheSize    = 4096 // a good Config.CacheSize
	// DefaultMaxCheckBytes is Config.MaxCheckBytes when it is 0: 1 MiB.
	DefaultMaxCheckBytes = 1 << 20
)

// maxIdentLen is PostgreSQL's NAMEDATALEN-1: longer identifiers are
// truncated by the server, so a longer configured name could never match.
const maxIdentLen = 63

// Table is one entry of the `tables:` list of the YAML configuration: a
// protected table and how it is fenced, optionally only for some sessions.
type Table struct {
	// Table is the schema-qualified table name, e.g. public.config. Required.
	// Each part follows PostgreSQL's identifier rules: unquoted parts fold to
	// lower case, double-quoted parts ("My Schema"."Cfg") are taken exactly.
	Table string `yaml:"table"`
	// Column is the fence column (bigint NOT NULL DEFAULT 0). Default
	// "last_fence"; same identifier rules as Table. With Lock "required"
	// it may be left empty: the table then has no fence column and lock
	// fencing alone protects it.
	Column string `yaml:"column"`
	// Lock is how lock fencing applies to the table: "optional" (default:
	// statements of sessions that name a lock register the session's token
	// for that lock first; other sessions get row fencing only),
	// "required" (a statement on the table from a session without a valid
	// lock name and token fails with FP002) or "off" (row fencing only).
	Lock string `yaml:"lock"`
	// OnStale is what happens to a write whose token is older than the row's
	// watermark: "error" (default) fails the statement with FP001, "skip"
	// leaves the row untouched and uncounted. Ignored in audit mode.
	OnStale string `yaml:"on_stale"`
	// Strict, when true, accepts a write only if watermark < token (each
	// grant writes a row once); the default accepts watermark <= token.
	Strict bool `yaml:"strict"`
	// MissingToken is what happens when the session has no valid token:
	// "reject" (default) fails the statement with FP002, "allow" lets the
	// write through unfenced and records it (for staged adoption). Ignored
	// in audit mode.
	MissingToken string `yaml:"missing_token"`
	// Mode is "enforce" (default), "audit" (never block or change a write,
	// keep the watermark moving when a valid token is present, and record
	// every write enforce would have rejected) or "off" (not protected).
	Mode string `yaml:"mode"`
	// Scope limits the entry to some sessions. Default: every session. A
	// table may be listed several times with different scopes; for a
	// session, the first entry (in list order) whose scope matches decides
	// how the table is fenced, and a table no entry matches is not
	// protected in that session.
	Scope Scope `yaml:"scope"`
}

// Scope selects sessions by the values the client sent in its startup
// packet. Each list left empty matches any value; a session matches when it
// matches every list. Values are compared exactly (no case folding, no
// patterns). Scopes are for staged rollout, not a security boundary: a
// client chooses its own application_name.
type Scope struct {
	// Databases lists database names. Default: any.
	Databases []string `yaml:"databases"`
	// Users lists user (role) names. Default: any.
	Users []string `yaml:"users"`
	// ApplicationNames lists application_name values. Default: any.
	ApplicationNames []string `yaml:"application_names"`
}

// Config is the rewriter's configuration.
type Config struct {
	// TokenSetting is the custom session variable that carries the fencing
	// token. Default "fence.token". It must be a valid custom setting name:
	// two or more identifiers joined by dots.
	TokenSetting string `yaml:"token_setting"`
	// LockSetting is the custom session variable that carries the name of
	// the lock the session holds. Default "fence.lock"; same rules as
	// TokenSetting, and it must differ from it.
	LockSetting string `yaml:"lock_setting"`
	// Tables lists the protected tables.
	Tables []Table `yaml:"tables"`
	// CacheSize bounds the number of decisions cached by statement text,
	// shared by the rule sets ForSession derives. 0 or less: no cache
	// (DefaultCacheSize is a good size).
	CacheSize int `yaml:"-"`
	// AuditTag identifies this proxy instance in audit notifications (the
	// "i" field of the payload, see AuditEvent), so that a listener can
	// tell its own instance's records from those of other instances
	// sharing the database. Default "". At most MaxAuditTagLen bytes of
	// valid UTF-8 without NUL bytes.
	AuditTag string `yaml:"-"`
	// MaxCheckBytes bounds the size of a statement the rewriter parses:
	// checking and rewriting a statement takes memory in proportion to it
	// (up to about 200 times its size; about 50 for a long VALUES list of
	// plain rows), so a larger statement that may touch a protected table
	// is refused (FP003) instead. 0 means DefaultMaxCheckBytes; statements that cannot touch a
	// protected table are never parsed and have no such limit.
	MaxCheckBytes int `yaml:"-"`
}

// MaxAuditTagLen bounds Config.AuditTag, which every audit notification
// carries (PostgreSQL limits a notification payload to 8000 bytes).
const MaxAuditTagLen = 256

// Notifies reports whether statements rewritten under cfg may report
// through AuditChannel (a table in audit mode, or with missing_token:
// allow), so that a listener is needed.
func (cfg Config) Notifies() bool {
	for _, t := range cfg.Tables {
		if t.Mode == ModeOff {
			continue
		}
		if t.Mode == ModeAudit || t.MissingToken == MissingTokenAllow {
			return true
		}
	}
	return false
}

// tableRule is a validated, normalised Table in mode enforce or audit.
type tableRule struct {
	schema, rel string // exact (folded) names
	display     string // schema.rel, quoted where needed; used in messages
	column      string // exact fence column name
	skip        bool   // on_stale: skip
	strict      bool
	allow       bool // missing_token: allow
	audit       bool // mode: audit
	lock        lockMode
}

// lockMode is Table.Lock.
type lockMode uint8

const (
	lockOptional lockMode = iota
	lockRequired
	lockOff
)

// Values of Table.Lock.
const (
	LockOptional = "optional"
	LockRequired = "required"
	LockOff      = "off"
)

// sameFencing reports whether two rules fence a write identically, which
// lets an unqualified table name that matches both be rewritten.
func (t *tableRule) sameFencing(o *tableRule) bool {
	return t.column == o.column && t.skip == o.skip && t.strict == o.strict && t.allow == o.allow && t.audit == o.audit && t.lock == o.lock
}

// Compile validates and normalises cfg. Errors name the offending key, e.g.
// `tables[1].on_stale: must be "error" or "skip", got "x"`.
func Compile(cfg Config) (*Rules, error) {
	if cfg.MaxCheckBytes < 0 {
		return nil, fmt.Errorf("max_check_bytes: must not be negative, got %d", cfg.MaxCheckBytes)
	}
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
	lockSetting := cfg.LockSetting
	if lockSetting == "" {
		lockSetting = DefaultLockSetting
	}
	if !validCustomSetting(lockSetting) {
		return nil, fmt.Errorf("lock_setting: %q is not a valid custom setting name (two or more identifiers joined by dots, e.g. %q)", lockSetting, DefaultLockSetting)
	}
	lockSetting = strings.ToLower(lockSetting)
	if lockSetting == setting {
		return nil, fmt.Errorf("lock_setting: must differ from token_setting (both %q)", setting)
	}
	switch tag := cfg.AuditTag; {
	case len(tag) > MaxAuditTagLen:
		return nil, fmt.Errorf("audit_tag: must be at most %d bytes, got %d", MaxAuditTagLen, len(tag))
	case !utf8.ValidString(tag) || strings.IndexByte(tag, 0) >= 0:
		// It is sent to the server inside every rewritten statement.
		return nil, fmt.Errorf("audit_tag: must be valid UTF-8 without NUL bytes")
	}

	groups := make(map[[2]string]*group)
	var order []*group
	for i, t := range cfg.Tables {
		key := fmt.Sprintf("tables[%d]", i)
		tr, schema, rel, err := compileTable(key, t)
		if err != nil {
			return nil, err
		}
		sc, err := compileScope(key+".scope", t.Scope)
		if err != nil {
			return nil, err
		}
		e := &entry{index: i, rule: tr, scope: sc}
		k := [2]string{schema, rel}
		g := groups[k]
		if g == nil {
			g = &group{display: quoteIdent(schema) + "." + quoteIdent(rel)}
			groups[k] = g
			order = append(order, g)
		}
		for _, prev := range g.entries {
			if err := checkShadow(key, g.display, prev, e); err != nil {
				return nil, err
			}
		}
		g.entries = append(g.entries, e)
	}

	var cache *decisionCache
	if cfg.CacheSize > 0 {
		cache = newDecisionCache(cfg.CacheSize)
	}
	r := newRoot(setting, cfg.AuditTag, order, cache)
	r.lockSetting = lockSetting
	r.maxCheck = cfg.MaxCheckBytes
	if r.maxCheck == 0 {
		r.maxCheck = DefaultMaxCheckBytes
	}
	return r, nil
}

// checkShadow rejects entry e when an earlier entry prev for the same table
// matches every session e matches: e would never apply.
func checkShadow(key, display string, prev, e *entry) error {
	if !prev.scope.covers(&e.scope) {
		return nil
	}
	if prev.scope.any() && e.scope.any() {
		return fmt.Errorf("%s.table: %s is already listed as tables[%d]", key, display, prev.index)
	}
	if prev.scope.equal(&e.scope) {
		return fmt.Errorf("%s.scope: %s is already listed with the same scope as tables[%d]", key, display, prev.index)
	}
	return fmt.Errorf("%s.scope: never applies: tables[%d] lists %s for every session this scope matches, and the first matching entry wins (list the narrower scope first)",
		key, prev.index, display)
}

// compileTable validates one entry. It returns the rule (nil for mode: off)
// and the table's folded schema and relation names.
func compileTable(key string, t Table) (*tableRule, string, string, error) {
	if strings.TrimSpace(t.Table) == "" {
		return nil, "", "", fmt.Errorf("%s.table: required", key)
	}
	parts, err := parseQualifiedName(t.Table)
	if err != nil {
		return nil, "", "", fmt.Errorf("%s.table: %q: %v", key, t.Table, err)
	}
	if len(parts) != 2 {
		return nil, "", "", fmt.Errorf("%s.table: must be schema-qualified (e.g. public.config), got %q", key, t.Table)
	}
	tr := &tableRule{schema: parts[0], rel: parts[1]}
	tr.display = quoteIdent(tr.schema) + "." + quoteIdent(tr.rel)

	switch t.Lock {
	case "", LockOptional:
	case LockRequired:
		tr.lock = lockRequired
	case LockOff:
		tr.lock = lockOff
	default:
		return nil, "", "", fmt.Errorf("%s.lock: must be \"optional\", \"required\" or \"off\", got %q", key, t.Lock)
	}
	tr.column = DefaultColumn
	if t.Column == "" && tr.lock == lockRequired {
		tr.column = "" // no row fencing: the lock protects the table
	}
	if t.Column != "" {
		col, err := parseQualifiedName(t.Column)
		if err != nil {
			return nil, "", "", fmt.Errorf("%s.column: %q: %v", key, t.Column, err)
		}
		if len(col) != 1 {
			return nil, "", "", fmt.Errorf("%s.column: must be a plain column name, got %q", key, t.Column)
		}
		tr.column = col[0]
	}

	switch t.OnStale {
	case "", OnStaleError:
	case OnStaleSkip:
		tr.skip = true
	default:
		return nil, "", "", fmt.Errorf("%s.on_stale: must be \"error\" or \"skip\", got %q", key, t.OnStale)
	}
	tr.strict = t.Strict
	switch t.MissingToken {
	case "", MissingTokenReject:
	case MissingTokenAllow:
		tr.allow = true
	default:
		return nil, "", "", fmt.Errorf("%s.missing_token: must be \"reject\" or \"allow\", got %q", key, t.MissingToken)
	}
	switch t.Mode {
	case "", ModeEnforce:
	case ModeAudit:
		// Audit never blocks: on_stale and missing_token describe what
		// enforce would do and do not change the audit rewrite.
		tr.audit, tr.skip, tr.allow = true, false, false
	case ModeOff:
		return nil, tr.schema, tr.rel, nil
	default:
		return nil, "", "", fmt.Errorf("%s.mode: must be \"enforce\", \"audit\" or \"off\", got %q", key, t.Mode)
	}
	return tr, tr.schema, tr.rel, nil
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
			if !sqllex.IsIdentStart(s[i]) {
				return nil, fmt.Errorf("unexpected character %q", s[i])
			}
			for i < len(s) && sqllex.IsIdentCont(s[i]) {
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
		case sqllex.IsIdentStart(c):
			nameStart = false
		case !nameStart && (c >= '0' && c <= '9' || c == '$'):
		default:
			return false
		}
	}
	return !nameStart && sawSep
}

func isSpace(c byte) bool { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' }

// asciiLower folds ASCII letters only, as PostgreSQL does for unquoted
// identifiers in multi-byte encodings.
func asciiLower(s string) string { return sqllex.Fold(s) }

// quoteIdent quotes an identifier for display when it would not survive
// being read back unquoted; the result is for messages, never for SQL.
func quoteIdent(s string) string { return sqllex.DisplayIdent(s) }

// TableSpec is one validated entry of a configuration, with its names
// resolved as PostgreSQL resolves them, for tools that prepare or check
// a database (fenceproxy setup and check).
type TableSpec struct {
	Index   int    // position in Config.Tables
	Schema  string // exact (folded) names
	Table   string
	Display string // schema.table, quoted where needed
	// Column is the exact fence column name; "" when the table has none
	// (lock: required without a column).
	Column string
	Mode   string // ModeEnforce, ModeAudit or ModeOff
	Lock   string // LockOptional, LockRequired or LockOff
	Scope  Scope
}

// Specs validates cfg like Compile and lists its entries, mode off
// included.
func Specs(cfg Config) ([]TableSpec, error) {
	if _, err := Compile(Config{TokenSetting: cfg.TokenSetting, LockSetting: cfg.LockSetting, Tables: cfg.Tables, MaxCheckBytes: cfg.MaxCheckBytes}); err != nil {
		return nil, err
	}
	out := make([]TableSpec, 0, len(cfg.Tables))
	for i, t := range cfg.Tables {
		key := fmt.Sprintf("tables[%d]", i)
		tr, schema, rel, err := compileTable(key, t)
		if err != nil {
			return nil, err
		}
		s := TableSpec{Index: i, Schema: schema, Table: rel, Display: quoteIdent(schema) + "." + quoteIdent(rel), Mode: ModeOff, Lock: LockOff, Scope: t.Scope}
		if tr != nil {
			s.Column = tr.column
			s.Mode = ModeEnforce
			if tr.audit {
				s.Mode = ModeAudit
			}
			s.Lock = [...]string{LockOptional, LockRequired, LockOff}[tr.lock]
		}
		out = append(out, s)
	}
	return out, nil
}
