package guard

import (
	"crypto/sha256"
	_ "embed"
	"encoding/hex"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"text/template"
	"unicode/utf8"

	"github.com/fenceproxy/fenceproxy/internal/rules"
	"github.com/fenceproxy/fenceproxy/internal/sqllex"
)

// Result is what Install, Remove and Leave did and found; internal/dbsetup
// adds it to its Report.
type Result struct {
	// Actions lists what was changed, in order.
	Actions []string
	// Notes is information that needs no action.
	Notes []Note
}

// Note is information that is not a problem, about the table Table
// (rules.TableSpec.Display; "" for the database as a whole).
type Note struct {
	Table, Text string
}

// Problem is what Check finds wrong with the guard.
type Problem struct {
	// Table is the protected table (rules.TableSpec.Display), "" for a
	// problem of the database as a whole.
	Table       string
	Description string
	// Fix is what to do by hand; "" when `fenceproxy setup --guard` fixes
	// it.
	Fix string
}

// setupProblem returns a problem that `fenceproxy setup --guard` fixes.
func setupProblem(table, description string) Problem {
	return Problem{Table: table, Description: description}
}

// guardSQL is guard.sql, a text/template: run as it is, it installs the
// objects every guarded table shares; its "row" template is the body of a
// table's row trigger function, fenceproxy."guard_<table>".
//
//go:embed guard.sql
var guardSQL string

var guardTemplate = template.Must(template.New("guard.sql").Funcs(template.FuncMap{"lit": sqllex.QuoteLiteral}).Parse(guardSQL))

// guardSharedSQL is guard.sql without the row template.
var guardSharedSQL = func() string {
	var b strings.Builder
	if err := guardTemplate.Execute(&b, nil); err != nil {
		panic(err)
	}
	return b.String()
}()

// Names of the guard's triggers and functions (in schema fenceproxy).
const (
	guardRowTrigger      = "fenceproxy_guard"
	guardTruncateTrigger = "fenceproxy_guard_truncate"
	guardTableFuncPrefix = "guard_" // + the table's display name: its row function
	guardTruncateFunc    = "guard_truncate"
	guardExemptedFunc    = "guard_exempted"
	guardDDLFunc         = "guard_ddl"
	guardDDLTrigger      = "fenceproxy_guard_ddl"     // the event trigger on ddl_command_end
	guardRewriteTrigger  = "fenceproxy_guard_rewrite" // the event trigger on table_rewrite
)

// pg_trigger.tgtype bits (catalog/pg_trigger.h).
const (
	tgRow      = 1 << 0
	tgBefore   = 1 << 1
	tgInsert   = 1 << 2
	tgDelete   = 1 << 3
	tgUpdate   = 1 << 4
	tgTruncate = 1 << 5

	rowGuardType      = tgRow | tgBefore | tgInsert | tgDelete | tgUpdate
	truncateGuardType = tgBefore | tgTruncate
)

// guardSearchPath is the proconfig of every guard function.
const guardSearchPath = "search_path=pg_catalog, pg_temp"

// Config is what the guard takes from the configuration besides the
// entries' TableSpecs. The zero value stands for the defaults.
type Config struct {
	// TokenSetting and LockSetting are the session settings that carry
	// the token and the lock name, as the configuration's token_setting
	// and lock_setting. Default rules.DefaultTokenSetting and
	// rules.DefaultLockSetting.
	TokenSetting, LockSetting string
	// Tables are the configuration's entries (rules.Config.Tables), which
	// TableSpec.Index indexes: the guard takes their on_stale, strict and
	// missing_token. nil takes the defaults for every entry.
	Tables []rules.Table
	// ExemptRoles are the roles whose sessions the guard lets write
	// without a token or a lock name (guard.exempt_roles).
	ExemptRoles []string
}

// guardConfig is Config with the defaults filled in.
type guardConfig struct {
	tokenSetting, lockSetting string
	tables                    []rules.Table // indexed by TableSpec.Index; nil: defaults
	exemptRoles               []string      // sorted, without duplicates
}

