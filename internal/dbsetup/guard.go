package dbsetup

import (
	"context"
	"crypto/sha256"
	_ "embed"
	"encoding/hex"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"text/template"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"

	"github.com/fenceproxy/fenceproxy/rules"
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

// guardTrig is a trigger named like one of the guard's.
type guardTrig struct {
	rel     uint32
	relName string // qualified for SQL
	name    string
	ours    bool   // its function is in schema fenceproxy
	fn      string // the function's name (schema-qualified when not ours)
	typ     int16
	enabled string // pg_trigger.tgenabled
	clone   bool   // inherited from a partitioned table's trigger
	extra   bool   // a WHEN condition or UPDATE OF columns
	args    []string
}

// readGuardTriggers returns every trigger of the database named like one
// of the guard's, with its arguments decoded from pg_trigger.tgargs (each
// NUL-terminated, in the server encoding).
func readGuardTriggers(ctx context.Context, tx pgx.Tx) ([]guardTrig, error) {
	rows, err := tx.Query(ctx, `
		SELECT t.tgrelid, format('%I.%I', n.nspname, c.relname), t.tgname::text,
			pn.nspname = 'fenceproxy', CASE WHEN pn.nspname = 'fenceproxy' THEN p.proname::text ELSE format('%I.%I', pn.nspname, p.proname) END,
			t.tgtype, t.tgenabled::text, t.tgparentid <> 0,
			t.tgqual IS NOT NULL OR pg_catalog.cardinality(t.tgattr::pg_catalog.int2[]) > 0,
			ARRAY(
				WITH RECURSIVE a(i, arg, rest) AS (
					SELECT 0, NULL::bytea, t.tgargs
					UNION ALL
					SELECT i + 1, substring(rest FOR position(nul IN rest) - 1), substring(rest FROM position(nul IN rest) + 1)
					FROM a, (SELECT pg_catalog.decode('00', 'hex') AS nul) z WHERE position(nul IN rest) > 0)
				SELECT pg_catalog.convert_from(arg, pg_catalog.current_setting('server_encoding')) FROM a WHERE i > 0 ORDER BY i)
		FROM pg_catalog.pg_trigger t
		JOIN pg_catalog.pg_class c ON c.oid = t.tgrelid
		JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
		JOIN pg_catalog.pg_proc p ON p.oid = t.tgfoid
		JOIN pg_catalog.pg_namespace pn ON pn.oid = p.pronamespace
		WHERE t.tgname IN ($1, $2)
		ORDER BY 2, 3`, guardRowTrigger, guardTruncateTrigger)
	if err != nil {
		return nil, fmt.Errorf("read the guard's triggers: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (guardTrig, error) {
		var g guardTrig
		err := row.Scan(&g.rel, &g.relName, &g.name, &g.ours, &g.fn, &g.typ, &g.enabled, &g.clone, &g.extra, &g.args)
		return g, err
	})
	if err != nil {
		return nil, fmt.Errorf("read the guard's triggers: %w", err)
	}
	return out, nil
}

// guardTriggersOn indexes triggers by relation.
func guardTriggersOn(trigs []guardTrig) map[uint32][]guardTrig {
	m := map[uint32][]guardTrig{}
	for _, t := range trigs {
		m[t.rel] = append(m[t.rel], t)
	}
	return m
}

func findTrig(ts []guardTrig, name string) *guardTrig {
	for i := range ts {
		if ts[i].name == name {
			return &ts[i]
		}
	}
	return nil
}

// partition is a partition of a protected table, at any depth.
type partition struct {
	oid       uint32
	qualified string
}

func partitionsOf(ctx context.Context, tx pgx.Tx, rel *relation) ([]partition, error) {
	if rel.kind != "p" {
		return nil, nil
	}
	rows, err := tx.Query(ctx, `
		SELECT c.oid, format('%I.%I', n.nspname, c.relname)
		FROM pg_catalog.pg_partition_tree($1::oid::pg_catalog.regclass) t
		JOIN pg_catalog.pg_class c ON c.oid = t.relid
		JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
		WHERE t.relid <> $1::oid::pg_catalog.regclass
		ORDER BY t.level, 2`, rel.oid)
	if err != nil {
		return nil, fmt.Errorf("list the partitions of %s: %w", rel.qualified, err)
	}
	out, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (partition, error) {
		var p partition
		err := row.Scan(&p.oid, &p.qualified)
		return p, err
	})
	if err != nil {
		return nil, fmt.Errorf("list the partitions of %s: %w", rel.qualified, err)
	}
	return out, nil
}

