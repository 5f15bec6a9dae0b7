package dbsetup

import (
	_ "embed"
	"maps"
	"slices"
	"strings"

	"github.com/fenceproxy/fenceproxy/internal/guard"
	"github.com/fenceproxy/fenceproxy/internal/rules"
)

// objectsSQL creates the fenceproxy schema, its tables and the register
// procedure. Every statement in it is idempotent; Setup runs it in one
// transaction.
//
//go:embed objects.sql
var objectsSQL string

// Version is the version of the objects in objects.sql, stored in
// fenceproxy.meta under the key 'version'. Setup refuses to replace objects
// of a newer version; the proxy works with older ones as far as they go
// (lockVersion, raisersVersion).
const Version = 10

// lockVersion is the oldest version whose objects lock fencing works
// with. Versions 2 and 3 added the error raisers (raiserFuncs) and left
// the register procedure as it was (registerBodyV1); version 4 made the
// procedure cheaper and left the raisers as they were; version 5 added
// the raisers of the token form (staleAtVersion); version 6 the cheaper
// registration, fenceproxy.hold (holdVersion); version 7 the call that
// stands for three statements of the proxy's own, fenceproxy.enter
// (enterVersion); version 8 the one call in front of a simple Query that
// registers a lock, fenceproxy.hold_at (holdAtVersion); version 9 its
// form for a holder that registered its token before, rehold_at
// (reholdAtVersion); version 10 the index its read of the watermark uses
// (nameIndexVersion).
const lockVersion = 1

// raisersVersion is the oldest version whose error raisers are those of
// objects.sql, apart from those added later (raiser.since).
const raisersVersion = 3

// registerV4Version is the version that made the register procedure what
// it is (registerBody); earlier ones installed registerBodyV1.
const registerV4Version = 4

// staleAtVersion is the version that added stale_at and stale_at_b, which
// the token form of a rewrite calls (Report.StaleAt).
const staleAtVersion = 5

// holdVersion is the version that added fenceproxy.hold, register's
// common case at a lower cost, which the proxy then calls in its place
// (Report.Hold).
const holdVersion = 6

// enterVersion is the version that added fenceproxy.enter, which sets the
// session's fence settings, runs the catalog check and registers in one
// call (Report.Enter).
const enterVersion = 7

// holdAtVersion is the version that added fenceproxy.hold_at, which runs
// the catalog check and registers a lock and a token given as values, in
// one call (Report.HoldAt).
const holdAtVersion = 8

// reholdAtVersion is the version that added fenceproxy.rehold_at,
// hold_at for a session whose registration of the same lock and token
// committed before: one read of the watermark, after the shared lock
// (Report.ReholdAt).
const reholdAtVersion = 9

// nameIndexVersion is the version that added the index locks_name_c and
// the reads of the watermark by it in hold, hold_at and rehold_at (the
// lock names compared byte by byte, not under the database's collation).
// Those procedures as earlier versions installed them (byPrimaryKey) are
// accepted as well.
const nameIndexVersion = 10

// registerBody is the register procedure's source in objects.sql, the text
// between its $body$ quotes, as pg_proc.prosrc keeps it. Check compares
// them: a procedure replaced by hand, or installed by another build of the
// same version, is reported.
var registerBody = dollarBody(objectsSQL, "body")

// holdBody is the hold procedure's source in objects.sql, compared as
// registerBody is.
var holdBody = dollarBody(objectsSQL, "hold")

// enterBody is the enter procedure's source in objects.sql, compared as
// registerBody is.
var enterBody = dollarBody(objectsSQL, "enter")

// holdAtBody is the hold_at procedure's source in objects.sql, compared
// as registerBody is.
var holdAtBody = dollarBody(objectsSQL, "hold_at")

// reholdAtBody is the rehold_at procedure's source in objects.sql,
// compared as registerBody is.
var reholdAtBody = dollarBody(objectsSQL, "rehold_at")

// byPrimaryKey returns sql (a procedure's body, or its CREATE statement
// from objects.sql) with its reads of the watermark as versions before
// nameIndexVersion wrote them: the lock names compared under the column's
// collation, by the primary key, rather than by locks_name_c. hold (as
// versions 6 to 9 installed it), hold_at (8 and 9) and rehold_at (9)
// were exactly that; the check accepts them as current, the same
// procedures reading more slowly.
func byPrimaryKey(sql string) string { return byKeyEdit.replace(sql) }

var byKeyEdit = bodyEdit{now: `l.name COLLATE pg_catalog."C" OPERATOR`, before: `l.name OPERATOR`}

// bodyEdit is an edit that turns the source of this version's objects
// (a procedure's body, its CREATE statement, a whole file) into an
// earlier version's: every now becomes before.
type bodyEdit struct{ now, before string }

// replace returns sql with the edit made; it panics where sql does not
// hold e.now (the sources are embedded: a bug of this package).
func (e bodyEdit) replace(sql string) string {
	if !strings.Contains(sql, e.now) {
		panic("dbsetup: no " + e.now + " to edit")
	}
	return strings.ReplaceAll(sql, e.now, e.before)
}