func newGuardConfig(c Config) guardConfig {
	tokenSetting, lockSetting := c.TokenSetting, c.LockSetting
	if tokenSetting == "" {
		tokenSetting = rules.DefaultTokenSetting
	}
	if lockSetting == "" {
		lockSetting = rules.DefaultLockSetting
	}
	roles := slices.Clone(c.ExemptRoles)
	slices.Sort(roles)
	// PostgreSQL looks setting names up case-insensitively and stores
	// them in lower case, as rules.Compile does.
	return guardConfig{tokenSetting: strings.ToLower(tokenSetting), lockSetting: strings.ToLower(lockSetting),
		tables: c.Tables, exemptRoles: slices.Compact(roles)}
}

// params returns how entry s fences its table, as the guard needs it.
func (g guardConfig) params(s rules.TableSpec) (rowParams, error) {
	p := rowParams{Display: s.Display, Lock: s.Lock, TokenSetting: g.tokenSetting, LockSetting: g.lockSetting}
	if s.Column != "" {
		p.Column, p.column = sqllex.QuoteIdent(s.Column), s.Column
	}
	if g.tables != nil {
		if s.Index < 0 || s.Index >= len(g.tables) {
			return p, fmt.Errorf("guard: tables[%d] (%s) is not among the %d configured tables given for the guard", s.Index, s.Display, len(g.tables))
		}
		t := g.tables[s.Index]
		p.Strict, p.Skip, p.Allow = t.Strict, t.OnStale == rules.OnStaleSkip, t.MissingToken == rules.MissingTokenAllow
	}
	p.Header = p.header()
	return p, nil
}

// rowParams is what the row function of a table is generated from (the
// "row" template of guard.sql).
type rowParams struct {
	Display      string // the table, for messages
	Column       string // the fence column quoted for SQL; "" for none
	Lock         string // rules.LockOptional, LockRequired or LockOff
	Strict       bool
	Skip         bool // on_stale: skip
	Allow        bool // missing_token: allow
	TokenSetting string
	LockSetting  string
	Header       string // the settings, for the function's first line
	column       string // Column unquoted
}

// header describes the settings in one line (strings in Go syntax, so that
// no character of a name can end the SQL comment that holds it).
func (p rowParams) header() string {
	col := "none"
	if p.column != "" {
		col = strconv.Quote(p.column)
	}
	onStale, missing := rules.OnStaleError, rules.MissingTokenReject
	if p.Skip {
		onStale = rules.OnStaleSkip
	}
	if p.Allow {
		missing = rules.MissingTokenAllow
	}
	return fmt.Sprintf("guard of %s: column %s, lock %s, on_stale %s, strict %t, missing_token %s, token_setting %s, lock_setting %s",
		strconv.Quote(p.Display), col, p.Lock, onStale, p.Strict, missing, strconv.Quote(p.TokenSetting), strconv.Quote(p.LockSetting))
}

// guardFunction is the row trigger function of a table.
type guardFunction struct {
	name   string // in schema fenceproxy, unquoted
	body   string // prosrc
	header string // the settings it was generated for
}

// rowFunction returns the row trigger function of the table p describes.
func rowFunction(p rowParams) guardFunction {
	name := guardTableFuncPrefix + p.Display
	if len(name) > 63 { // NAMEDATALEN-1: cut at a character boundary, tell apart by a hash
		sum := sha256.Sum256([]byte(p.Display))
		suffix := "_" + hex.EncodeToString(sum[:4])
		cut := 63 - len(suffix)
		for cut > 0 && !utf8.RuneStart(name[cut]) {
			cut--
		}
		name = name[:cut] + suffix
	}
	var b strings.Builder
	if err := guardTemplate.ExecuteTemplate(&b, "row", p); err != nil {
		panic(err)
	}
	return guardFunction{name: name, body: b.String(), header: p.Header}
}

// headerOf returns the settings line of a row function's body, "" if it
// has none.
func headerOf(body string) string {
	line, _, _ := strings.Cut(strings.TrimPrefix(body, "\n"), "\n")
	h, ok := strings.CutPrefix(line, "-- ")
	if !ok {
		return ""
	}
	return h
}

func (f guardFunction) qualified() string { return "fenceproxy." + sqllex.QuoteIdent(f.name) }

