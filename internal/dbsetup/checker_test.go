package dbsetup_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/fenceproxy/fenceproxy/internal/dbsetup"
	"github.com/fenceproxy/fenceproxy/internal/rules"
)

type checkResult struct {
	database string
	problems int
	known    bool
}

// resultMetrics passes the check results on.
type resultMetrics chan checkResult

func (m resultMetrics) CheckResult(database string, problems int, known bool) {
	select {
	case m <- checkResult{database, problems, known}:
	default: // full: a test that reads no more (a periodic run must not block Close)
	}
}

func nextResult(t *testing.T, m resultMetrics) checkResult {
	t.Helper()
	select {
	case r := <-m:
		return r
	case <-time.After(30 * time.Second):
		t.Fatal("no check result")
		return checkResult{}
	}
}

// TestChecker: a database is checked once the configuration is known and
// the database used; problems are known after the run, logged once and
// counted; a reload checks again; a database it cannot connect to stays
// unknown.
func TestChecker(t *testing.T) {
	db := newDatabase(t)
	conn := connect(t, db)
	execSQL(t, conn, "CREATE TABLE config (id int PRIMARY KEY)")
	sp := specs(t, rules.Table{Table: "public.config"})
	if _, err := dbsetup.Setup(t.Context(), conn, sp, dbsetup.SetupOptions{}); err != nil {
		t.Fatal(err)
	}

	release := make(chan struct{})
	connectDB := func(ctx context.Context, database string) (*pgx.Conn, error) {
		if database == db {
			select {
			case <-release:
			case <-ctx.Done():
				return nil, ctx.Err()
			}
		}
		return pgx.Connect(ctx, shared.Cluster.SuperuserDSN(database))
	}
	core, logs := observer.New(zapcore.InfoLevel)
	metrics := make(resultMetrics, 10)
	c := dbsetup.NewChecker(connectDB, zap.New(core), metrics)
	defer c.Close()

	c.Ensure(db)
	c.Reload(sp)
	if _, known := c.Result(db); known {
		t.Error("problems known while the check is still connecting")
	}
	close(release)
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	if err := c.Wait(ctx, db); err != nil {
		t.Fatal(err)
	}
	res, known := c.Result(db)
	problems := res.Problems
	if !known || len(problems) != 1 || len(problems["public.config"]) != 1 ||
		!strings.Contains(problems["public.config"][0].Description, "last_fence is missing") {
		t.Fatalf("problems %+v, known %v; want the missing column", problems, known)
	}
	if r := nextResult(t, metrics); r != (checkResult{db, 1, true}) {
		t.Errorf("metrics got %+v", r)
	}
	if n := logs.FilterMessage("database check: problem").FilterField(zap.String("table", "public.config")).Len(); n != 1 {
		t.Errorf("problem logged %d times, want once:\n%v", n, logs.All())
	}
	for _, e := range logs.FilterMessage("database check: problem").All() {
		if e.Level != zapcore.WarnLevel {
			t.Errorf("problem logged at %v, want warn", e.Level)
		}
	}

	// Fixed and reloaded: checked again, clean.
	if _, err := dbsetup.Setup(t.Context(), conn, sp, dbsetup.SetupOptions{AddColumns: true}); err != nil {
		t.Fatal(err)
	}
	c.Reload(sp)
	if r := nextResult(t, metrics); r != (checkResult{db, 0, true}) {
		t.Errorf("metrics after the fix got %+v", r)
	}
	if res, known := c.Result(db); !known || len(res.Problems) != 0 {
		t.Errorf("after the fix: problems %+v, known %v", res.Problems, known)
	}

	// A database that does not exist: the check cannot connect.
	c.Ensure("no_such_database")
	if err := c.Wait(ctx, "no_such_database"); err != nil {
		t.Fatal(err)
	}
	if _, known := c.Result("no_such_database"); known {
		t.Error("problems known for a database the check could not connect to")
	}
	if r := nextResult(t, metrics); r != (checkResult{"no_such_database", 0, false}) {
		t.Errorf("metrics for the failed check got %+v", r)
	}
	if logs.FilterMessageSnippet("could not run").FilterField(zap.String("database", "no_such_database")).Len() != 1 {
		t.Errorf("failed check not logged once:\n%v", logs.All())
	}
	if err := c.Wait(ctx, "never_ensured"); err != dbsetup.ErrNotChecked {
		t.Errorf("Wait for a database never ensured: %v", err)
	}
}