// holdBodyByKey, holdAtBodyByKey and reholdAtBodyByKey are the bodies of
// hold, hold_at and rehold_at as versions before nameIndexVersion
// installed them (byPrimaryKey).
var (
	holdBodyByKey     = byPrimaryKey(holdBody)
	holdAtBodyByKey   = byPrimaryKey(holdAtBody)
	reholdAtBodyByKey = byPrimaryKey(reholdAtBody)
)

// registerV1SQL is the register procedure of versions 1 to 3, which Check
// accepts in a database whose objects are of one of those versions.
//
//go:embed register_v1.sql
var registerV1SQL string

var registerBodyV1 = dollarBody(registerV1SQL, "body")

// raiser is an error raiser the rewritten statements call (objects.sql,
// where each function's body is quoted with its name as the dollar tag).
// Check compares both before the proxy uses them.
type raiser struct {
	// body is its source, as pg_proc.prosrc keeps it.
	body string
	// signature is its arguments and result, as
	// pg_get_function_identity_arguments and the result type print them:
	// the calls the rewriter writes resolve to these, and to no overload.
	signature string
	// since is the version that added it: a database with objects of an
	// earlier version has the others only.
	since int
}

var raiserFuncs = func() map[string]raiser {
	out := map[string]raiser{}
	for name, r := range map[string]raiser{
		"stale":      {signature: "token_setting text, fence bigint, sized_table text -> bigint", since: raisersVersion},
		"stale_b":    {signature: "token_setting text, fence bigint, sized_table text -> boolean", since: raisersVersion},
		"no_token":   {signature: "token_setting text, sized_names text -> bigint", since: raisersVersion},
		"no_token_b": {signature: "token_setting text, sized_names text -> boolean", since: raisersVersion},
		"tok":        {signature: "token_setting text, sized_names text -> bigint", since: raisersVersion},
		"tok_b":      {signature: "token_setting text, sized_names text -> boolean", since: raisersVersion},
		"advance":    {signature: "token_setting text, fence bigint, strict boolean, sized_table text, sized_names text -> bigint", since: raisersVersion},
		"stale_at":   {signature: "fence bigint -> bigint", since: staleAtVersion},
		"stale_at_b": {signature: "fence bigint -> boolean", since: staleAtVersion},
	} {
		r.body = dollarBody(objectsSQL, name)
		out[name] = r
	}
	return out
}()

// RaiserNames returns the names of the error raisers in schema
// fenceproxy, sorted.
func RaiserNames() []string { return slices.Sorted(maps.Keys(raiserFuncs)) }

// dollarBody returns the text between the first "AS $tag$" of sql and the
// "$tag$;" after it.
func dollarBody(sql, tag string) string {
	_, rest, _ := strings.Cut(sql, "AS $"+tag+"$")
	body, _, _ := strings.Cut(rest, "$"+tag+"$;")
	return body
}

// registerSignature is the register procedure as GRANT and REVOKE name it.
const registerSignature = "fenceproxy.register(text, text, boolean, boolean, text, text)"

// Problem is something in a database that keeps fenceproxy from working as
// configured, found by Check.
type Problem struct {
	// Table is the protected table (rules.TableSpec.Display), "" for a
	// problem of the database as a whole.
	Table string
	// Description says what is wrong.
	Description string
	// Fix is the SQL to run (as the table's owner or a superuser, on a
	// direct connection), or the fenceproxy command, that fixes it. In a
	// command, FILE stands for the configuration file: see FixFor.
	Fix string

	setup bool   // `fenceproxy setup -c FILE` + flags fixes it
	flags string // "" or " --add-columns"
	sql   string // the SQL alternative to the command, if any
}

// FixFor returns p.Fix with FILE replaced by configFile (quoted for a POSIX
// shell when needed) in a `fenceproxy setup -c FILE` command.
func (p Problem) FixFor(configFile string) string {
	if !p.setup || configFile == "" {
		return p.Fix
	}
	return setupFixText(shellQuote(configFile), p.flags, p.sql)
}

// sqlProblem returns a problem fixed by hand: fix is SQL, or says what to
// change where no SQL can.
func sqlProblem(table, description, sql string) Problem {
	return Problem{Table: table, Description: description, Fix: sql}
}

// setupProblem returns a problem that `fenceproxy setup` with flags fixes,
// or the SQL sql when it is not "".
func setupProblem(table, description, flags, sql string) Problem {
	return Problem{Table: table, Description: description, Fix: setupFixText("FILE", flags, sql), setup: true, flags: flags, sql: sql}
}

func setupFixText(file, flags, sql string) string {
	fix := "fenceproxy setup -c " + file + flags
	if sql != "" {
		fix += " (or in SQL: " + sql + ")"
	}
	return fix
}

// Note is information that is not a problem, e.g. that a table of an
// entry without a database scope does not exist in this database.
type Note struct {
	Table string // as in Problem
	Text  string
}

