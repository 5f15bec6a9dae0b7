package proxy_test

import (
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/rules"
)

// costPolicy forwards everything; its DecisionCost is what a text says:
// 6 MiB for one with "costly", 4 MiB for one with "modest". Deciding a
// text with "hold" signals holding and waits until release is closed.
type costPolicy struct {
	proxy.BasePolicy
	holding chan struct{}
	release chan struct{}
}

func (p *costPolicy) DecisionCost(_ *proxy.SessionInfo, sql string) int64 {
	switch {
	case strings.Contains(sql, "costly"):
		return 6 << 20
	case strings.Contains(sql, "modest"):
		return 4 << 20
	}
	return 0
}

func (p *costPolicy) Decide(_ *proxy.SessionInfo, _ proxy.Lexing, sql string) rules.Decision {
	if strings.Contains(sql, "hold") {
		p.holding <- struct{}{}
		<-p.release
	}
	return rules.Decision{}
}

// TestSmallTextChargedForDecision: a text under 64 KiB whose decision may
// hold more than 4 MiB is charged for it to the large-message budget, as
// a Query and as a Parse: while another session's decision holds most of
// an 8 MiB budget, such a text waits and is refused with 53200, and the
// server never runs it. A text whose decision costs at most 4 MiB, and
// one of at most 512 bytes, are not charged: they run at once.
func TestSmallTextChargedForDecision(t *testing.T) {
	table := newTable(t, "v text")
	t.Parallel()
	budget := proxy.NewMessageBudget(8<<20, 300*time.Millisecond)
	pol := &costPolicy{holding: make(chan struct{}), release: make(chan struct{})}
	dsn := superDSN(startProxy(t, proxy.Options{Policy: pol, LargeMessages: budget}))
	ctx := ctxT(t)
	// pad makes a text of about 1 KiB: over the 512 bytes from which the
	// relay asks for a text's cost, far under 64 KiB.
	pad := " -- " + strings.Repeat("p", 1000)
	insert := func(v string) string { return "INSERT INTO " + table + " VALUES ('" + v + "')" }

	// One session's decision holds 6 MiB of the budget.
	holder := connect(t, dsn)
	done := make(chan error, 1)
	go func() {
		_, err := holder.Exec(ctx, insert("costly hold")+pad, pgx.QueryExecModeSimpleProtocol)
		done <- err
	}()
	select {
	case <-pol.holding:
	case err := <-done:
		t.Fatalf("the held statement ended before its decision: %v", err)
	}
	released := false
	defer func() {
		if !released {
			close(pol.release)
			<-done
		}
	}()
	if held, _ := budget.InUse(); held < 6<<20 {
		t.Fatalf("the budget holds %d bytes while a 1 KiB text costing 6 MiB is decided, want at least %d", held, 6<<20)
	}

	conn := connect(t, dsn)
	// A simple Query, then Parse/Bind/Execute (pgx's Exec with no
	// arguments would send a simple Query in either mode).
	for _, extended := range []bool{false, true} {
		var err error
		if extended {
			err = conn.PgConn().ExecParams(ctx, insert("costly")+pad, nil, nil, nil, nil).Read().Err
		} else {
			_, err = conn.Exec(ctx, insert("costly")+pad, pgx.QueryExecModeSimpleProtocol)
		}
		wantSQLState(t, err, "53200")
		selectOne(t, conn)
	}
	for _, sql := range []string{insert("modest") + pad, insert("costly but short")} {
		if _, err := conn.Exec(ctx, sql, pgx.QueryExecModeSimpleProtocol); err != nil {
			t.Fatalf("%.40s… (%d bytes): %v", sql, len(sql), err)
		}
	}

	close(pol.release)
	released = true
	if err := <-done; err != nil {
		t.Fatalf("the held statement: %v", err)
	}
	rows, err := conn.Query(ctx, "SELECT v FROM "+table+" ORDER BY v")
	if err != nil {
		t.Fatal(err)
	}
	got, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	if want := "costly but short,costly hold,modest"; strings.Join(got, ",") != want {
		t.Errorf("rows %q, want %q: a refused statement ran, or an allowed one did not", got, want)
	}
	waitBudgetFree(t, budget)
}
