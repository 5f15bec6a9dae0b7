package fencing_test

import (
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/rules"
	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// TestGenerationPerDatabase: one proxy, two databases with the catalog
// watch. A session of the first PREPAREs a write of a protected table
// (SQL PREPARE, and a Parse of its own). The second database's catalog
// changes, and the proxy checks it again (a write there meets the
// catalog check): the first session's statements run as they were
// prepared, and none is decided again, since nothing of their database
// changed (the relay's decisions are counted per database). Then the
// first database's own catalog changes: both statements are decided
// again once, and run. The data in PostgreSQL is what the statements
// that ran wrote.
func TestGenerationPerDatabase(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	hooks := &decisionCount{byDB: make(map[string]int)}
	p, specs := fkProxy(t, hijackRules, func(o *proxy.Options) { o.Hooks = hooks })
	// Lock L, token 5, in both databases.
	dA, cA := rvRuleDB(t, p, specs, "L")
	dB, cB := rvRuleDB(t, p, specs, "L")
	ctx := ctxT(t)

	const write = "UPDATE acct SET n = n + 1 WHERE id = $1"
	if _, err := cA.Exec(ctx, "PREPARE gw(bigint) AS "+write, pgx.QueryExecModeSimpleProtocol); err != nil {
		t.Fatal(err)
	}
	if _, err := cA.Prepare(ctx, "gp", write); err != nil {
		t.Fatal(err)
	}
	nA := func() int {
		var n int
		if err := dA.QueryRow(ctx, "SELECT n FROM acct WHERE id = 1").Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	n0, ran := nA(), 0 // ran: the statements that ran, each adding 1 to n
	run := func() (sqlErr, protoErr error) {
		if _, sqlErr = cA.Exec(ctx, "EXECUTE gw(1)", pgx.QueryExecModeSimpleProtocol); sqlErr == nil {
			ran++
		}
		if _, protoErr = cA.Exec(ctx, "gp", 1); protoErr == nil {
			ran++
		}
		return
	}
	if a, b := run(); a != nil || b != nil {
		t.Fatalf("before any change: EXECUTE %v, prepared statement %v", a, b)
	}
	// What one run costs in decisions with nothing changed: the EXECUTE
	// Query's text (the Bind of gp decides nothing).
	dbA := cA.Config().Database
	base := hooks.get(dbA)
	if a, b := run(); a != nil || b != nil {
		t.Fatalf("before any change, again: EXECUTE %v, prepared statement %v", a, b)
	}
	perRun := hooks.get(dbA) - base

	// The other database changes three times, each seen by the proxy
	// before the first session runs its statements again.
	for i := range 3 {
		execDirect(t, dB, "CREATE TABLE gen_other_"+string(rune('a'+i))+" (i int)")
		if err := retryCatalogCheck(t, func() error {
			_, err := cB.Exec(ctx, "UPDATE acct SET n = n WHERE id = 1", pgx.QueryExecModeSimpleProtocol)
			return err
		}); err != nil {
			t.Fatalf("write in the other database after its change: %v", err)
		}
		before := hooks.get(dbA)
		if a, b := run(); a != nil || b != nil {
			t.Errorf("after change %d of the other database: EXECUTE %v, prepared statement %v", i+1, a, b)
		}
		// Had the other database's change moved this session's
		// generation, gw and gp would have been decided again too.
		if got := hooks.get(dbA) - before; got != perRun {
			t.Errorf("after change %d of the other database: %d decisions in the first database for a run, want %d (nothing decided again)", i+1, got, perRun)
		}
	}
	if n := nA() - n0; n != ran || ran != 10 {
		t.Errorf("acct.n moved by %d in the first database, want %d, the statements that ran (of 10)", n, ran)
	}

	// The first database's own change: the proxy learns of it at the next
	// write there; the statements prepared before are decided again.
	execDirect(t, dA, "CREATE TABLE gen_own (i int)")
	before, runs := hooks.get(dbA), 1
	sqlErr, protoErr := run()
	if isCatalogCheck(sqlErr) {
		// The EXECUTE's own check found the change: the proxy checks
		// the database again, and the retry runs under the new results.
		runs++
		sqlErr, protoErr = run()
	}
	if sqlErr != nil || protoErr != nil {
		t.Fatalf("after the first database's change: EXECUTE %v, prepared statement %v", sqlErr, protoErr)
	}
	// gp is decided again at its first Bind after the proxy read the new
	// results; gw at an EXECUTE decided after that (its paths did not
	// change, so the EXECUTE that had the database checked again runs
	// it as it was decided).
	runs++
	if a, b := run(); a != nil || b != nil {
		t.Fatalf("after the first database's change, again: EXECUTE %v, prepared statement %v", a, b)
	}
	if got, want := hooks.get(dbA)-before, runs*perRun+2; got != want {
		t.Errorf("after the first database's change: %d decisions in %d runs, want %d (gw and gp decided again once)", got, runs, want)
	}
	if n := nA() - n0; n != ran {
		t.Errorf("acct.n moved by %d in the first database, want %d, the statements that ran", n, ran)
	}
}

// decisionCount counts the relay's decisions per database.
type decisionCount struct {
	proxy.NopHooks
	mu   sync.Mutex
	byDB map[string]int
}

func (h *decisionCount) Statement(info *proxy.SessionInfo, _ rules.Decision, _ time.Duration) {
	h.mu.Lock()
	h.byDB[info.Database]++
	h.mu.Unlock()
}

func (h *decisionCount) get(db string) int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.byDB[db]
}
