package policy

import (
	"context"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"unsafe"

	"github.com/jackc/pgx/v5/pgproto3"
	pg "github.com/pganalyze/pg_query_go/v6"
	"go.uber.org/zap"

	"github.com/fenceproxy/fenceproxy/internal/catalog"
	"github.com/fenceproxy/fenceproxy/internal/dbsetup"
	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/rules"
	"github.com/fenceproxy/fenceproxy/internal/sqllex"
)

// A view, rule, parent or foreign key created on another connection after
// a database's check opens a path the check's IndirectSet does not list.
// Where the catalog watch counts such changes (dbsetup's watch.sql), a
// statement that may write is decided with the paths at hand and runs
// after a check in its own transaction, dbsetup.CatalogCheckProc with the
// stamp of those paths, which fails (FP003) when the stamp is another:
// no round trip of its own. A statement the check cannot go before (one
// of several in a Query, a DO block, a CALL, an EXECUTE, COPY, ...), and
// every write after a notification or a failed check until the paths are
// read again, is forwarded only once the stamp read for it — by a read
// that began after the statement arrived — equals the stamp of the
// results it is decided with; otherwise the database is checked again
// first, and while that cannot finish the statement is refused (FP003).
// See docs/design.md, "Catalog changes while the proxy runs".

// freshChecks is what the policy needs of Checks (dbsetup.Checker) to see
// catalog changes before a write: the stamp now, and a check that starts
// after a moment.
type freshChecks interface {
	Stamp(ctx context.Context, database string) (int64, error)
	WaitFresh(ctx context.Context, database string) error
}

// catalogWatcher is what the policy needs of the Auditor (audit.Listener)
// to hear of catalog changes: a listener in the database, started without
// waiting.
type catalogWatcher interface {
	WatchCatalog(database string)
}

// CatalogChanged is called when database's catalog watch notifies a
// change: its results are read again at the next statement, and statements
// prepared before are decided again before they next run (their writes
// then compare the stamp too). Once the check the change asked for has
// ended, its results are read, and where they changed, statements are
// decided again once more (followCatalog).
func (p *Policy) CatalogChanged(database string) {
	p.catalogMoved(database)
	p.followCatalog(database)
}

// askedChecks is what followCatalog needs of Checks (dbsetup.Checker).
type askedChecks interface {
	WaitAsked(ctx context.Context, database string) error
}

// catalogFollower counts a database's notifications that followCatalog
// has not yet followed.
type catalogFollower struct{ pending atomic.Int64 }

// followCatalog reads database's results once the checks asked for so
// far have ended. The next statement reads them anyway, but only reads
// move the generation, and a session that only executes statements it
// prepared decides nothing: its reads through a view created meanwhile
// (rules.Readers), which no stamp check catches, would go on registering
// nothing. One goroutine per database follows; a notification while it
// waits has it wait once more.
func (p *Policy) followCatalog(database string) {
	ac, ok := p.checks.(askedChecks)
	if !ok {
		return
	}
	v, _ := p.followers.LoadOrStore(database, &catalogFollower{})
	f := v.(*catalogFollower)
	if f.pending.Add(1) > 1 {
		return
	}
	go func() {
		for {
			n := f.pending.Load()
			ctx, cancel := context.WithTimeout(context.Background(), p.checkWait)
			err := ac.WaitAsked(ctx, database)
			cancel()
			if _, known := p.checkCache.byDB.Load(database); err == nil && known {
				p.refreshDBState(database)
			}
			if f.pending.Add(-n) == 0 {
				return
			}
		}
	}()
}

// catalogMoved marks database's results as older than its catalog: they
// are read again at the next statement, writes wait for a stamp read (and
// a new check) until the results' stamp moves, and statements prepared
// before are decided again before they next run.
func (p *Policy) catalogMoved(database string) {
	if v, ok := p.checkCache.byDB.Load(database); ok {
		st := v.(*dbChecks)
		st.moved.Store(true)
		st.expired.Store(true)
	}
	p.bumpGeneration(database)
}