// placedGuard is a guard target whose table exists here.
type placedGuard struct {
	*guardTarget
	rel   *relation
	parts []partition
}

// placeGuard looks up the targets' tables. A target whose table is
// missing, is not a table, lacks its fence column or is a partition that
// inherits a guard from its partitioned table is left out, with a note
// when setup or check does not already say why.
func placeGuard(ctx context.Context, tx pgx.Tx, targets []*guardTarget) ([]placedGuard, []Note, error) {
	var out []placedGuard
	var notes []Note
	for _, t := range targets {
		rel, err := lookupTable(ctx, tx, t.spec.Schema, t.spec.Table)
		if err != nil {
			return nil, nil, err
		}
		if rel == nil || !rel.isTable() {
			continue // noted or reported elsewhere
		}
		if t.spec.Column != "" {
			col, err := lookupColumn(ctx, tx, rel, t.spec.Column)
			if err != nil {
				return nil, nil, err
			}
			if !col.exists {
				notes = append(notes, Note{Table: t.spec.Display, Text: fmt.Sprintf("not guarded: its fence column %s is missing", col.quoted)})
				continue
			}
		}
		if rel.isPartition {
			var inherited bool
			err := tx.QueryRow(ctx, `SELECT EXISTS (SELECT FROM pg_catalog.pg_trigger WHERE tgrelid = $1 AND tgname = $2 AND tgparentid <> 0)`,
				rel.oid, guardRowTrigger).Scan(&inherited)
			if err != nil {
				return nil, nil, fmt.Errorf("read the triggers of %s: %w", rel.qualified, err)
			}
			if inherited {
				notes = append(notes, Note{Table: t.spec.Display, Text: "not guarded on its own: it is a partition, and its partitioned table's guard applies to it"})
				continue
			}
		}
		parts, err := partitionsOf(ctx, tx, rel)
		if err != nil {
			return nil, nil, err
		}
		out = append(out, placedGuard{guardTarget: t, rel: rel, parts: parts})
	}
	return out, notes, nil
}

// rowTriggerIssue says what is wrong with the row trigger of p, "" when
// it is as setup installs it.
func (p placedGuard) rowTriggerIssue(on map[uint32][]guardTrig) string {
	tr := findTrig(on[p.rel.oid], guardRowTrigger)
	switch {
	case tr == nil:
		return "trigger " + guardRowTrigger + " is missing"
	case tr.clone:
		return "trigger " + guardRowTrigger + " is inherited from a partitioned table"
	case !tr.ours || tr.fn != p.fn.name:
		return fmt.Sprintf("trigger %s calls %s, not %s", guardRowTrigger, tr.displayFn(), p.fn.qualified())
	case tr.typ != rowGuardType || tr.extra || len(tr.args) > 0:
		return "trigger " + guardRowTrigger + " is not BEFORE INSERT OR UPDATE OR DELETE FOR EACH ROW without arguments or conditions"
	case !enabled(tr.enabled):
		return "trigger " + guardRowTrigger + " is disabled"
	}
	for _, part := range p.parts {
		if c := findTrig(on[part.oid], guardRowTrigger); c == nil || !enabled(c.enabled) {
			return fmt.Sprintf("trigger %s is missing or disabled on partition %s", guardRowTrigger, part.qualified)
		}
	}
	return ""
}

// truncateTriggerIssue says what is wrong with the TRUNCATE trigger of
// relation oid (p's table or one of its partitions), "" when nothing is.
func (p placedGuard) truncateTriggerIssue(on map[uint32][]guardTrig, oid uint32, name string) string {
	what := "trigger " + guardTruncateTrigger
	if oid != p.rel.oid {
		what += " of partition " + name
	}
	tr := findTrig(on[oid], guardTruncateTrigger)
	switch {
	case tr == nil:
		return what + " is missing"
	case tr.clone || !tr.ours || tr.fn != guardTruncateFunc:
		return fmt.Sprintf("%s calls %s, not fenceproxy.%s", what, tr.displayFn(), guardTruncateFunc)
	case tr.typ != truncateGuardType || tr.extra:
		return what + " is not BEFORE TRUNCATE FOR EACH STATEMENT"
	case !slices.Equal(tr.args, []string{p.spec.Display}):
		return fmt.Sprintf("%s has the arguments (%s); the configuration needs (%s)", what, literals(tr.args), literals([]string{p.spec.Display}))
	case !enabled(tr.enabled):
		return what + " is disabled"
	}
	return ""
}

