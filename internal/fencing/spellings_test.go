package fencing_test

import (
	"fmt"
	"math/rand/v2"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"

	"github.com/fenceproxy/fenceproxy/internal/policy"
	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/proxytest"
	"github.com/fenceproxy/fenceproxy/internal/rules"
	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// Every way PostgreSQL lets a session name its lock must either make the
// proxy register the lock or be refused by the proxy: nothing the server
// accepts as the lock setting may leave the proxy believing the session
// names no lock (issue 26). The spellings are built from PostgreSQL's
// grammar and lexer (https://www.postgresql.org/docs/current/sql-syntax-lexical.html):
// quoted and Unicode-escaped identifiers, comments and white space between
// the parts of a qualified name, escape, Unicode-escape and dollar-quoted
// strings, string continuation, set_config in every form, bound
// parameters, the startup packet's parameters and its options, which the
// server splits as pg_split_opts does (backslash escapes the next
// character).
//
// The check is the same for each: lock name V has watermark 42 (written
// directly), the session's token is 41, it names V by the spelling, the
// server then holds V (current_setting, read through the proxy), and an
// INSERT of a new row into a lock-fenced table is refused with FP001: row
// fencing alone would let it land. The row is then absent, read directly.
// Each spelling is first run straight against PostgreSQL, so a spelling
// the server does not read as V fails as a bug of the test, not of the
// proxy.
//
// The token setting's spellings are checked the same way the other way
// round: the session held a valid 44, the spelling makes it a stale 41,
// and the proxy, which applies the session's own token before each
// statement on a protected table, must not write with 44.

const (
	spellWatermark = 42
	spellStale     = 41
	// spellFresh is the token a session holds before a token spelling
	// makes it stale.
	spellFresh = 44
)

// spelling is one way of giving a session a lock name.
type spelling struct {
	name string
	// startup, when set, edits the connection's configuration (startup
	// parameters, options).
	startup func(*pgx.ConnConfig)
	// stmts are sent one by one after connecting. A statement starting
	// with "!" is expected to fail on the server (the "!" is not sent).
	stmts []string
	// args, when set, are the bound parameters of the last statement
	// (extended protocol only).
	args []any
	// local: the setting lasts for the transaction only, so the check runs
	// inside BEGIN … ROLLBACK.
	local bool
	// own: the statements manage their own transactions (or may not run in
	// one): they run outside any transaction block only.
	own bool
	// simpleOnly, extendedOnly restrict the protocols.
	simpleOnly, extendedOnly bool
	// value is the lock name the server then holds ("" for none).
	value string
	// token: the spelling sets the token setting, to value, instead of
	// the lock's; the session has valid token 44 before (unless the
	// spelling is in the startup packet) and names no lock.
	token bool
}

// spellVariant is how a spelling reaches the proxy.
type spellVariant struct {
	name     string
	extended bool // Parse/Bind/Execute (pgx's statement cache), else simple Query
	inTx     bool // inside BEGIN … ROLLBACK
	oneQuery bool // the statements and the checks in one simple Query
}

var spellVariants = []spellVariant{
	{name: "simple"},
	{name: "simple-in-tx", inTx: true},
	{name: "simple-one-query", oneQuery: true},
	{name: "extended", extended: true},
	{name: "extended-in-tx", extended: true, inTx: true},
}

func (sp spelling) variants() []spellVariant {
	var out []spellVariant
	for _, v := range spellVariants {
		switch {
		case sp.simpleOnly && v.extended, sp.extendedOnly && !v.extended:
		case sp.args != nil && !v.extended:
		case sp.local && !v.inTx && !v.oneQuery:
		case sp.own && (v.inTx || v.oneQuery):
		case sp.args != nil && v.oneQuery:
		case len(sp.stmts) == 0 && v.oneQuery:
		default:
			out = append(out, v)
		}
	}
	return out
}

// spellEnv is a proxy enforcing lockRules and one database of its own
// with the fenceproxy objects.
type spellEnv struct {
	e  *lockEnv
	db string
	d  *pgx.Conn // direct, for setup and checks
	// refused counts the spellings the proxy refused instead of
	// registering; registered those it registered.
	refused, registered atomic.Int64
}

func newSpellEnv(t *testing.T, e *lockEnv) *spellEnv {
	t.Helper()
	db := newLockDB(t, true)
	return &spellEnv{e: e, db: db, d: direct(t, db)}
}

// spellIDs gives each check a row id no other check uses.
var spellIDs atomic.Int64

func init() { spellIDs.Store(100000) }

// setWatermark makes lock's watermark 42, directly.
func (s *spellEnv) setWatermark(t testing.TB, lock string) {
	t.Helper()
	if lock == "" {
		return
	}
	if _, err := s.d.Exec(ctxT(t), `INSERT INTO fenceproxy.locks (name, token) VALUES ($1, $2)
		ON CONFLICT (name) DO UPDATE SET token = excluded.token`, lock, spellWatermark); err != nil {
		t.Fatalf("watermark of %q: %v", lock, err)
	}
}

func (s *spellEnv) watermark(t testing.TB, lock string) int64 {
	t.Helper()
	var w int64
	if err := s.d.QueryRow(ctxT(t), "SELECT coalesce((SELECT token FROM fenceproxy.locks WHERE name = $1), 0)", lock).Scan(&w); err != nil {
		t.Fatal(err)
	}
	return w
}

// rowFence returns the fence of acct's row id, read directly, and whether
// it exists.
func (s *spellEnv) rowFence(t testing.TB, id int64) (int64, bool) {
	t.Helper()
	var f int64
	err := s.d.QueryRow(ctxT(t), "SELECT last_fence FROM acct WHERE id = $1", id).Scan(&f)
	if err == pgx.ErrNoRows {
		return 0, false
	}
	if err != nil {
		t.Fatal(err)
	}
	return f, true
}

// spellConfig is the configuration of a session for sp, through the proxy
// or directly: token 41 as a startup parameter (44 for a token spelling,
// none when the spelling is in the startup packet), then sp's own edits,
// in the simple or the extended protocol.
func spellConfig(sp spelling, extended bool) func(*pgx.ConnConfig) {
	return func(c *pgx.ConnConfig) {
		switch {
		case !sp.token:
			c.RuntimeParams["fence.token"] = strconv.Itoa(spellStale)
		case sp.startup == nil:
			c.RuntimeParams["fence.token"] = strconv.Itoa(spellFresh)
		}
		if extended {
			c.DefaultQueryExecMode = pgx.QueryExecModeCacheStatement
		} else {
			c.DefaultQueryExecMode = pgx.QueryExecModeSimpleProtocol
		}
		if sp.startup != nil {
			sp.startup(c)
		}
	}
}

// execStmt sends one statement: a simple Query, or with extended an
// unnamed Parse/Bind/Execute (pgx's Exec would send a text without
// arguments as a simple Query) or, with args, pgx's cached prepared
// statement.
func execStmt(t testing.TB, c *pgx.Conn, stmt string, args []any, extended bool) error {
	t.Helper()
	ctx := ctxT(t)
	switch {
	case !extended:
		_, err := c.PgConn().Exec(ctx, stmt).ReadAll()
		return err
	case args == nil:
		return c.PgConn().ExecParams(ctx, stmt, nil, nil, nil, nil).Read().Err
	default:
		_, err := c.Exec(ctx, stmt, args...)
		return err
	}
}

// runStmts sends sp's statements; the last gets sp.args. It returns the
// first unexpected error.
func runStmts(t testing.TB, c *pgx.Conn, sp spelling, extended bool) error {
	t.Helper()
	for i, st := range sp.stmts {
		var args []any
		if i == len(sp.stmts)-1 {
			args = sp.args
		}
		wantFail := strings.HasPrefix(st, "!")
		err := execStmt(t, c, strings.TrimPrefix(st, "!"), args, extended)
		switch {
		case wantFail && err == nil:
			return fmt.Errorf("%s: succeeded, want an error", st)
		case wantFail:
			// A failed statement inside a transaction leaves it aborted,
			// as the spelling means it to.
		case err != nil:
			return fmt.Errorf("%s: %w", st, err)
		}
	}
	return nil
}

// readLock and readToken read the settings' values. Their text does not
// contain the settings' names, so that the read cannot help a proxy that
// looks for a name in what a session sends.
const (
	readLock  = "SELECT current_setting('fence' || '.lock', true)"
	readToken = "SELECT current_setting('fence' || '.token', true)"
)

// lockNow reads the server's value of the lock setting through c.
func lockNow(t testing.TB, c *pgx.Conn) (string, error) {
	t.Helper()
	return readSetting(t, c, readLock)
}

func readSetting(t testing.TB, c *pgx.Conn, read string) (string, error) {
	t.Helper()
	var v *string
	err := c.QueryRow(ctxT(t), read).Scan(&v)
	if v == nil {
		return "", err
	}
	return *v, err
}

// settingNow reads the setting sp spells.
func settingNow(t testing.TB, c *pgx.Conn, sp spelling) (string, error) {
	t.Helper()
	if sp.token {
		return readSetting(t, c, readToken)
	}
	return lockNow(t, c)
}

// validate runs sp straight against PostgreSQL and fails the test unless
// the server then holds sp.value: the spelling itself must be right.
func (s *spellEnv) validate(t testing.TB, sp spelling, extended bool) {
	t.Helper()
	c := connectDSN(t, cluster.SuperuserDSN(s.db), spellConfig(sp, extended))
	defer c.Close(ctxT(t))
	inTx := sp.local
	if inTx {
		if _, err := c.Exec(ctxT(t), "BEGIN"); err != nil {
			t.Fatal(err)
		}
	}
	if err := runStmts(t, c, sp, extended); err != nil {
		t.Fatalf("test bug: PostgreSQL refuses the spelling %q directly: %v", sp.name, err)
	}
	got, err := settingNow(t, c, sp)
	if err != nil {
		t.Fatalf("test bug: reading the setting directly after %q: %v", sp.name, err)
	}
	if got != sp.value {
		t.Fatalf("test bug: spelling %q gives the server value %q directly, the test expects %q", sp.name, got, sp.value)
	}
}

// isProxyRefusal reports whether err is the proxy refusing a statement
// whose effect on the settings it cannot know (FP003).
func isProxyRefusal(err error) bool { return sqlState(err) == "FP003" }

// check sends sp through the proxy as v says and checks the outcome in the
// database.
func (s *spellEnv) check(t *testing.T, sp spelling, v spellVariant) {
	t.Helper()
	id := spellIDs.Add(1)
	insert := fmt.Sprintf("INSERT INTO acct (id, payload) VALUES (%d, 'stale')", id)
	if sp.token {
		// Row 1 at fence 42: token 41 may not write it, 44 may.
		insert = "UPDATE acct SET n = n + 1 WHERE id = 1"
		if _, err := s.d.Exec(ctxT(t), "UPDATE acct SET n = 0, last_fence = $1 WHERE id = 1", spellWatermark); err != nil {
			t.Fatal(err)
		}
	} else {
		s.setWatermark(t, sp.value)
	}
	ctx := ctxT(t)

	c, err := connectSpelling(t, s.e.proxy.DSN("postgres", "", s.db), spellConfig(sp, v.extended))
	if err != nil {
		if isProxyRefusal(err) && len(sp.stmts) == 0 {
			t.Logf("refused: %v", err)
			s.refused.Add(1)
			return // the proxy refused the startup packet
		}
		t.Fatalf("connect through the proxy: %v", err)
	}
	defer c.Close(ctx)

	if v.oneQuery {
		s.checkOneQuery(t, c, sp, id, insert)
		return
	}
	send := func(stmt string) error { return execStmt(t, c, stmt, nil, v.extended) }
	must := func(stmt string) {
		t.Helper()
		if err := send(stmt); err != nil {
			t.Fatalf("%s: %v", stmt, err)
		}
	}
	inTx := v.inTx || sp.local
	if inTx {
		must("BEGIN")
	}
	if err := runStmts(t, c, sp, v.extended); err != nil {
		if !isProxyRefusal(err) {
			t.Fatalf("through the proxy: %v", err)
		}
		t.Logf("refused: %v", err)
		// Refused. Outside a transaction nothing of it ran; inside one the
		// transaction is aborted and its settings go with the rollback.
		if inTx {
			must("ROLLBACK")
			s.refused.Add(1)
			return
		}
		if got, err := settingNow(t, c, sp); err != nil || got != sp.value || got == "" {
			s.refused.Add(1)
			return
		}
		// The server holds the lock name all the same: the refusal must
		// not keep the lock from being registered.
	}
	got, err := settingNow(t, c, sp)
	if err != nil {
		t.Fatalf("read the setting through the proxy: %v", err)
	}
	if got != sp.value {
		t.Fatalf("the server holds %q through the proxy, directly %q", got, sp.value)
	}
	err = send(insert)
	s.wantOutcome(t, sp, id, err)
	if inTx {
		if sp.value == "" && err == nil {
			must("COMMIT")
			s.wantLanded(t, id)
		} else {
			must("ROLLBACK")
		}
	} else if sp.value == "" {
		s.wantLanded(t, id)
	}
	s.wantAbsent(t, sp, id)
}

// wantAbsent checks that the stale holder's write left nothing: no row
// id, or for a token spelling row 1 unwritten.
func (s *spellEnv) wantAbsent(t *testing.T, sp spelling, id int64) {
	t.Helper()
	switch {
	case sp.token:
		if r := snapshot(t, s.d, "acct")[1]; r.N != 0 || r.Fence != spellWatermark {
			t.Fatalf("the stale holder wrote row 1: %+v", r)
		}
	case sp.value != "":
		if f, ok := s.rowFence(t, id); ok {
			t.Fatalf("the stale holder's row %d is in the table (fence %d)", id, f)
		}
	}
}

// checkOneQuery sends sp's statements, the read of the setting and the
// INSERT as one simple Query (one implicit transaction).
func (s *spellEnv) checkOneQuery(t *testing.T, c *pgx.Conn, sp spelling, id int64, insert string) {
	t.Helper()
	var b strings.Builder
	for _, st := range sp.stmts {
		b.WriteString(strings.TrimPrefix(st, "!"))
		b.WriteString(";\n")
	}
	read := readLock
	if sp.token {
		read = readToken
	}
	b.WriteString(read + " AS fence_lock_now;\n")
	b.WriteString(insert)
	res, err := c.PgConn().Exec(ctxT(t), b.String()).ReadAll()
	for _, r := range res {
		if len(r.FieldDescriptions) == 1 && r.FieldDescriptions[0].Name == "fence_lock_now" && len(r.Rows) == 1 {
			if got := string(r.Rows[0][0]); got != sp.value {
				t.Fatalf("the server holds lock name %q in the Query, directly %q", got, sp.value)
			}
		}
	}
	if isProxyRefusal(err) {
		t.Logf("refused: %v", err)
		s.refused.Add(1)
		s.wantAbsent(t, sp, id)
		return
	}
	s.wantOutcome(t, sp, id, err)
	if sp.value == "" {
		s.wantLanded(t, id)
	}
	s.wantAbsent(t, sp, id)
}

// wantOutcome checks the INSERT's error: FP001 for the lock when the
// session names one, none when it names none (row fencing only: a new row
// has no fence to fail).
func (s *spellEnv) wantOutcome(t *testing.T, sp spelling, id int64, err error) {
	t.Helper()
	if sp.token {
		if sqlState(err) != "FP001" {
			t.Fatalf("a session whose token the spelling made %s (row 1 at fence %d): UPDATE: %v, want FP001 (the proxy applied another token)", sp.value, spellWatermark, err)
		}
		s.registered.Add(1)
		return
	}
	if sp.value == "" {
		if err != nil {
			t.Fatalf("a session naming no lock: INSERT of row %d: %v, want it to land", id, err)
		}
		return
	}
	if sqlState(err) != "FP001" {
		t.Fatalf("a stale holder of lock %q (token %d, watermark %d): INSERT of a new row: %v, want FP001 (the lock was not registered)", sp.value, spellStale, spellWatermark, err)
	}
	if !strings.Contains(err.Error(), "lock") {
		t.Fatalf("FP001 without the lock: %v", err)
	}
	if w := s.watermark(t, sp.value); w != spellWatermark {
		t.Fatalf("watermark of %q is %d, want %d", sp.value, w, spellWatermark)
	}
	s.registered.Add(1)
}

// wantLanded checks that row id landed, stamped with the session's token.
func (s *spellEnv) wantLanded(t *testing.T, id int64) {
	t.Helper()
	if f, ok := s.rowFence(t, id); !ok || f != spellStale {
		t.Fatalf("row %d: present %v fence %d, want it stamped %d", id, ok, f, spellStale)
	}
}

// connectSpelling is connectDSN returning the error instead of failing.
func connectSpelling(t testing.TB, dsn string, edit func(*pgx.ConnConfig)) (*pgx.Conn, error) {
	t.Helper()
	cfg, err := pgx.ParseConfig(dsn)
	if err != nil {
		t.Fatal(err)
	}
	edit(cfg)
	return pgx.ConnectConfig(ctxT(t), cfg)
}

// runSpelling validates sp directly and checks it in each of its variants.
func (s *spellEnv) runSpelling(t *testing.T, sp spelling) {
	t.Helper()
	vs := sp.variants()
	if len(vs) == 0 {
		t.Fatalf("test bug: spelling %q has no variant", sp.name)
	}
	validated := map[bool]bool{}
	for _, v := range vs {
		if !validated[v.extended] {
			s.validate(t, sp, v.extended)
			validated[v.extended] = true
		}
		t.Run(v.name, func(t *testing.T) { s.check(t, sp, v) })
	}
}

// param sets a startup parameter.
func param(name, value string) func(*pgx.ConnConfig) {
	return func(c *pgx.ConnConfig) { c.RuntimeParams[name] = value }
}

// options sets the startup packet's options.
func options(o string) func(*pgx.ConnConfig) { return param("options", o) }

func both(fs ...func(*pgx.ConnConfig)) func(*pgx.ConnConfig) {
	return func(c *pgx.ConnConfig) {
		for _, f := range fs {
			f(c)
		}
	}
}

// setSpellings are the setting's name spelled in a SET: each gives the
// session lock name L.
var nameSpellings = []string{
	`fence.lock`,
	`FENCE.LOCK`,
	`Fence.Lock`,
	`"fence"."lock"`,
	`"fence".lock`,
	`fence."lock"`,
	`"FENCE"."LOCK"`,
	`"FENCE".LOCK`,
	`"fence.lock"`,
	`"FENCE.Lock"`,
	`fence . lock`,
	"fence\n.\nlock",
	"fence\t.\r\n\flock",
	`fence /*x*/ . lock`,
	`fence/**/./**/lock`,
	`fence/* a /* nested */ b */.lock`,
	"fence -- comment\n.lock",
	"fence.-- comment\nlock",
	`"fence" /* c */ . /* d */ "lock"`,
	`U&"fence".U&"\006cock"`,
	`u&"fence".u&"lock"`,
	`U&"\0066\0065\006E\0063\0065".lock`,
	`U&"fence" . U&"lo\0063k"`,
	`U&"fen\+000063e".lock`,
	`U&"!0066ence" UESCAPE '!' .lock`,
	`U&"!0066ence" /* c */ UESCAPE /* d */ '!'.lock`,
	`fence.U&"#006c#006f#0063#006b" UESCAPE '#'`,
	`U&"fence.\006cock"`,
	`U&"fence\002elock"`,
	`U&"FENCE\002ELOCK"`,
	`U&"fence*002elock" UESCAPE '*'`,
}

// valueSpellings are the value L spelled after "SET fence.lock =".
var valueSpellings = []struct{ sql, value string }{
	{`'L'`, "L"},
	{`"L"`, "L"},
	{`L`, "l"}, // an unquoted identifier folds to lower case
	{`E'L'`, "L"},
	{`e'\x4c'`, "L"},
	{`E'\x4C'`, "L"},
	{`E'\114'`, "L"},
	{`E'\u004c'`, "L"},
	{`E'\U0000004C'`, "L"},
	{`U&'\004c'`, "L"},
	{`u&'\+00004c'`, "L"},
	{`U&'!004c' UESCAPE '!'`, "L"},
	{`$$L$$`, "L"},
	{`$t$L$t$`, "L"},
	{`$_0$L$_0$`, "L"},
	{"''\n'L'", "L"},
	{"'L'\n  ''", "L"},
	{"'my' \n ' lock'", "my lock"},
	{`'o''brien'`, "o'brien"},
	{`E'o\'brien'`, "o'brien"},
	{`$$o'brien$$`, "o'brien"},
	{`'back\slash'`, `back\slash`},
	{`E'back\\slash'`, `back\slash`},
	{`'tenant/7'`, "tenant/7"},
	{`U&'\00dcn\00efcode'`, "Ünïcode"},
	{`'Ünïcode'`, "Ünïcode"},
	{`42`, "42"},
	{`-1.5`, "-1.5"},
	{`on`, "on"},
	{`true`, "true"},
}

func staticSpellings() []spelling {
	var sps []spelling
	add := func(sp spelling) { sps = append(sps, sp) }

	// SET with every spelling of the name.
	for _, n := range nameSpellings {
		add(spelling{name: "SET " + n, stmts: []string{"SET " + n + " = 'L'"}, value: "L"})
	}
	// SET with every spelling of the value.
	for _, v := range valueSpellings {
		add(spelling{name: "SET = " + v.sql, stmts: []string{"SET fence.lock = " + v.sql}, value: v.value})
	}
	for _, f := range []string{
		"SET fence.lock TO 'L'",
		"SET SESSION fence.lock = 'L'",
		"set session FENCE.lock to 'L'",
		"SET/**/fence.lock/**/=/**/'L'",
		"SET\nfence.lock\nTO\n'L'",
		"SET fence.lock = 'X'; SET fence.lock = 'L'",
		"SET fence.lock = 'L' ;",
		"/* leading */ SET fence.lock = 'L'",
		"-- leading\nSET fence.lock = 'L'",
	} {
		sp := spelling{name: f, stmts: []string{f}, value: "L"}
		if strings.Count(f, ";") > 0 && !strings.HasSuffix(f, " ;") {
			sp.simpleOnly = true // two statements: one simple Query
		}
		add(sp)
	}
	// SET LOCAL.
	for _, f := range []string{
		"SET LOCAL fence.lock = 'L'",
		`SET LOCAL "fence"."lock" TO 'L'`,
		`set local FENCE /* c */ . LOCK = E'\x4c'`,
		`SET LOCAL U&"fence\002elock" = $$L$$`,
	} {
		add(spelling{name: f, stmts: []string{f}, local: true, value: "L"})
	}

	// set_config with constants.
	for _, f := range []struct {
		sql, value string
		local      bool
	}{
		{sql: "SELECT set_config('fence.lock', 'L', false)"},
		{sql: "SELECT pg_catalog.set_config('fence.lock', 'L', false)"},
		{sql: `SELECT "pg_catalog"."set_config"('fence.lock', 'L', false)`},
		{sql: `SELECT PG_CATALOG . SET_CONFIG ('fence.lock', 'L', false)`},
		{sql: `SELECT pg_catalog/* c */./* d */set_config('fence.lock', 'L', false)`},
		{sql: `SELECT U&"set\005fconfig"('fence.lock', 'L', false)`},
		{sql: "SELECT set_config('FENCE.LOCK', 'L', false)"},
		{sql: "SELECT set_config('Fence.Lock', 'L', false)"},
		{sql: `SELECT set_config(E'fence\x2elock', E'\x4c', false)`},
		{sql: `SELECT set_config(e'fence\056lock', 'L', false)`},
		{sql: `SELECT set_config(U&'fence\002elock', U&'\004c', false)`},
		{sql: `SELECT set_config(U&'fence!002elock' UESCAPE '!', 'L', false)`},
		{sql: `SELECT set_config($$fence.lock$$, $q$L$q$, false)`},
		{sql: "SELECT set_config('fence.'\n'lock', 'L', false)"},
		{sql: "SELECT set_config('fence.lock'::text, 'L'::text, false::boolean)"},
		{sql: "SELECT set_config(text 'fence.lock', varchar 'L', bool 'f')"},
		{sql: "SELECT set_config(CAST('fence.lock' AS text), 'L', 'off')"},
		{sql: "SELECT set_config('fence.lock', 'L', 'false')"},
		{sql: "SELECT set_config('fence.lock', 'L', FALSE) AS x, 1 AS y"},
		{sql: "SELECT * FROM set_config('fence.lock', 'L', false)"},
		{sql: "SELECT * FROM pg_catalog.set_config('fence.lock', 'L', false) AS s(v)"},
		{sql: "SELECT 1 WHERE set_config('fence.lock', 'L', false) IS NOT NULL"},
		{sql: "VALUES (set_config('fence.lock', 'L', false))"},
		{sql: "SELECT set_config('fence.lock', 'X', false), set_config('fence.lock', 'L', false)"},
		{sql: "SELECT (SELECT set_config('fence.lock', 'L', false))"},
		{sql: "WITH x AS (SELECT set_config('fence.lock', 'L', false)) SELECT * FROM x"},
		{sql: "SELECT set_config('fence.lock', 'L', false) FROM generate_series(1, 3)"},
		{sql: "SELECT set_config('fence.lock', 'L', true)", local: true},
		{sql: "SELECT set_config('fence.lock', 'L', 't')", local: true},
		{sql: "SELECT set_config('fence.lock', 'L', 'on')", local: true},
		{sql: "SELECT set_config('FENCE.LOCK', E'\\x4c', TRUE)", local: true},
		// Expressions: the value is not a constant.
		{sql: "SELECT set_config('fence' || '.lock', 'L', false)"},
		{sql: "SELECT set_config('fence.lock', lower('L'), false)", value: "l"},
		{sql: "SELECT set_config('fence.lock', chr(76), false)"},
		{sql: "SELECT set_config('fence.lock', (SELECT 'L'), false)"},
		{sql: "SELECT set_config(n, 'L', false) FROM (VALUES ('fence.lock')) v(n)"},
		{sql: "SELECT set_config('fence.lock', 'L', 1 = 2)"},
		{sql: "SELECT set_config('fence.lock', 'L', 1 = 1)", local: true},
		{sql: "SELECT set_config('fence.lock', 'L', random() < 2)", local: true},
		{sql: "SELECT set_config(upper('fence.lock'), 'L', false)"},
	} {
		v := f.value
		if v == "" {
			v = "L"
		}
		add(spelling{name: f.sql, stmts: []string{f.sql}, local: f.local, value: v})
	}

	// Dynamic SQL and prepared statements.
	add(spelling{name: "DO PERFORM set_config", stmts: []string{`DO $$BEGIN PERFORM set_config('fence.lock', 'L', false); END$$`}, value: "L"})
	add(spelling{name: "DO EXECUTE SET", stmts: []string{`DO $d$BEGIN EXECUTE 'SET "fence".lock = ''L'''; END$d$`}, value: "L"})
	add(spelling{name: "DO SET LOCAL", stmts: []string{`DO $$BEGIN SET LOCAL fence.lock = 'L'; END$$`}, local: true, value: "L"})
	add(spelling{name: "PREPARE set_config EXECUTE", stmts: []string{
		"PREPARE spell_sc(text) AS SELECT set_config('fence.lock', $1, false)",
		"EXECUTE spell_sc('L')",
	}, value: "L"})
	add(spelling{name: "PREPARE set_config EXECUTE name parameter", stmts: []string{
		"PREPARE spell_sc2(text, text) AS SELECT pg_catalog.set_config($1, $2, false)",
		"EXECUTE spell_sc2('FENCE.LOCK', 'L')",
	}, value: "L"})

	// Bound parameters (extended protocol).
	for _, f := range []struct {
		sql   string
		args  []any
		local bool
	}{
		{sql: "SELECT set_config($1, $2, false)", args: []any{"fence.lock", "L"}},
		{sql: "SELECT set_config($1, $2, $3)", args: []any{"FENCE.LOCK", "L", false}},
		{sql: "SELECT pg_catalog.set_config($1::text, $2::text, false)", args: []any{"Fence.Lock", "L"}},
		{sql: "SELECT set_config('fence.lock', $1, false)", args: []any{"L"}},
		{sql: "SELECT set_config($1, 'L', false)", args: []any{"fence.lock"}},
		{sql: "SELECT set_config($2, $1, false)", args: []any{"L", "fence.lock"}},
		{sql: "SELECT set_config($1::text || $2::text, $3, false)", args: []any{"fence.", "lock", "L"}},
		{sql: "SELECT set_config($1, $2, true)", args: []any{"fence.lock", "L"}, local: true},
		{sql: "SELECT set_config($1, $2, $3)", args: []any{"fence.lock", "L", true}, local: true},
	} {
		add(spelling{name: fmt.Sprintf("%s %v", f.sql, f.args), stmts: []string{f.sql}, args: f.args, local: f.local, value: "L", extendedOnly: true})
	}

	// The startup packet.
	for _, f := range []struct {
		name  string
		edit  func(*pgx.ConnConfig)
		value string
	}{
		{"param fence.lock", param("fence.lock", "L"), "L"},
		{"param FENCE.LOCK", param("FENCE.LOCK", "L"), "L"},
		{"param Fence.Lock", param("Fence.Lock", "L"), "L"},
		{"param with a space", param("fence.lock", "my lock"), "my lock"},
		{"param with a backslash", param("fence.lock", `a\b`), `a\b`},
		{"options -c", options("-c fence.lock=L"), "L"},
		{"options -c attached", options("-cfence.lock=L"), "L"},
		{"options --", options("--fence.lock=L"), "L"},
		{"options -c upper", options("-c FENCE.LOCK=L"), "L"},
		{"options -- mixed case", options("--Fence.Lock=L"), "L"},
		{"options escaped space", options(`-c fence.lock=my\ lock`), "my lock"},
		{"options escaped backslash", options(`-c fence.lock=a\\b`), `a\b`},
		{"options escaped letters", options(`-c f\ence\.lock=\L`), "L"},
		{"options escaped space in --", options(`--fence.lock=my\ \ lock`), "my  lock"},
		{"options white space", options("  -c\tfence.lock=L \t "), "L"},
		{"options later wins", options("-c fence.lock=X -c fence.lock=L"), "L"},
		{"options later -- wins", options("-c fence.lock=X --fence.lock=L"), "L"},
		{"options with the token", options("-c fence.token=41 -c fence.lock=L"), "L"},
		{"options value with =", options("-c fence.lock=a=b"), "a=b"},
		{"options other settings around", options("-c work_mem=8MB -c fence.lock=L -c statement_timeout=0"), "L"},
		// A startup parameter is applied after options (process_startup_options).
		{"param over options", both(options("-c fence.lock=X"), param("fence.lock", "L")), "L"},
		{"options empty value", options("-c fence.lock="), ""},
	} {
		add(spelling{name: "startup " + f.name, startup: f.edit, value: f.value})
	}

	// Changes after the start: RESET returns to the startup value, which
	// the server keeps as the setting's reset value.
	add(spelling{name: "startup then RESET", startup: param("fence.lock", "L"), stmts: []string{"SET fence.lock = 'X'", "RESET fence.lock"}, value: "L"})
	add(spelling{name: "startup options then RESET ALL", startup: options("-c fence.lock=L"), stmts: []string{"SET fence.lock = 'X'", "RESET ALL"}, value: "L"})
	add(spelling{name: "startup then DISCARD ALL", startup: param("fence.lock", "L"), stmts: []string{"SET fence.lock = 'X'", "DISCARD ALL"}, own: true, simpleOnly: true, value: "L"})
	add(spelling{name: "startup then TO DEFAULT", startup: param("fence.lock", "L"), stmts: []string{"SET fence.lock = 'X'", "SET fence.lock TO DEFAULT"}, value: "L"})
	add(spelling{name: "startup then = DEFAULT", startup: param("fence.lock", "L"), stmts: []string{`SET "fence"."lock" = 'X'`, "SET FENCE.LOCK = DEFAULT"}, value: "L"})
	add(spelling{name: "startup then SET", startup: param("fence.lock", "X"), stmts: []string{`SET "fence".lock = 'L'`}, value: "L"})
	add(spelling{name: "SET then RESET", stmts: []string{"SET fence.lock = 'L'", `RESET "fence"."lock"`}, value: ""})
	add(spelling{name: "SET then RESET ALL", stmts: []string{"SET fence.lock = 'L'", "RESET ALL"}, value: ""})
	add(spelling{name: "SET then DISCARD ALL", stmts: []string{"SET fence.lock = 'L'", "DISCARD ALL"}, own: true, simpleOnly: true, value: ""})
	add(spelling{name: "SET then TO DEFAULT", stmts: []string{"SET fence.lock = 'L'", "SET FENCE.LOCK TO DEFAULT"}, value: ""})
	add(spelling{name: "SET then set_config empty", stmts: []string{"SET fence.lock = 'L'", "SELECT set_config('fence.lock', '', false)"}, value: ""})

	// Transactions.
	add(spelling{name: "rollback of a SET", stmts: []string{"SET fence.lock = 'L'", "BEGIN", "SET fence.lock = 'X'", "ROLLBACK"}, own: true, value: "L"})
	add(spelling{name: "rollback of a set_config", stmts: []string{"SET fence.lock = 'L'", "BEGIN", "SELECT set_config('fence.lock', 'X', false)", "ROLLBACK"}, own: true, value: "L"})
	add(spelling{name: "commit of a SET", stmts: []string{"BEGIN", `SET "fence".lock = 'L'`, "COMMIT"}, own: true, value: "L"})
	add(spelling{name: "SET LOCAL ends with commit", stmts: []string{"BEGIN", "SET LOCAL fence.lock = 'L'", "COMMIT"}, own: true, value: ""})
	add(spelling{name: "SET LOCAL over a SET", stmts: []string{"SET fence.lock = 'L'", "BEGIN", "SET LOCAL fence.lock = 'X'", "COMMIT"}, own: true, value: "L"})
	add(spelling{name: "rollback to savepoint", stmts: []string{"SET fence.lock = 'L'", "BEGIN", "SAVEPOINT s", "SET fence.lock = 'X'", "ROLLBACK TO SAVEPOINT s", "COMMIT"}, own: true, value: "L"})
	add(spelling{name: "release savepoint", stmts: []string{"BEGIN", "SAVEPOINT s", "SET fence.lock = 'L'", "RELEASE s", "COMMIT"}, own: true, value: "L"})
	add(spelling{name: "failed transaction", stmts: []string{"SET fence.lock = 'L'", "BEGIN", "SET fence.lock = 'X'", "!SELECT 1/0", "COMMIT"}, own: true, value: "L"})
	add(spelling{name: "implicit transaction rolled back", stmts: []string{"SET fence.lock = 'L'", "!SET fence.lock = 'X'; SELECT 1/0"}, own: true, simpleOnly: true, value: "L"})
	add(spelling{name: "SET LOCAL in an implicit transaction", stmts: []string{"SET LOCAL fence.lock = 'X'; SELECT 1"}, own: true, simpleOnly: true, value: ""})
	add(spelling{name: "set_config local in an implicit transaction", stmts: []string{"SET fence.lock = 'L'", "SELECT set_config('fence.lock', 'X', true); SELECT 1"}, own: true, simpleOnly: true, value: "L"})
	return sps
}

// TestSpellings checks each spelling in staticSpellings.
func TestSpellings(t *testing.T) {
	t.Parallel()
	e := startLockEnv(t)
	sps := staticSpellings()
	// Four groups in parallel, each with a database and direct connection
	// of its own.
	const groups = 4
	for g := range groups {
		t.Run(fmt.Sprintf("group%d", g), func(t *testing.T) {
			t.Parallel()
			s := newSpellEnv(t, e)
			for i := g; i < len(sps); i += groups {
				sp := sps[i]
				t.Run(sp.name, func(t *testing.T) { s.runSpelling(t, sp) })
			}
			t.Logf("registered %d, refused %d", s.registered.Load(), s.refused.Load())
		})
	}
}

// tokenSpellings set the token to a stale 41 in a session that held a
// valid 44: the proxy, which applies the session's own token before each
// statement on a protected table, must see each of them (or refuse it),
// or it would write with 44.
func tokenSpellings() []spelling {
	sps := []spelling{
		{name: "SET quoted", stmts: []string{`SET "fence"."token" = '41'`}},
		{name: "SET upper quoted", stmts: []string{`SET "FENCE"."TOKEN" = '41'`}},
		{name: "SET comment", stmts: []string{`SET fence /* c */ . token = 41`}},
		{name: "SET nested comment and newline", stmts: []string{"SET fence/* a /* b */ c */\n.--\ntoken TO '041'"}, value: "041"},
		{name: "SET Unicode", stmts: []string{`SET U&"fence".U&"\0074oken" = U&'\0034\0031'`}},
		{name: "SET one quoted identifier", stmts: []string{`SET "fence.token" = E'\x341'`}},
		{name: "SET dollar", stmts: []string{`SET fence.token = $t$41$t$`}},
		{name: "SET LOCAL", stmts: []string{`SET LOCAL "FENCE".TOKEN TO $$41$$`}, local: true},
		{name: "set_config escape string", stmts: []string{`SELECT set_config(E'fence\x2etoken', '41', false)`}},
		{name: "set_config Unicode", stmts: []string{`SELECT pg_catalog.set_config(U&'fence!002etoken' UESCAPE '!', U&'\0034\0031', false)`}},
		{name: "set_config local", stmts: []string{`SELECT set_config('FENCE.TOKEN', '41', true)`}, local: true},
		{name: "set_config parameters", stmts: []string{`SELECT set_config($1, $2, false)`}, args: []any{"Fence.Token", "41"}, extendedOnly: true},
		{name: "startup options escaped", startup: options(`-c fence\.token=41`)},
		{name: "startup options --", startup: options(`--FENCE.TOKEN=4\1`)},
		{name: "startup options later wins", startup: options(`-c fence.token=44 -c fence.token=41`)},
		{name: "startup param", startup: param("Fence.Token", "41")},
		{name: "startup then RESET", startup: param("fence.token", "41"), stmts: []string{"SET fence.token = '44'", `RESET "fence"."token"`}},
		{name: "startup then RESET ALL", startup: options("-c fence.token=41"), stmts: []string{"SET fence.token = '44'", "RESET ALL"}},
		{name: "startup then DISCARD ALL", startup: options("-c fence.token=41"), stmts: []string{"SET fence.token = '44'", "DISCARD ALL"}, own: true, simpleOnly: true},
		{name: "rollback", stmts: []string{"SET fence.token = '41'", "BEGIN", "SET fence.token = '44'", "ROLLBACK"}, own: true},
		{name: "rollback to savepoint", stmts: []string{"SET fence.token = '41'", "BEGIN", "SAVEPOINT s", `SET "fence".token = '44'`, "ROLLBACK TO s", "COMMIT"}, own: true},
		{name: "SET LOCAL ends", stmts: []string{"SET fence.token = '41'", "BEGIN", "SET LOCAL fence.token = '44'", "COMMIT"}, own: true},
	}
	for i := range sps {
		sps[i].token = true
		if sps[i].value == "" {
			sps[i].value = "41"
		}
	}
	return sps
}

func TestSpellingsToken(t *testing.T) {
	t.Parallel()
	e := startLockEnv(t)
	s := newSpellEnv(t, e)
	for _, sp := range tokenSpellings() {
		t.Run(sp.name, func(t *testing.T) { s.runSpelling(t, sp) })
	}
	t.Logf("stale write refused %d, spelling refused %d", s.registered.Load(), s.refused.Load())
}

// TestSpellingTokenRandom is TestSpellingRandom for the token setting:
// each case makes the session's token a stale 41 (it held 44), and a write
// of a row at fence 42 must then fail.
func TestSpellingTokenRandom(t *testing.T) {
	t.Parallel()
	n := envInt(t, "FENCEPROXY_SPELLING_CASES", 200) / 2
	seed := envInt(t, "FENCEPROXY_SPELLING_SEED", 1)
	e := startLockEnv(t)
	s := newSpellEnv(t, e)
	for i := range n {
		sd := uint64(seed + i)
		sp, v := genSpellingOf(sd, "token")
		t.Run(fmt.Sprintf("seed%d", sd), func(t *testing.T) {
			t.Logf("seed %d: %s (%s)", sd, sp.name, v.name)
			s.validate(t, sp, v.extended)
			s.check(t, sp, v)
		})
	}
	t.Logf("stale write refused %d, spelling refused %d", s.registered.Load(), s.refused.Load())
}

// TestSpellingAlterRole: a lock name from ALTER ROLE … SET and ALTER
// DATABASE … SET, which the server applies at the session's start.
func TestSpellingAlterRole(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	e := startLockEnv(t)
	s := newSpellEnv(t, e)
	ctx := ctxT(t)
	role := "spell_role_" + s.db
	mustExec(t, s.d, "CREATE ROLE "+role+" LOGIN SUPERUSER")
	mustExec(t, s.d, `ALTER ROLE `+role+` IN DATABASE `+s.db+` SET "fence"."lock" = 'L'`)
	s.setWatermark(t, "L")
	for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeSimpleProtocol, pgx.QueryExecModeCacheStatement} {
		c := connectDSN(t, e.proxy.DSN(role, "", s.db), func(c *pgx.ConnConfig) {
			c.DefaultQueryExecMode = mode
			c.RuntimeParams["fence.token"] = strconv.Itoa(spellStale)
		})
		if got, err := lockNow(t, c); err != nil || got != "L" {
			t.Fatalf("%v: lock name %q %v", mode, got, err)
		}
		id := spellIDs.Add(1)
		_, err := c.Exec(ctx, fmt.Sprintf("INSERT INTO acct (id, payload) VALUES (%d, 'stale')", id))
		wantCode(t, err, "FP001")
		if _, ok := s.rowFence(t, id); ok {
			t.Fatalf("row %d landed", id)
		}
		// RESET returns to the role's value.
		mustExec(t, c, "SET fence.lock = 'X'")
		mustExec(t, c, "RESET fence.lock")
		_, err = c.Exec(ctx, fmt.Sprintf("INSERT INTO acct (id, payload) VALUES (%d, 'stale')", id))
		wantCode(t, err, "FP001")
	}

	// ALTER DATABASE, in a database of its own (it applies to every
	// session there).
	db := newLockDB(t, true)
	d := direct(t, db)
	mustExec(t, d, `ALTER DATABASE `+db+` SET FENCE.LOCK = 'L'`)
	mustExec(t, d, `INSERT INTO fenceproxy.locks (name, token) VALUES ('L', 42)`)
	c := connectDSN(t, e.proxy.DSN("postgres", "", db), func(c *pgx.ConnConfig) {
		c.RuntimeParams["fence.token"] = strconv.Itoa(spellStale)
	})
	if got, err := lockNow(t, c); err != nil || got != "L" {
		t.Fatalf("lock name %q %v", got, err)
	}
	_, err := c.Exec(ctx, "INSERT INTO acct (id, payload) VALUES (77, 'stale')")
	wantCode(t, err, "FP001")
	var n int
	if err := d.QueryRow(ctx, "SELECT count(*) FROM acct WHERE id = 77").Scan(&n); err != nil || n != 0 {
		t.Fatalf("row 77: %d %v", n, err)
	}
}