// TestCheckerRecheck: Raisers follows the database; Recheck checks again
// at once after a quiet while, and a burst of Rechecks (statements that
// keep failing) runs at most one check per interval.
func TestCheckerRecheck(t *testing.T) {
	db := newDatabase(t)
	conn := connect(t, db)
	execSQL(t, conn, "CREATE TABLE config (id int PRIMARY KEY, last_fence bigint NOT NULL DEFAULT 0)")
	sp := specs(t, rules.Table{Table: "public.config"})
	if _, err := dbsetup.Setup(t.Context(), conn, sp, dbsetup.SetupOptions{}); err != nil {
		t.Fatal(err)
	}
	metrics := make(resultMetrics, 100)
	c := dbsetup.NewChecker(func(ctx context.Context, database string) (*pgx.Conn, error) {
		return pgx.Connect(ctx, shared.Cluster.SuperuserDSN(database))
	}, nil, metrics)
	defer c.Close()
	c.Reload(sp)
	c.Ensure(db)
	if err := c.Wait(t.Context(), db); err != nil {
		t.Fatal(err)
	}
	nextResult(t, metrics)
	if !raisers(c, db) {
		t.Fatal("Raisers false after setup")
	}

	execSQL(t, conn, "DROP FUNCTION fenceproxy.stale(text, bigint, text)")
	time.Sleep(1100 * time.Millisecond) // past the interval: the first Recheck runs at once
	start := time.Now()
	for range 200 {
		c.Recheck(db)
	}
	nextResult(t, metrics)
	if raisers(c, db) {
		t.Error("Raisers still true after the recheck")
	}
	// The burst asked for more; at most one more run follows.
	deadline := time.After(2500 * time.Millisecond)
	runs := 1
	for wait := true; wait; {
		select {
		case <-metrics:
			runs++
		case <-deadline:
			wait = false
		}
	}
	if runs > 2 {
		t.Errorf("%d checks for a burst of 200 Rechecks in %v, want at most 2", runs, time.Since(start).Round(time.Millisecond))
	}
	if _, err := dbsetup.Setup(t.Context(), conn, sp, dbsetup.SetupOptions{}); err != nil {
		t.Fatal(err)
	}
	c.Recheck(db)
	nextResult(t, metrics)
	if !raisers(c, db) {
		t.Error("Raisers false after setup restored them and a recheck")
	}
}

// raisers is the Raisers of c's last result for db.
func raisers(c *dbsetup.Checker, db string) bool {
	r, _ := c.Result(db)
	return r.Raisers
}

// TestCheckerUnwatchedRecheck: a database without the catalog watch is
// checked again every UnwatchedRecheck, so a view created there on
// another connection shows in the paths and the readers; a run that
// finds nothing new logs nothing. (Not parallel: it shortens the
// interval for every checker.)
func TestCheckerUnwatchedRecheck(t *testing.T) {
	old := dbsetup.UnwatchedRecheck
	dbsetup.UnwatchedRecheck = 100 * time.Millisecond
	defer func() { dbsetup.UnwatchedRecheck = old }()
	db := newDatabase(t)
	conn := connect(t, db)
	execSQL(t, conn, "CREATE TABLE acct (id int PRIMARY KEY, last_fence bigint NOT NULL DEFAULT 0)")
	sp := specs(t, rules.Table{Table: "public.acct"})
	core, logs := observer.New(zapcore.InfoLevel)
	c := dbsetup.NewChecker(func(ctx context.Context, database string) (*pgx.Conn, error) {
		return pgx.Connect(ctx, shared.Cluster.SuperuserDSN(database))
	}, zap.New(core), nil)
	defer c.Close()
	c.Reload(sp)
	c.Ensure(db)
	if err := c.Wait(t.Context(), db); err != nil {
		t.Fatal(err)
	}
	if res, known := c.Result(db); !known || res.Watched || len(res.Indirect) != 0 || len(res.Readers) != 0 {
		t.Fatalf("first check: known %v, %+v", known, res)
	}
	n := logs.Len()
	time.Sleep(500 * time.Millisecond) // several quiet runs
	if m := logs.Len(); m != n {
		t.Errorf("quiet runs logged %d lines: %v", m-n, logs.All()[n:])
	}
	execSQL(t, conn, "CREATE VIEW acct_v AS SELECT * FROM acct")
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		res, _ := c.Result(db)
		if len(res.Indirect) > 0 && len(res.Readers) > 0 {
			if res.Indirect[0].Name != "acct_v" || res.Readers[0].Name != "acct_v" {
				t.Errorf("paths %+v, readers %+v", res.Indirect, res.Readers)
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("acct_v not found by a periodic check: %+v", res)
		}
	}
}

// TestCheckerWaitEndsOnClose: a wait for a run asked while another ran
// ends when the checker closes (no run will end it then), not at its own
// deadline.
func TestCheckerWaitEndsOnClose(t *testing.T) {
	connecting := make(chan struct{}, 1)
	c := dbsetup.NewChecker(func(ctx context.Context, database string) (*pgx.Conn, error) {
		connecting <- struct{}{}
		<-ctx.Done() // the first run stays connecting until Close
		return nil, ctx.Err()
	}, nil, nil)
	c.Reload(nil)
	c.Ensure("db")
	<-connecting
	done := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		done <- c.WaitFresh(ctx, "db") // asks for a second run
	}()
	time.Sleep(100 * time.Millisecond)
	c.Close()
	select {
	case err := <-done:
		if err != dbsetup.ErrNotChecked {
			t.Errorf("WaitFresh after Close: %v, want ErrNotChecked", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("WaitFresh still waiting 10s after Close")
	}
}