func (t *guardTrig) displayFn() string {
	if t.ours {
		return "fenceproxy." + quoteIdent(t.fn)
	}
	return t.fn
}

// enabled reports whether a trigger fires in ordinary sessions: 'O' (on
// origin, the default) or 'A' (always). 'D' is disabled, 'R' fires only
// under session_replication_role = replica.
func enabled(tgenabled string) bool { return tgenabled == "O" || tgenabled == "A" }

func rowTriggerSQL(p placedGuard) string {
	return "CREATE OR REPLACE TRIGGER " + guardRowTrigger + " BEFORE INSERT OR UPDATE OR DELETE ON " + p.rel.qualified +
		" FOR EACH ROW EXECUTE FUNCTION " + p.fn.qualified() + "()"
}

func truncateTriggerSQL(qualified, display string) string {
	return "CREATE OR REPLACE TRIGGER " + guardTruncateTrigger + " BEFORE TRUNCATE ON " + qualified +
		" FOR EACH STATEMENT EXECUTE FUNCTION fenceproxy." + guardTruncateFunc + "(" + quoteLiteral(display) + ")"
}

// guardFunctionState is a guard function as the catalog has it.
type guardFunctionState struct {
	body    string
	definer bool
	config  []string
	lang    string
	trigger bool // returns trigger
	nargs   int16
	used    bool // some trigger calls it
}

func readGuardFunctions(ctx context.Context, tx pgx.Tx) (map[string]guardFunctionState, error) {
	rows, err := tx.Query(ctx, `
		SELECT p.proname::text, p.prosrc, p.prosecdef, coalesce(p.proconfig, '{}'), l.lanname::text,
			p.prorettype = 'pg_catalog.trigger'::pg_catalog.regtype, p.pronargs,
			EXISTS (SELECT FROM pg_catalog.pg_trigger t WHERE t.tgfoid = p.oid)
		FROM pg_catalog.pg_proc p
		JOIN pg_catalog.pg_namespace n ON n.oid = p.pronamespace
		JOIN pg_catalog.pg_language l ON l.oid = p.prolang
		WHERE n.nspname = 'fenceproxy' AND p.proname LIKE 'guard%'`)
	if err != nil {
		return nil, fmt.Errorf("read the guard's functions: %w", err)
	}
	defer rows.Close()
	m := map[string]guardFunctionState{}
	for rows.Next() {
		var name string
		var f guardFunctionState
		if err := rows.Scan(&name, &f.body, &f.definer, &f.config, &f.lang, &f.trigger, &f.nargs, &f.used); err != nil {
			return nil, fmt.Errorf("read the guard's functions: %w", err)
		}
		if f.nargs == 0 { // overloads with arguments are not the guard's
			m[name] = f
		}
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("read the guard's functions: %w", err)
	}
	return m, nil
}

// isRowFunction reports whether name is the name of a table's row
// function.
func isRowFunction(name string) bool {
	return strings.HasPrefix(name, guardTableFuncPrefix) && name != guardTruncateFunc && name != guardExemptedFunc
}

// is reports whether f is the function setup creates as d (every guard
// function sets search_path).
func (f guardFunctionState) is(d functionDef) bool {
	return f.body == d.body && f.lang == d.lang && f.definer == d.definer && f.trigger == d.trigger &&
		slices.Equal(f.config, []string{guardSearchPath})
}

// def is the function as setup creates it.
func (f guardFunction) def() functionDef {
	return functionDef{name: f.name, body: f.body, lang: "plpgsql", definer: true, trigger: true}
}

// guardInstalled reports whether fenceproxy.meta says the guard was
// installed in this database.
func guardInstalled(ctx context.Context, tx pgx.Tx, obj objects) (bool, error) {
	if !obj.meta {
		return false, nil
	}
	var ok bool
	if err := tx.QueryRow(ctx, `SELECT EXISTS (SELECT FROM fenceproxy.meta WHERE key = 'guard')`).Scan(&ok); err != nil {
		return false, fmt.Errorf("read fenceproxy.meta: %w", err)
	}
	return ok, nil
}