// The randomized spellings: a seeded generator builds a spelling of the
// setting's name and of a lock name from the lexer's and grammar's rules,
// in a random statement form, protocol and transaction. Each case is
// checked like the static ones: directly first, then through the proxy
// (current_setting on the server equals the intended value, and the stale
// INSERT is refused with FP001).
//
// FENCEPROXY_SPELLING_CASES sets the number of cases (default 200),
// FENCEPROXY_SPELLING_SEED the first seed (default 1); a failure names
// its seed. FuzzSpellings runs the same generator under go test -fuzz.

func TestSpellingRandom(t *testing.T) {
	t.Parallel()
	n := envInt(t, "FENCEPROXY_SPELLING_CASES", 200)
	seed := envInt(t, "FENCEPROXY_SPELLING_SEED", 1)
	e := startLockEnv(t)
	const groups = 2
	for g := range groups {
		t.Run(fmt.Sprintf("group%d", g), func(t *testing.T) {
			t.Parallel()
			s := newSpellEnv(t, e)
			for i := g; i < n; i += groups {
				sd := uint64(seed + i)
				sp, v := genSpelling(sd)
				t.Run(fmt.Sprintf("seed%d", sd), func(t *testing.T) {
					t.Logf("seed %d: %s (%s)", sd, sp.name, v.name)
					s.validate(t, sp, v.extended)
					s.check(t, sp, v)
				})
			}
			t.Logf("registered %d, refused %d", s.registered.Load(), s.refused.Load())
		})
	}
}