// catalogCheckFailed handles the FP003 of dbsetup.CatalogCheckProc: the
// catalog moved after the paths the statement was decided with were read,
// and before it ran (and without a notification, or before it). The
// statement did not run; the database is checked again, and its retry
// waits for that. It reports whether e is that error.
func (p *Policy) catalogCheckFailed(info *proxy.SessionInfo, e *pgproto3.ErrorResponse) bool {
	if e.Code != rules.CodeRefused || !strings.HasPrefix(e.Message, catalogCheckMessage) {
		return false
	}
	p.log.Info("catalog changed after a write was decided; refused in its transaction", zap.String("database", info.Database),
		zap.String("detail", e.Detail), zap.Uint64("conn-id", info.ID))
	if p.checks != nil {
		p.checks.Recheck(info.Database)
	}
	p.catalogMoved(info.Database)
	return true
}

// catalogCheckMessage begins the message of the FP003 that
// dbsetup.CatalogCheckProc raises.
const catalogCheckMessage = "fenceproxy: the catalog of database "

// stampCheck is the in-band check a decision carries: on, the statement
// runs after dbsetup.CatalogCheckProc with stamp.
type stampCheck struct {
	on bool
	// stamped: the statement was decided with a stamp read, or is
	// decided with one where the catalog is known to have moved (a write,
	// DDL), so its decision may differ with the same results in force.
	stamped bool
	stamp   int64
	proc    string // the check procedure; "" for dbsetup.CatalogCheckProc
	// enter: the relay may fold the check into a call of rules.EnterProc
	// (the database has it, and the check is dbsetup.CatalogCheckProc,
	// which it calls).
	enter bool
	// holdAt: the relay may fold the check and a lock registration into a
	// call of rules.HoldAtProc (the database has it, and the check is
	// dbsetup.CatalogCheckProc, which it calls).
	holdAt bool
	// reholdAt: and into a call of rules.ReholdAtProc.
	reholdAt bool
}

// call returns the statement that runs the check.
func (c stampCheck) call() string {
	proc := c.proc
	if proc == "" {
		proc = dbsetup.CatalogCheckProc
	}
	// The stamp moves only when the catalog does: the text built last
	// serves the next writes (one entry, shared by the databases).
	if l := lastCall.Load(); l != nil && l.stamp == c.stamp && l.proc == proc {
		return l.text
	}
	text := "CALL " + proc + "(" + strconv.FormatInt(c.stamp, 10) + ")"
	lastCall.Store(&checkCall{stamp: c.stamp, proc: proc, text: text})
	return text
}

// checkCall is a check's statement for a stamp and procedure.
type checkCall struct {
	stamp      int64
	proc, text string
}

// lastCall is the check's statement built last (stampCheck.call).
var lastCall atomic.Pointer[checkCall]

// firstCall lists the check as the first statement of a Query; the relay
// only reads it.
var firstCall = []int{0}

// catalogCheck returns the registration that runs the check for stamp
// before text (the text sent: the client's, or its rewrite), in the same
// transaction: spliced in front of a Query's text, or bound and executed
// before each Bind of a Parse's. The relay runs a registration with
// Required in every session and swallows its CommandComplete. Audit: it
// registers no lock, so its success must not spare a later statement's
// lock registration in the transaction.
func catalogCheck(c stampCheck, text string) *rules.LockCall {
	call := c.call()
	// The call is ASCII and ends at its semicolon: the server reads the
	// text after it as it would read it alone.
	return &rules.LockCall{Call: call, Query: call + ";" + text, Calls: firstCall, Required: true, Audit: true, Catalog: true,
		Stamp: c.stamp, Enter: c.enter}
}

// checkedRegistration is the lock registration l with the catalog check
// for c before it: Pre for the relay, which runs it also where it spares
// or skips the registration, and in front of the registrations of a
// Query's text.
//
// The result is shared and never changed: the rules' decisions, and so
// their LockCalls, are cached, and the stamp moves only when the catalog
// does, so the last results (regMemo) serve the next writes without
// building the same text again.
func checkedRegistration(c stampCheck, l *rules.LockCall) *rules.LockCall {
	h := (uint64(uintptr(unsafe.Pointer(l))) * 0x9E3779B97F4A7C15) >> (64 - regMemoBits)
	a, b := &regMemo[h], &regMemo[h^1]
	ma, mb := a.Load(), b.Load()
	switch {
	case ma != nil && ma.l == l && ma.c == c:
		return ma.out
	case mb != nil && mb.l == l && mb.c == c:
		return mb.out
	}
	out := buildCheckedRegistration(c, l)
	m := &checkedReg{l: l, c: c, out: out}
	if ma == nil || ma.l == l {
		a.Store(m)
	} else {
		b.Store(m)
	}
	return out
}

