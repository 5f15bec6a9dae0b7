package dbsetup

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
)

// The database guard (SetupOptions.Guard): on each protected table in mode
// enforce, a BEFORE INSERT OR UPDATE OR DELETE row trigger that applies
// the table's fence inside PostgreSQL (a token is needed, a stale one is
// refused, rows are stamped, the token is registered for the session's
// lock), and a BEFORE TRUNCATE statement trigger on the table and each of
// its partitions that refuses TRUNCATE. Writes the proxy cannot see —
// functions, dynamic SQL, cascades, sessions that bypass the proxy — are
// then fenced too. guard.sql has the SQL.

// guardSQL is guard.sql, a text/template: run as it is, it installs the
// objects every guarded table shares; its "row" template is the body of a
// table's row trigger function, fenceproxy."guard_<table>".
//
//go:embed guard.sql
var guardSQL string

var guardTemplate = template.Must(template.New("guard.sql").Funcs(template.FuncMap{"lit": quoteLiteral}).Parse(guardSQL))

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

// guardConfig is what the guard takes from the configuration besides the
// entries' TableSpecs.
type guardConfig struct {
	tokenSetting, lockSetting string
	tables                    []rules.Table // indexed by TableSpec.Index; nil: defaults
	exemptRoles               []string      // sorted, without duplicates
}

func newGuardConfig(tokenSetting, lockSetting string, tables []rules.Table, exempt []string) guardConfig {
	if tokenSetting == "" {
		tokenSetting = rules.DefaultTokenSetting
	}
	if lockSetting == "" {
		lockSetting = rules.DefaultLockSetting
	}
	roles := slices.Clone(exempt)
	slices.Sort(roles)
	// PostgreSQL looks setting names up case-insensitively and stores
	// them in lower case, as rules.Compile does.
	return guardConfig{tokenSetting: strings.ToLower(tokenSetting), lockSetting: strings.ToLower(lockSetting),
		tables: tables, exemptRoles: slices.Compact(roles)}
}

// params returns how entry s fences its table, as the guard needs it.
func (g guardConfig) params(s rules.TableSpec) (rowParams, error) {
	p := rowParams{Display: s.Display, Lock: s.Lock, TokenSetting: g.tokenSetting, LockSetting: g.lockSetting}
	if s.Column != "" {
		p.Column, p.column = quoteIdent(s.Column), s.Column
	}
	if g.tables != nil {
		if s.Index < 0 || s.Index >= len(g.tables) {
			return p, fmt.Errorf("dbsetup: tables[%d] (%s) is not among the %d configured tables given for the guard", s.Index, s.Display, len(g.tables))
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

func (f guardFunction) qualified() string { return "fenceproxy." + quoteIdent(f.name) }

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

// planGuard works out which tables of specs the guard belongs on in
// database db: those whose entries here are all in mode enforce, fence
// alike, and include one for every session (no scope.users or
// scope.application_names). The guard sees every session the same way, so
// it must not fence sessions that the configuration audits or leaves
// alone, as it would during a staged rollout.
func planGuard(specs []rules.TableSpec, db string, g guardConfig) ([]*guardTarget, []unguarded, error) {
	var targets []*guardTarget
	var skipped []unguarded
	for _, t := range entriesByTable(specs, db) {
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

// entriesByTable groups the entries that apply in db by table, in configuration
// order.
func entriesByTable(specs []rules.TableSpec, db string) [][]rules.TableSpec {
	var out [][]rules.TableSpec
	index := map[[2]string]int{}
	for _, s := range specs {
		if !appliesIn(s, db) {
			continue
		}
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

// quoteIdent quotes an identifier for SQL, always, so that generated text
// does not depend on the server's list of keywords.
func quoteIdent(s string) string { return `"` + strings.ReplaceAll(s, `"`, `""`) + `"` }

// quoteLiteral quotes s as an SQL string constant that reads the same
// whatever standard_conforming_strings is.
func quoteLiteral(s string) string {
	q := "'" + strings.ReplaceAll(s, "'", "''") + "'"
	if strings.Contains(s, `\`) {
		q = "E" + strings.ReplaceAll(q, `\`, `\\`)
	}
	return q
}

// literals quotes each string and joins them with ", ".
func literals(ss []string) string {
	q := make([]string, len(ss))
	for i, s := range ss {
		q[i] = quoteLiteral(s)
	}
	return strings.Join(q, ", ")
}