func FuzzSpellings(f *testing.F) {
	testutil.SkipSystem(f, "PostgreSQL")
	for _, s := range []uint64{1, 2, 3, 42, 1 << 40} {
		f.Add(s)
	}
	// One proxy and database for the fuzz target (an input's t would end
	// them with the input).
	e := &lockEnv{proxy: startLockProxyTB(f)}
	db := newLockDB(f, true)
	s := &spellEnv{e: e, db: db, d: connectDSN(f, cluster.SuperuserDSN(db))}
	f.Fuzz(func(t *testing.T, seed uint64) {
		sp, v := genSpelling(seed)
		t.Logf("seed %d: %s (%s)", seed, sp.name, v.name)
		s.validate(t, sp, v.extended)
		s.check(t, sp, v)
	})
}

// startLockProxyTB starts a proxy enforcing lockRules for tb.
func startLockProxyTB(tb testing.TB) *proxytest.Proxy {
	tb.Helper()
	rs, err := rules.Compile(lockRules)
	if err != nil {
		tb.Fatal(err)
	}
	return proxytest.Start(tb, cluster.Addr(), proxy.Options{
		Policy: policy.New(rs, false, policy.Options{}),
		Logger: zaptest.NewLogger(tb, zaptest.Level(zap.WarnLevel)).Named("proxy"),
	})
}