// regMemoBits sizes regMemo: 2^regMemoBits slots, in pairs (a
// registration's result is in slot h or h^1 of its hash h), so that two
// registrations whose hashes meet do not take turns in one slot.
const regMemoBits = 8

// regMemo holds checkedRegistration's last results.
var regMemo [1 << regMemoBits]atomic.Pointer[checkedReg]

// checkedReg is checkedRegistration's result out for c and l.
type checkedReg struct {
	l   *rules.LockCall
	c   stampCheck
	out *rules.LockCall
}

// buildCheckedRegistration is checkedRegistration, built.
func buildCheckedRegistration(c stampCheck, l *rules.LockCall) *rules.LockCall {
	r := l
	call := c.call()
	out := *r
	out.Pre = call
	out.Stamp, out.Enter, out.HoldAt, out.ReholdAt = c.stamp, c.enter, c.holdAt, c.reholdAt
	if len(r.Calls) > 0 {
		out.Query = call + ";" + r.Query
		out.Calls = make([]int, 0, len(r.Calls)+1)
		out.Calls = append(out.Calls, 0)
		for _, k := range r.Calls {
			out.Calls = append(out.Calls, k+1)
		}
	}
	return &out
}

// inBandWrite reports whether the check can run just before sql without
// changing what sql does: sql is one statement (no semicolon but at its
// end, where only spaces, comments and semicolons may follow) that
// begins, after spaces, comments and semicolons, with one of the keywords
// below, none of which statements that must run outside a transaction
// block (VACUUM, CREATE INDEX CONCURRENTLY, ...) or that end or control
// transactions (COMMIT, a CALL or DO that commits) begin with. It is
// conservative: a text it rejects is checked by a stamp read before it is
// forwarded instead (and, with several statements, frontCheck).
func inBandWrite(sql string) bool {
	i := skipFiller(sql, 0)
	j := i
	for j < len(sql) && sqllex.IsIdentCont(sql[j]) {
		j++
	}
	switch w := sql[i:j]; {
	case strings.EqualFold(w, "update"), strings.EqualFold(w, "insert"), strings.EqualFold(w, "delete"),
		strings.EqualFold(w, "merge"), strings.EqualFold(w, "with"), strings.EqualFold(w, "select"),
		strings.EqualFold(w, "truncate"), strings.EqualFold(w, "explain"):
	default:
		return false
	}
	k := strings.IndexByte(sql[j:], ';')
	return k < 0 || skipFiller(sql, j+k) == len(sql)
}

// skipFiller returns the index of the first byte of sql at or after i
// that is not a space, a semicolon or in a comment.
func skipFiller(sql string, i int) int {
	for i < len(sql) {
		switch c := sql[i]; {
		case sqllex.IsSpace(c) || c == ';':
			i++
		case c == '-' && i+1 < len(sql) && sql[i+1] == '-':
			i = sqllex.SkipLineComment(sql, i)
		case c == '/' && i+1 < len(sql) && sql[i+1] == '*':
			i = sqllex.SkipBlockComment(sql, i)
		default:
			return i
		}
	}
	return i
}