// readExempt returns fenceproxy.guard_exempt's roles, sorted, and whether
// the table exists.
func readExempt(ctx context.Context, tx pgx.Tx) ([]string, bool, error) {
	var exists bool
	err := tx.QueryRow(ctx, `SELECT EXISTS (SELECT FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
		WHERE n.nspname = 'fenceproxy' AND c.relname = 'guard_exempt' AND c.relkind = 'r')`).Scan(&exists)
	if err != nil || !exists {
		return nil, false, err
	}
	rows, err := tx.Query(ctx, `SELECT role::text FROM fenceproxy.guard_exempt`)
	if err != nil {
		return nil, true, fmt.Errorf("read fenceproxy.guard_exempt: %w", err)
	}
	roles, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, true, fmt.Errorf("read fenceproxy.guard_exempt: %w", err)
	}
	slices.Sort(roles)
	return roles, true, nil
}

// missingRoles returns the roles of names that do not exist, sorted.
func missingRoles(ctx context.Context, tx pgx.Tx, names []string) ([]string, error) {
	if len(names) == 0 {
		return nil, nil
	}
	rows, err := tx.Query(ctx, `SELECT r FROM pg_catalog.unnest($1::text[]) r
		WHERE NOT EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname = r)`, names)
	if err != nil {
		return nil, fmt.Errorf("look up the exempt roles: %w", err)
	}
	missing, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, fmt.Errorf("look up the exempt roles: %w", err)
	}
	slices.Sort(missing)
	return missing, nil
}