func envInt(t *testing.T, name string, def int) int {
	t.Helper()
	s := os.Getenv(name)
	if s == "" {
		return def
	}
	n, err := strconv.Atoi(s)
	if err != nil {
		t.Fatalf("%s=%q: %v", name, s, err)
	}
	return n
}

// spellGen builds random spellings of the setting fence.<word>.
type spellGen struct {
	r    *rand.Rand
	word string // "lock" or "token"
}

func (g *spellGen) setting() string { return "fence." + g.word }

func (g *spellGen) one(n int) bool { return g.r.IntN(n) == 0 }

func (g *spellGen) pick(xs ...string) string { return xs[g.r.IntN(len(xs))] }

// randCase gives each ASCII letter of s a random case (setting names are
// case-insensitive).
func (g *spellGen) randCase(s string) string {
	b := []byte(s)
	for i, c := range b {
		if 'a' <= c && c <= 'z' && g.one(3) {
			b[i] = c - 'a' + 'A'
		}
	}
	return string(b)
}

// sep is white space and comments between tokens, possibly none.
func (g *spellGen) sep() string {
	var b strings.Builder
	for range g.r.IntN(3) {
		b.WriteString(g.pick(" ", "\t", "\n", "\r\n", "\f", "  ", "/* c */", "/**/", "/* a /* nested */ b */", "/*\n*/", "-- c\n", "--\n"))
	}
	return b.String()
}