// frontCheck reports whether the check can go in front of sql, a text
// inBandWrite rejects, as a statement of its own before the text's: sql
// holds several statements (as PostgreSQL's parser reads it), which run
// in one implicit transaction already, so one more in front changes
// nothing of what they do (a statement that must run outside a
// transaction block fails there anyway, a procedure or DO block cannot
// commit, and a BEGIN makes the implicit transaction an explicit one,
// keeping what the check set). The check's lock_timeout then holds for
// the text's statements up to a COMMIT or ROLLBACK; the stamp read before
// the text is forwarded stays, for those after one. A text that begins by
// ending or rolling back a transaction the session opened before keeps
// the stamp read alone: a failed check there would abort that
// transaction instead of ending it as the client asked.
func frontCheck(sql string) bool {
	tree, err := pg.Parse(sql)
	if err != nil || len(tree.Stmts) < 2 {
		return false
	}
	if ts := tree.Stmts[0].GetStmt().GetTransactionStmt(); ts != nil {
		switch ts.Kind {
		case pg.TransactionStmtKind_TRANS_STMT_BEGIN, pg.TransactionStmtKind_TRANS_STMT_START, pg.TransactionStmtKind_TRANS_STMT_SAVEPOINT:
		default:
			return false
		}
	}
	for _, raw := range tree.Stmts {
		if setsTransaction(raw.GetStmt()) {
			return false
		}
	}
	return true
}

// setsTransaction reports whether n sets what must be set before a
// transaction's first query (PostgreSQL's 25001 otherwise), which a check
// in front would be: a BEGIN or START TRANSACTION with modes, SET
// TRANSACTION (ISOLATION LEVEL, READ ONLY, SNAPSHOT, ...) or a SET of a
// transaction_* setting.
func setsTransaction(n *pg.Node) bool {
	if ts := n.GetTransactionStmt(); ts != nil {
		return len(ts.Options) > 0
	}
	if v := n.GetVariableSetStmt(); v != nil {
		return v.Kind == pg.VariableSetKind_VAR_SET_MULTI || strings.HasPrefix(strings.ToLower(v.Name), "transaction_")
	}
	return false
}

// bumpGeneration makes the relay decide every prepared statement of
// database's sessions again before it next runs (proxy.Policy.Generation),
// with the results in force.
func (p *Policy) bumpGeneration(database string) {
	if p.dbGens.bump(database) {
		return
	}
	// No room for another database's count: every database's sessions
	// decide again, which is more work and never less safe.
	p.swapMu.Lock()
	defer p.swapMu.Unlock()
	cur := p.current.Load()
	next := *cur
	next.gen = cur.gen + 1
	p.current.Store(&next)
}

// dbGenerations counts, per database, the changes of its check results
// that its prepared statements must be decided again after. A count only
// grows and is never removed (a removed one would start again at zero,
// and a statement decided under the old count would pass for current);
// the databases counted are bounded, as the checked ones are. Reads take
// no lock and allocate nothing: the relay reads a count at every Parse
// and Bind.
type dbGenerations struct {
	mu sync.Mutex // orders writers of m
	m  atomic.Pointer[map[string]*atomic.Uint64]
}

func (g *dbGenerations) get(database string) uint64 {
	if m := g.m.Load(); m != nil {
		if c := (*m)[database]; c != nil {
			return c.Load()
		}
	}
	return 0
}