// installGuard brings the guard in line with specs: it installs guard.sql
// and the row functions the tables need, sets the exempt roles, creates or
// replaces the triggers that differ, and removes the guard from tables it
// no longer belongs on and the functions no table uses.
func installGuard(ctx context.Context, tx pgx.Tx, specs []rules.TableSpec, g guardConfig, rep *Report) error {
	targets, skipped, err := planGuard(specs, rep.Database, g)
	if err != nil {
		return err
	}
	placed, notes, err := placeGuard(ctx, tx, targets)
	if err != nil {
		return err
	}
	rep.Notes = append(rep.Notes, notes...)
	for _, u := range skipped {
		rel, err := lookupTable(ctx, tx, u.spec.Schema, u.spec.Table)
		if err != nil {
			return err
		}
		if rel != nil {
			rep.Notes = append(rep.Notes, Note{Table: u.spec.Display, Text: "not guarded: " + u.reason})
		}
	}
	if missing, err := missingRoles(ctx, tx, g.exemptRoles); err != nil {
		return err
	} else if len(missing) > 0 {
		return fmt.Errorf("guard.exempt_roles: no such role: %s", strings.Join(missing, ", "))
	}

	// The shared objects: rolled back when they were already in place, as
	// installObjects does.
	before, err := guardFingerprint(ctx, tx)
	if err != nil {
		return err
	}
	had := slices.ContainsFunc(before, func(s string) bool { return strings.HasPrefix(s, "guard ") })
	if _, err := tx.Exec(ctx, "SAVEPOINT fenceproxy_guard"); err != nil {
		return err
	}
	if _, err := tx.Exec(ctx, guardSharedSQL); err != nil {
		return fmt.Errorf("install the guard: %w", err)
	}
	after, err := guardFingerprint(ctx, tx)
	if err != nil {
		return err
	}
	if slices.Equal(before, after) {
		if _, err := tx.Exec(ctx, "ROLLBACK TO SAVEPOINT fenceproxy_guard"); err != nil {
			return err
		}
	} else {
		if _, err := tx.Exec(ctx, "RELEASE SAVEPOINT fenceproxy_guard"); err != nil {
			return err
		}
		if had {
			rep.Actions = append(rep.Actions, "updated the database guard's shared functions and table")
		} else {
			rep.Actions = append(rep.Actions, "installed the database guard (its functions and table fenceproxy.guard_exempt)")
		}
	}

	roles, _, err := readExempt(ctx, tx)
	if err != nil {
		return err
	}
	if !slices.Equal(roles, g.exemptRoles) {
		if _, err := tx.Exec(ctx, `DELETE FROM fenceproxy.guard_exempt`); err != nil {
			return fmt.Errorf("set the exempt roles: %w", err)
		}
		if _, err := tx.Exec(ctx, `INSERT INTO fenceproxy.guard_exempt (role) SELECT pg_catalog.unnest($1::text[])`, g.exemptRoles); err != nil {
			return fmt.Errorf("set the exempt roles: %w", err)
		}
		if len(g.exemptRoles) == 0 {
			rep.Actions = append(rep.Actions, "cleared the roles the guard exempts")
		} else {
			rep.Actions = append(rep.Actions, "set the roles the guard exempts to "+strings.Join(g.exemptRoles, ", "))
		}
	}

	trigs, err := readGuardTriggers(ctx, tx)
	if err != nil {
		return err
	}
	fstate, err := readGuardFunctions(ctx, tx)
	if err != nil {
		return err
	}
	on := guardTriggersOn(trigs)
	keep := map[uint32]bool{}
	for _, p := range placed {
		keep[p.rel.oid] = true
		fresh := len(on[p.rel.oid]) == 0
		var did bool
		if st, ok := fstate[p.fn.name]; !ok || !st.is(p.fn.def()) {
			if _, err := tx.Exec(ctx, p.fn.createSQL()); err != nil {
				return fmt.Errorf("create the guard's function %s: %w", p.fn.qualified(), err)
			}
			did = true
		}
		if p.rowTriggerIssue(on) != "" {
			if _, err := tx.Exec(ctx, rowTriggerSQL(p)); err != nil {
				return fmt.Errorf("create the guard's row trigger on %s: %w", p.rel.qualified, err)
			}
			did = true
		}
		rels := append([]partition{{p.rel.oid, p.rel.qualified}}, p.parts...)
		for _, r := range rels {
			keep[r.oid] = true
			if p.truncateTriggerIssue(on, r.oid, r.qualified) == "" {
				continue
			}
			if _, err := tx.Exec(ctx, truncateTriggerSQL(r.qualified, p.spec.Display)); err != nil {
				return fmt.Errorf("create the guard's TRUNCATE trigger on %s: %w", r.qualified, err)
			}
			did = true
		}
		switch {
		case did && fresh:
			rep.Actions = append(rep.Actions, "installed the guard on "+p.rel.qualified)
		case did:
			rep.Actions = append(rep.Actions, "updated the guard on "+p.rel.qualified)
		}
	}
	// The guard leaves only the tables the configuration does not guard
	// here: a target that could not be placed (its fence column is
	// missing) keeps its guard until that is fixed.
	for _, t := range targets {
		if rel, err := lookupTable(ctx, tx, t.spec.Schema, t.spec.Table); err != nil {
			return err
		} else if rel != nil {
			keep[rel.oid] = true
		}
	}
	removed, err := dropGuardTriggers(ctx, tx, trigs, func(oid uint32) bool { return !keep[oid] })
	if err != nil {
		return err
	}
	for _, name := range removed {
		rep.Actions = append(rep.Actions, "removed the guard from "+name+": the configuration does not guard it in this database")
	}

	if fstate, err = readGuardFunctions(ctx, tx); err != nil {
		return err
	}
	var unused []string
	for name, f := range fstate {
		if !f.used && isRowFunction(name) {
			unused = append(unused, name)
		}
	}
	slices.Sort(unused)
	for _, name := range unused {
		q := "fenceproxy." + quoteIdent(name)
		if _, err := tx.Exec(ctx, "DROP FUNCTION "+q+"()"); err != nil {
			return fmt.Errorf("drop the unused guard function %s: %w", q, err)
		}
		rep.Actions = append(rep.Actions, "dropped "+q+"(), which no trigger uses any more")
	}
	return nil
}

// dropGuardTriggers drops the guard's triggers (not inherited ones) on the
// relations drop selects, and returns those relations' names.
func dropGuardTriggers(ctx context.Context, tx pgx.Tx, trigs []guardTrig, drop func(oid uint32) bool) ([]string, error) {
	var names []string
	for _, t := range trigs {
		if !t.ours || t.clone || !drop(t.rel) {
			continue
		}
		if _, err := tx.Exec(ctx, "DROP TRIGGER "+quoteIdent(t.name)+" ON "+t.relName); err != nil {
			return nil, fmt.Errorf("drop the guard's trigger %s on %s: %w", t.name, t.relName, err)
		}
		if !slices.Contains(names, t.relName) {
			names = append(names, t.relName)
		}
	}
	return names, nil
}