// uescapeChars may follow UESCAPE (not a hex digit, +, quote, white
// space).
const uescapeChars = "!#%&*~^?=|@"

// uEscape writes r as a Unicode escape with escape character esc.
func uEscape(b *strings.Builder, esc byte, r rune, long bool) {
	if long || r > 0xFFFF {
		fmt.Fprintf(b, "%c+%06x", esc, r)
	} else {
		fmt.Fprintf(b, "%c%04X", esc, r)
	}
}

// identKind says which case an identifier's text may take.
type identKind int

const (
	// identSetting: a setting name, any case quoted or not (PostgreSQL
	// compares setting names case-insensitively).
	identSetting identKind = iota
	// identSQL: a function or schema name, any case unquoted only (quoted
	// identifiers keep their case).
	identSQL
	// identExact: a value, exactly as given.
	identExact
)

// ident spells s (no NUL, at most 63 bytes) as an identifier: unquoted when
// it can be, quoted, or Unicode-escaped with a random escape character.
func (g *spellGen) ident(s string, kind identKind) string {
	if kind == identSetting {
		s = g.randCase(s)
	}
	plain := s != "" && !strings.ContainsFunc(s, func(r rune) bool {
		return !(r == '_' || 'a' <= r && r <= 'z' || 'A' <= r && r <= 'Z' || '0' <= r && r <= '9')
	}) && !('0' <= s[0] && s[0] <= '9')
	if kind == identExact && strings.ToLower(s) != s {
		plain = false // an unquoted identifier folds to lower case
	}
	if g.one(3) && plain {
		if kind == identSQL {
			return g.randCase(s)
		}
		return s
	}
	if g.one(2) {
		return `"` + strings.ReplaceAll(s, `"`, `""`) + `"`
	}
	esc := byte('\\')
	custom := g.one(2)
	if custom {
		esc = uescapeChars[g.r.IntN(len(uescapeChars))]
	}
	var b strings.Builder
	b.WriteString(g.pick("U&", "u&"))
	b.WriteByte('"')
	for _, r := range s {
		switch {
		case g.one(2):
			uEscape(&b, esc, r, g.one(4))
		case r == '"':
			b.WriteString(`""`)
		case r == rune(esc):
			b.WriteByte(esc)
			b.WriteByte(esc)
		default:
			b.WriteRune(r)
		}
	}
	b.WriteByte('"')
	if custom {
		b.WriteString(g.sep())
		b.WriteString(g.pick(" UESCAPE ", " uescape ", "\nUESCAPE\n"))
		b.WriteString(g.sep())
		fmt.Fprintf(&b, "'%c'", esc)
	}
	return b.String()
}