// bump adds one to database's count; false when it has none and no more
// databases can be counted.
func (g *dbGenerations) bump(database string) bool {
	if m := g.m.Load(); m != nil {
		if c := (*m)[database]; c != nil {
			c.Add(1)
			return true
		}
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	var old map[string]*atomic.Uint64
	if m := g.m.Load(); m != nil {
		old = *m
	}
	if c := old[database]; c != nil {
		c.Add(1)
		return true
	}
	if len(old) >= maxCheckedDBs {
		return false
	}
	next := make(map[string]*atomic.Uint64, len(old)+1)
	for k, v := range old {
		next[k] = v
	}
	c := new(atomic.Uint64)
	c.Store(1)
	next[database] = c
	g.m.Store(&next)
	return true
}

// freshState returns database's check results as they are after every
// change of its catalog committed before now, or the refusal of sql when
// they cannot be had.
func (p *Policy) freshState(info *proxy.SessionInfo, st *dbChecks, sql string) (*dbChecks, *rules.Error) {
	fc, ok := p.checks.(freshChecks)
	if !ok {
		return st, nil
	}
	db := info.Database
	ctx, cancel := context.WithTimeout(context.Background(), p.checkWait)
	defer cancel()
	stamp, err := fc.Stamp(ctx, db)
	if err != nil {
		return nil, catalogUnknown(db, "its catalog stamp could not be read: "+err.Error())
	}
	if stamp == st.stamp {
		// Read after the statement arrived: the results are current.
		st.moved.Store(false)
		return st, nil
	}
	// A notification may have had the database checked already.
	if res, known := p.checks.Result(db); !known || res.Stamp != stamp {
		if err := fc.WaitFresh(ctx, db); err != nil {
			return nil, catalogUnknown(db, "the check after the change has not finished: "+err.Error())
		}
	}
	next := p.refreshDBState(db)
	if next == nil || !next.known {
		return nil, catalogUnknown(db, "the check after the change could not run")
	}
	p.log.Info("catalog changed; checked again before a write", zap.String("database", db),
		zap.Int64("stamp", next.stamp), zap.Int("indirect-paths", len(next.paths)), zap.Uint64("conn-id", info.ID))
	if !equalPaths(st.paths, next.paths) && hasWord(sql, "execute") {
		// EXECUTE runs a statement prepared before the change, which the
		// relay decides again only once the generation has moved, as it
		// now has: the next try is decided with the new paths.
		return nil, catalogUnknown(db, "a statement prepared before the change is decided again at its next EXECUTE")
	}
	return next, nil
}

// catalogUnknown is the refusal of a write while a database's catalog is
// not known to be the one its check results describe.
func catalogUnknown(db, why string) *rules.Error {
	return &rules.Error{
		Code: rules.CodeRefused,
		Message: "fenceproxy: the catalog of database " + db + " changed since the proxy's last check: a write that may reach a protected table " +
			"through a new view, rule, parent or foreign key is refused until the proxy has checked it again",
		Detail: why,
		Hint:   "Retry the statement.",
	}
}

// equalPaths reports whether a and b list the same paths.
func equalPaths(a, b []catalog.IndirectPath) bool {
	return slices.EqualFunc(a, b, func(x, y catalog.IndirectPath) bool {
		return x.Schema == y.Schema && x.Name == y.Name && x.Target == y.Target && x.Kind == y.Kind &&
			x.Via == y.Via && slices.Equal(x.Ops, y.Ops) && slices.Equal(x.Columns, y.Columns) &&
			x.NewPartitions == y.NewPartitions && x.NewChildren == y.NewChildren
	})
}

// mayWrite reports whether sql holds, as a word (ASCII case ignored), one
// of the words without which a statement cannot write through a relation:
// the statement kinds that write, COPY (FROM), and EXECUTE of a prepared
// statement. In a comment, a literal or a quoted name they only cost a
// stamp read.
func mayWrite(sql string) bool {
	return scanWords(sql, func(w [8]byte, n int) bool {
		switch string(w[:n]) { // no allocation: the conversion is only compared
		case "insert", "update", "delete", "merge", "copy", "truncate", "execute":
			return true
		}
		return false
	})
}

// hasWord reports whether sql holds word (lower case) as a word.
func hasWord(sql, word string) bool {
	return scanWords(sql, func(w [8]byte, n int) bool { return string(w[:n]) == word })
}

// scanWords calls match with each word of sql of 4 to 8 ASCII letters,
// lowered (its first n bytes; passed by value, so that nothing of it
// escapes to the heap), until it returns true. A word is a run of identifier bytes
// (letters, digits, _, $, bytes >= 0x80): "updated_at" is not "update".
func scanWords(sql string, match func(w [8]byte, n int) bool) bool {
	var buf [8]byte
	for i := 0; i < len(sql); {
		if !sqllex.IsIdentCont(sql[i]) {
			i++
			continue
		}
		j := i
		for j < len(sql) && sqllex.IsIdentCont(sql[j]) {
			j++
		}
		if n := j - i; n >= 4 && n <= len(buf) {
			ok := true
			for k := 0; k < n; k++ {
				c := sql[i+k]
				switch {
				case 'a' <= c && c <= 'z':
				case 'A' <= c && c <= 'Z':
					c += 'a' - 'A'
				default:
					ok = false
				}
				buf[k] = c
			}
			if ok && match(buf, n) {
				return true
			}
		}
		i = j
	}
	return false
}