// removeGuard drops every trigger, function and table of the guard.
func removeGuard(ctx context.Context, tx pgx.Tx, rep *Report) error {
	trigs, err := readGuardTriggers(ctx, tx)
	if err != nil {
		return err
	}
	removed, err := dropGuardTriggers(ctx, tx, trigs, func(uint32) bool { return true })
	if err != nil {
		return err
	}
	for _, name := range removed {
		rep.Actions = append(rep.Actions, "removed the guard from "+name)
	}
	fstate, err := readGuardFunctions(ctx, tx)
	if err != nil {
		return err
	}
	var names []string
	for name := range fstate {
		if isRowFunction(name) || name == guardTruncateFunc || name == guardExemptedFunc {
			names = append(names, name)
		}
	}
	slices.Sort(names)
	_, exempt, err := readExempt(ctx, tx)
	if err != nil {
		return err
	}
	var marked bool
	if err := tx.QueryRow(ctx, `SELECT EXISTS (SELECT FROM fenceproxy.meta WHERE key = 'guard')`).Scan(&marked); err != nil {
		return fmt.Errorf("read fenceproxy.meta: %w", err)
	}
	if len(names) == 0 && !exempt && !marked {
		return nil
	}
	for _, name := range names {
		if _, err := tx.Exec(ctx, "DROP FUNCTION fenceproxy."+quoteIdent(name)+"()"); err != nil {
			return fmt.Errorf("drop guard function %s: %w", name, err)
		}
	}
	if _, err := tx.Exec(ctx, `DROP TABLE IF EXISTS fenceproxy.guard_exempt; DELETE FROM fenceproxy.meta WHERE key = 'guard'`); err != nil {
		return fmt.Errorf("remove the guard: %w", err)
	}
	rep.Actions = append(rep.Actions, "removed the database guard's functions and its table of exempt roles")
	return nil
}

// noteGuard notes, for a setup without --guard, that a guard installed
// earlier was left as it is.
func noteGuard(ctx context.Context, tx pgx.Tx, rep *Report) error {
	trigs, err := readGuardTriggers(ctx, tx)
	if err != nil {
		return err
	}
	var tables []string
	for _, t := range trigs {
		if t.ours && !t.clone && t.name == guardRowTrigger {
			tables = append(tables, t.relName)
		}
	}
	if len(tables) == 0 {
		return nil
	}
	rep.Notes = append(rep.Notes, Note{Text: fmt.Sprintf("the database guard is installed on %s and was left as it is: setup --guard brings it in line with the configuration, --remove-guard removes it",
		strings.Join(tables, ", "))})
	return nil
}

// guardFingerprint is fingerprint plus the guard's mark in fenceproxy.meta.
func guardFingerprint(ctx context.Context, tx pgx.Tx) ([]string, error) {
	fp, err := fingerprint(ctx, tx)
	if err != nil {
		return nil, err
	}
	var v *string
	err = tx.QueryRow(ctx, `SELECT value FROM fenceproxy.meta WHERE key = 'guard'`).Scan(&v)
	if err != nil && !errors.Is(err, pgx.ErrNoRows) {
		return nil, fmt.Errorf("read fenceproxy.meta: %w", err)
	}
	if v != nil {
		fp = append(fp, "guard "+*v)
	}
	return fp, nil
}