// settingName spells the lock setting's name as a qualified name.
func (g *spellGen) settingName() string {
	if g.one(4) {
		// One (quoted) identifier holding the dot.
		return g.ident(g.setting(), identSetting)
	}
	return g.ident("fence", identSetting) + g.sep() + "." + g.sep() + g.ident(g.word, identSetting)
}

// str spells s as a string constant.
func (g *spellGen) str(s string) string {
	switch g.r.IntN(5) {
	case 0: // plain, maybe continued over lines
		var b strings.Builder
		b.WriteByte('\'')
		for _, r := range s {
			if g.one(8) {
				b.WriteString("'" + g.pick("\n", " \n ", "\n\t", "\r\n") + "'")
			}
			if r == '\'' {
				b.WriteString("''")
			} else {
				b.WriteRune(r)
			}
		}
		b.WriteByte('\'')
		return b.String()
	case 1: // escape string
		var b strings.Builder
		b.WriteString(g.pick("E'", "e'"))
		for _, r := range s {
			switch {
			case r == '\'' && g.one(2):
				b.WriteString(`\'`)
			case r == '\'':
				b.WriteString(`''`)
			case r == '\\':
				b.WriteString(`\\`)
			case r < 0x80 && g.one(3):
				fmt.Fprintf(&b, `\x%02x`, r)
			case r < 0x80 && g.one(3):
				fmt.Fprintf(&b, `\%03o`, r)
			case r <= 0xFFFF && g.one(3):
				fmt.Fprintf(&b, `\u%04x`, r)
			case g.one(3):
				fmt.Fprintf(&b, `\U%08X`, r)
			default:
				b.WriteRune(r)
			}
		}
		b.WriteByte('\'')
		return b.String()
	case 2: // Unicode escape string
		esc := byte('\\')
		custom := g.one(2)
		if custom {
			esc = uescapeChars[g.r.IntN(len(uescapeChars))]
		}
		var b strings.Builder
		b.WriteString(g.pick("U&'", "u&'"))
		for _, r := range s {
			switch {
			case g.one(2):
				uEscape(&b, esc, r, g.one(4))
			case r == '\'':
				b.WriteString("''")
			case r == rune(esc):
				b.WriteByte(esc)
				b.WriteByte(esc)
			default:
				b.WriteRune(r)
			}
		}
		b.WriteByte('\'')
		if custom {
			fmt.Fprintf(&b, "%sUESCAPE%s'%c'", g.pick(" ", "\n", " /* c */ "), g.pick(" ", "\t"), esc)
		}
		return b.String()
	default: // dollar-quoted
		for {
			tag := g.pick("", "", "t", "q", "_x1", "Tag")
			delim := "$" + tag + "$"
			// The body ends where the delimiter first appears.
			if strings.Index(s+delim, delim) == len(s) {
				return delim + s + delim
			}
		}
	}
}