// Report is the outcome of Setup or Check in one database.
type Report struct {
	Database string // current_database() of the connection
	// Version is the version of the fenceproxy objects found before Setup
	// changed anything, or by Check; 0 when there were none.
	Version int
	// Actions lists what Setup changed, in order; empty when there was
	// nothing to do. Check leaves it empty.
	Actions []string
	// Problems lists what Check found wrong; empty when the database is
	// ready. Setup leaves it empty (run Check after it).
	Problems []Problem
	// Notes is information that needs no action.
	Notes []Note
	// Guarded lists, by display name (rules.TableSpec.Display), the
	// tables whose database guard Check found in place and as the
	// configuration needs it: writes to them are fenced by PostgreSQL
	// however they arrive. Setup leaves it empty.
	Guarded []string
	// Raisers reports that Check found the error raisers of this version
	// (RaiserNames) current and callable by every role (PUBLIC has USAGE
	// on schema fenceproxy and EXECUTE on them): the proxy's rewrites may
	// call them. Setup leaves it false.
	Raisers bool
	// StaleAt reports that Check found, besides, the raisers of version 5
	// (fenceproxy.stale_at and stale_at_b) current and callable by every
	// role: the token form of a rewrite may call them.
	StaleAt bool
	// Hold reports that Check found, besides a current register
	// procedure, the hold procedure of version 6 current and callable by
	// every role (and fenceproxy.locks readable by every role, which it
	// reads with the caller's rights): the proxy's lock registrations may
	// call it (rules.HoldProc) in place of register.
	Hold bool
	// Enter reports that Check found, besides Hold, the enter procedure of
	// version 7 current and callable by every role: the proxy may send
	// the session's fence settings, the catalog check and the lock
	// registration before a statement as one call of it (rules.EnterProc).
	Enter bool
	// HoldAt reports that Check found, besides Enter, the hold_at
	// procedure of version 8 current and callable by every role: the
	// proxy may send the catalog check and a lock registration with the
	// session's values as one call of it in front of a simple Query
	// (rules.HoldAtProc).
	HoldAt bool
	// ReholdAt reports that Check found, besides HoldAt, the rehold_at
	// procedure of version 9 current and callable by every role: the
	// proxy may call it in place of hold_at for a session whose
	// registration of the same lock and token committed before
	// (rules.ReholdAtProc).
	ReholdAt bool
	// Watched reports that Check found the catalog watch in place (see
	// watch.sql): changes of the catalog are counted in fenceproxy.catalog
	// and notified on CatalogChannel. Setup leaves it false.
	Watched bool
	// CheckProc is the watch's check procedure, when Watched:
	// CatalogCheckProc, or LegacyCatalogCheckProc where setup last ran
	// with an earlier version.
	CheckProc string
}

// OK reports whether Check found no problem.
func (r *Report) OK() bool { return len(r.Problems) == 0 }

// Databases returns the databases that specs need set up or checked, sorted:
// every database named in the scope of an entry that is not off, and
// dsnDatabase when some such entry has no database scope (it applies in
// every database; the connection's own database stands for them). When
// dsnDatabase is "" and it is needed, the result holds "", so that a caller
// can ask for a database to be named.
func Databases(specs []rules.TableSpec, dsnDatabase string) []string {
	var out []string
	for _, s := range specs {
		if s.Mode == rules.ModeOff {
			continue
		}
		if len(s.Scope.Databases) == 0 {
			out = append(out, dsnDatabase)
			continue
		}
		out = append(out, s.Scope.Databases...)
	}
	slices.Sort(out)
	return slices.Compact(out)
}

// appliesIn reports whether the entry s is checked in database db.
func appliesIn(s rules.TableSpec, db string) bool {
	return s.Mode != rules.ModeOff && (len(s.Scope.Databases) == 0 || slices.Contains(s.Scope.Databases, db))
}

// applying returns the entries of specs that apply in database db.
func applying(specs []rules.TableSpec, db string) []rules.TableSpec {
	var out []rules.TableSpec
	for _, s := range specs {
		if appliesIn(s, db) {
			out = append(out, s)
		}
	}
	return out
}

// guardProblem is a problem the guard's Check found: fixed by
// `fenceproxy setup --guard` unless it says what to do by hand.
func guardProblem(p guard.Problem) Problem {
	if p.Fix != "" {
		return sqlProblem(p.Table, p.Description, p.Fix)
	}
	return setupProblem(p.Table, p.Description, " --guard", "")
}

// shellQuote quotes s for a POSIX shell when it needs it.
func shellQuote(s string) string {
	plain := s != ""
	for _, c := range s {
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '/' || c == '.' || c == '_' || c == '-' || c == ':' || c == '@' || c == '+' || c == '=' || c == ',') {
			plain = false
			break
		}
	}
	if plain {
		return s
	}
	out := "'"
	for _, c := range s {
		if c == '\'' {
			out += `'\''`
		} else {
			out += string(c)
		}
	}
	return out + "'"
}