// checkGuard checks the guard against specs: where it is installed it
// must be as setup --guard leaves it, and once it is installed in the
// database (fenceproxy.meta has its mark, or a table has its triggers)
// every table it belongs on must have it. It returns the problems and the
// display names of the tables whose guard is in place and current.
func checkGuard(ctx context.Context, tx pgx.Tx, specs []rules.TableSpec, db string, g guardConfig, obj objects) ([]Problem, []string, error) {
	targets, skipped, err := planGuard(specs, db, g)
	if err != nil {
		return nil, nil, err
	}
	trigs, err := readGuardTriggers(ctx, tx)
	if err != nil {
		return nil, nil, err
	}
	marked, err := guardInstalled(ctx, tx, obj)
	if err != nil {
		return nil, nil, err
	}
	var anyTrig bool
	for _, t := range trigs {
		anyTrig = anyTrig || t.ours && !t.clone
	}
	if !marked && !anyTrig {
		return nil, nil, nil
	}
	on := guardTriggersOn(trigs)
	const fix = " --guard"
	var ps []Problem

	// The shared functions and the exempt roles.
	fstate, err := readGuardFunctions(ctx, tx)
	if err != nil {
		return nil, nil, err
	}
	sharedOK := true
	for _, f := range sharedFunctions {
		if st, ok := fstate[f.name]; !ok || !st.is(f) {
			sharedOK = false
			ps = append(ps, setupProblem("", fmt.Sprintf("function fenceproxy.%s of the database guard is missing or not this fenceproxy's", f.name), fix, ""))
		}
	}
	roles, exemptTable, err := readExempt(ctx, tx)
	if err != nil {
		return nil, nil, err
	}
	switch {
	case !exemptTable:
		sharedOK = false
		ps = append(ps, setupProblem("", "table fenceproxy.guard_exempt of the database guard is missing", fix, ""))
	case !slices.Equal(roles, g.exemptRoles):
		ps = append(ps, setupProblem("", fmt.Sprintf("the database guard exempts the roles [%s]; guard.exempt_roles lists [%s]",
			strings.Join(roles, ", "), strings.Join(g.exemptRoles, ", ")), fix, ""))
	}
	if missing, err := missingRoles(ctx, tx, g.exemptRoles); err != nil {
		return nil, nil, err
	} else if len(missing) > 0 {
		ps = append(ps, sqlProblem("", fmt.Sprintf("guard.exempt_roles lists roles that do not exist: %s", strings.Join(missing, ", ")),
			"create the roles, or remove them from guard.exempt_roles, then run fenceproxy setup -c FILE --guard"))
	}

	placed, _, err := placeGuard(ctx, tx, targets)
	if err != nil {
		return nil, nil, err
	}
	var guarded []string
	keep := map[uint32]bool{}
	for _, p := range placed {
		keep[p.rel.oid] = true
		var issues []string
		if i := p.rowTriggerIssue(on); i != "" {
			issues = append(issues, i)
		}
		for _, r := range append([]partition{{p.rel.oid, p.rel.qualified}}, p.parts...) {
			keep[r.oid] = true
			if i := p.truncateTriggerIssue(on, r.oid, r.qualified); i != "" {
				issues = append(issues, i)
			}
		}
		switch st, ok := fstate[p.fn.name]; {
		case !ok:
			issues = append(issues, fmt.Sprintf("function %s is missing", p.fn.qualified()))
		case headerOf(st.body) != p.fn.header:
			issues = append(issues, fmt.Sprintf("function %s was made for an earlier configuration (%s); it now needs %s", p.fn.qualified(), headerOf(st.body), p.fn.header))
		case !st.is(p.fn.def()):
			issues = append(issues, fmt.Sprintf("function %s is not this fenceproxy's (replaced by hand, or installed by another build)", p.fn.qualified()))
		}
		switch {
		case len(on[p.rel.oid]) == 0:
			ps = append(ps, setupProblem(p.spec.Display, "the database guard is installed in this database but not on this table", fix, ""))
		case len(issues) > 0:
			ps = append(ps, setupProblem(p.spec.Display, "the database guard on this table is not as the configuration needs: "+strings.Join(issues, "; "), fix, ""))
		case sharedOK:
			guarded = append(guarded, p.spec.Display)
		}
	}
	for _, u := range skipped {
		rel, err := lookupTable(ctx, tx, u.spec.Schema, u.spec.Table)
		if err != nil {
			return nil, nil, err
		}
		if rel == nil || !slices.ContainsFunc(on[rel.oid], func(t guardTrig) bool { return t.ours && !t.clone }) {
			continue
		}
		keep[rel.oid] = true
		ps = append(ps, setupProblem(u.spec.Display, "the database guard is installed on this table, but "+u.reason, fix, ""))
	}
	for _, t := range targets {
		if rel, err := lookupTable(ctx, tx, t.spec.Schema, t.spec.Table); err != nil {
			return nil, nil, err
		} else if rel != nil {
			keep[rel.oid] = true
		}
	}
	var stray []string
	for _, t := range trigs {
		if t.ours && !t.clone && !keep[t.rel] && !slices.Contains(stray, t.relName) {
			stray = append(stray, t.relName)
		}
	}
	for _, name := range stray {
		ps = append(ps, setupProblem("", fmt.Sprintf("the database guard is installed on %s, which no entry in mode enforce protects in this database", name), fix, ""))
	}
	return ps, guarded, nil
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