// lockValues are lock names the generator draws from, besides random ones.
var lockValues = []string{"L", "my lock", "o'brien", `back\slash`, "tenant/7", "Ünïcode", "a-b_c.d", "$$", "x$t$y", `"quoted"`, "UPPER", "lock", "😀"}

const lockAlphabet = `abcXYZ019 '\$/_-."é€`

func (g *spellGen) lockValue() string {
	if g.one(2) {
		return lockValues[g.r.IntN(len(lockValues))]
	}
	rs := []rune(lockAlphabet)
	n := 1 + g.r.IntN(10)
	var b strings.Builder
	for range n {
		b.WriteRune(rs[g.r.IntN(len(rs))])
	}
	return b.String()
}

// setValue spells v as the value of a SET.
func (g *spellGen) setValue(v string) string {
	lower := v != "" && !strings.ContainsFunc(v, func(r rune) bool { return !('a' <= r && r <= 'z' || r == '_') })
	number := v != "" && v[0] != '0' && !strings.ContainsFunc(v, func(r rune) bool { return !('0' <= r && r <= '9') })
	switch {
	case number && g.one(3):
		return v // NumericOnly: a number without leading zeros keeps its text
	case lower && v != "lock" && g.one(4):
		// An unquoted word; keywords the grammar takes here are fine
		// except the few that mean something else (DEFAULT, LOCAL…),
		// which lockValues avoid.
		return v
	case len(v) <= 63 && !strings.HasPrefix(v, " ") && g.one(4):
		return g.ident(v, identExact)
	default:
		return g.str(v)
	}
}