// createSQL creates or replaces the function. The body is dollar-quoted
// with a tag it does not contain (a quoted column name may hold "$body$").
func (f guardFunction) createSQL() string {
	tag := "$body$"
	for i := 1; strings.Contains(f.body, tag); i++ {
		tag = "$body" + strconv.Itoa(i) + "$"
	}
	return "CREATE OR REPLACE FUNCTION " + f.qualified() + "() RETURNS trigger\n" +
		"LANGUAGE plpgsql\nSECURITY DEFINER\nSET search_path = pg_catalog, pg_temp\n" +
		"AS " + tag + f.body + tag + ";\n" +
		"REVOKE ALL ON FUNCTION " + f.qualified() + "() FROM PUBLIC;"
}

// functionDef is a guard function as setup creates it.
type functionDef struct {
	name    string
	body    string
	lang    string
	definer bool // SECURITY DEFINER
	trigger bool // RETURNS trigger
}

// sharedFunctions are guard.sql's own functions.
var sharedFunctions = []functionDef{
	{name: guardExemptedFunc, body: sharedBody(guardExemptedFunc), lang: "sql"},
	{name: guardTruncateFunc, body: sharedBody(guardTruncateFunc), lang: "plpgsql", definer: true, trigger: true},
	{name: guardDDLFunc, body: sharedBody(guardDDLFunc), lang: "plpgsql", definer: true},
}

// sharedBody returns the body of function fenceproxy.name in guard.sql.
func sharedBody(name string) string {
	_, rest, ok := strings.Cut(guardSharedSQL, "FUNCTION fenceproxy."+name+"()")
	if !ok {
		panic("guard.sql: no function " + name)
	}
	_, rest, _ = strings.Cut(rest, "AS $body$")
	body, _, _ := strings.Cut(rest, "$body$;")
	return body
}

// guardTarget is a table the guard belongs on.
type guardTarget struct {
	spec rules.TableSpec // its first entry
	fn   guardFunction
}

// unguarded is a table of the configuration the guard must not be on.
type unguarded struct {
	spec   rules.TableSpec
	reason string
}

// planGuard works out which tables of specs, the entries that apply in
// this database, the guard belongs on: those whose entries are all in
// mode enforce, fence alike, and include one for every session (no scope.users or
// scope.application_names). The guard sees every session the same way, so
// it must not fence sessions that the configuration audits or leaves
// alone, as it would during a staged rollout.
func planGuard(specs []rules.TableSpec, g guardConfig) ([]*guardTarget, []unguarded, error) {
	var targets []*guardTarget
	var skipped []unguarded
	for _, t := range entriesByTable(specs) {
		var params *rowParams
		all, reason := false, ""
		for _, s := range t {
			if s.Mode != rules.ModeEnforce {
				reason = "an entry in mode audit applies to it (audit never refuses a write; the guard would)"
				break
			}
			p, err := g.params(s)
			if err != nil {
				return nil, nil, err
			}
			if params == nil {
				params = &p
			} else if p != *params {
				reason = "its entries fence it differently for different sessions, which the guard cannot tell apart"
				break
			}
			all = all || len(s.Scope.Users) == 0 && len(s.Scope.ApplicationNames) == 0
		}
		if reason == "" && !all {
			reason = "its entries apply only to some sessions (scope.users or scope.application_names), and the guard would fence every session"
		}
		if reason != "" {
			skipped = append(skipped, unguarded{spec: t[0], reason: reason})
			continue
		}
		targets = append(targets, &guardTarget{spec: t[0], fn: rowFunction(*params)})
	}
	return targets, skipped, nil
}

// entriesByTable groups the entries by table, in configuration order.
func entriesByTable(specs []rules.TableSpec) [][]rules.TableSpec {
	var out [][]rules.TableSpec
	index := map[[2]string]int{}
	for _, s := range specs {
		k := [2]string{s.Schema, s.Table}
		i, ok := index[k]
		if !ok {
			i = len(out)
			index[k] = i
			out = append(out, nil)
		}
		out[i] = append(out[i], s)
	}
	return out
}

// def is the function as setup creates it.
func (f guardFunction) def() functionDef {
	return functionDef{name: f.name, body: f.body, lang: "plpgsql", definer: true, trigger: true}
}

// literals quotes each string and joins them with ", ".
func literals(ss []string) string {
	q := make([]string, len(ss))
	for i, s := range ss {
		q[i] = sqllex.QuoteLiteral(s)
	}
	return strings.Join(q, ", ")
}