// boolSpelling spells is_local.
func (g *spellGen) boolSpelling(local bool) string {
	if local {
		return g.pick("true", "TRUE", "'t'", "'on'", "'yes'", "'1'", "true::boolean", "bool 't'", "1 = 1")
	}
	return g.pick("false", "FALSE", "'f'", "'off'", "'no'", "'0'", "false::bool", "boolean 'false'", "1 = 2")
}

// funcName spells set_config, maybe schema-qualified.
func (g *spellGen) funcName() string {
	name := g.ident("set_config", identSQL)
	if g.one(2) {
		return g.ident("pg_catalog", identSQL) + g.sep() + "." + g.sep() + name
	}
	return name
}

// optEscape escapes s for the startup packet's options, as pg_split_opts
// reads them: a backslash takes the next character literally, white
// space ends an option.
func (g *spellGen) optEscape(s string) string {
	var b strings.Builder
	for _, r := range s {
		switch {
		case r == ' ' || r == '\\' || r == '\t':
			b.WriteByte('\\')
			b.WriteRune(r)
		case r < 0x80 && g.one(6):
			b.WriteByte('\\')
			b.WriteRune(r)
		default:
			b.WriteRune(r)
		}
	}
	return b.String()
}

// genSpelling builds the lock spelling and the variant of one seed.
func genSpelling(seed uint64) (spelling, spellVariant) { return genSpellingOf(seed, "lock") }

// genSpellingOf builds a spelling of fence.<word> (lock or token) and the
// variant of one seed. A token is set to a stale 41, spelled with or
// without leading zeros.
func genSpellingOf(seed uint64, word string) (spelling, spellVariant) {
	g := &spellGen{r: rand.New(rand.NewPCG(seed, 0x5eed)), word: word}
	var v string
	if word == "token" {
		v = g.pick("41", "041", "0041")
	} else {
		v = g.lockValue()
	}
	sp := spelling{value: v, token: word == "token"}
	vr := spellVariant{extended: g.one(2), inTx: g.one(2)}
	switch g.r.IntN(7) {
	case 0, 1: // SET [SESSION | LOCAL]
		kw := g.pick("SET", "set", "SET SESSION", "Set Session")
		if g.one(3) {
			kw = g.pick("SET LOCAL", "set local")
			sp.local = true
		}
		sp.stmts = []string{kw + " " + g.sep() + g.settingName() + g.sep() + g.pick(" = ", "=", " TO ", " to ") + g.setValue(v) + g.sep()}
	case 2, 3: // set_config with constants
		local := g.one(3)
		sp.local = local
		call := g.funcName() + g.sep() + "(" + g.sep() + g.str(g.randCase(g.setting())) + g.sep() + "," + g.sep() + g.str(v) + "," + " " + g.boolSpelling(local) + g.sep() + ")"
		sp.stmts = []string{g.pick("SELECT ", "select ", "SELECT * FROM ", "VALUES (", "SELECT 1 WHERE ", "SELECT 1, ")}
		switch {
		case strings.HasPrefix(sp.stmts[0], "VALUES"):
			sp.stmts[0] += call + ")"
		case strings.HasSuffix(sp.stmts[0], "WHERE "):
			sp.stmts[0] += call + " IS NOT NULL"
		default:
			sp.stmts[0] += call
		}
	case 4: // set_config with bound parameters
		local := g.one(3)
		sp.local = local
		vr.extended = true
		name := g.randCase(g.setting())
		switch g.r.IntN(3) {
		case 0:
			sp.stmts = []string{"SELECT " + g.funcName() + "($1, $2, " + g.boolSpelling(local) + ")"}
			sp.args = []any{name, v}
		case 1:
			sp.stmts = []string{"SELECT " + g.funcName() + "($1::text, $2, $3)"}
			sp.args = []any{name, v, local}
		default:
			sp.stmts = []string{"SELECT " + g.funcName() + "(" + g.str(name) + ", $1, " + g.boolSpelling(local) + ")"}
			sp.args = []any{v}
		}
	case 5: // startup parameter
		sp.startup = param(g.randCase(g.setting()), v)
	default: // startup options
		var opts []string
		if g.one(3) {
			opts = append(opts, "-c", g.setting()+"="+g.pick("decoy", "44"))
		}
		name := g.optEscape(g.randCase(g.setting()))
		val := g.optEscape(v)
		switch g.r.IntN(3) {
		case 0:
			opts = append(opts, "-c", name+"="+val)
		case 1:
			opts = append(opts, "-c"+name+"="+val)
		default:
			opts = append(opts, "--"+name+"="+val)
		}
		if g.one(3) {
			opts = append(opts, "-c", "work_mem=4MB")
		}
		var b strings.Builder
		b.WriteString(g.pick("", " ", "\t"))
		for i, o := range opts {
			if i > 0 {
				b.WriteString(g.pick(" ", "  ", "\t", " \t "))
			}
			b.WriteString(o)
		}
		b.WriteString(g.pick("", " ", "\n"))
		sp.startup = options(b.String())
	}
	if sp.local {
		vr.inTx = true
	}
	if sp.startup != nil {
		var c pgx.ConnConfig
		c.RuntimeParams = map[string]string{}
		sp.startup(&c)
		delete(c.RuntimeParams, "fence.token")
		keys := make([]string, 0, len(c.RuntimeParams))
		for k, val := range c.RuntimeParams {
			keys = append(keys, fmt.Sprintf("%s=%q", k, val))
		}
		slices.Sort(keys)
		sp.name = "startup " + strings.Join(keys, " ")
	} else {
		sp.name = fmt.Sprintf("%q", sp.stmts[0])
		if sp.args != nil {
			sp.name += fmt.Sprintf(" %q", sp.args)
		}
	}
	if !utf8.ValidString(sp.name) {
		sp.name = fmt.Sprintf("%+q", sp.name)
	}
	vr.name = map[bool]string{false: "simple", true: "extended"}[vr.extended]
	if vr.inTx {
		vr.name += "-in-tx"
	}
	return sp, vr
}
