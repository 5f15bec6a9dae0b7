package proxy_test

import (
	"encoding/binary"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"

	"github.com/fenceproxy/fenceproxy/internal/policy"
	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/rules"
	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// startFencedProxy starts a proxy whose policy protects table (and tracks
// prepared statements, so that Binds are read whole) with budget.
func startFencedProxy(t *testing.T, table string, budget *proxy.MessageBudget) string {
	t.Helper()
	rs, err := rules.Compile(rules.Config{Tables: []rules.Table{{Table: "public." + table}}})
	if err != nil {
		t.Fatal(err)
	}
	p := startProxy(t, proxy.Options{Policy: policy.New(rs, false, policy.Options{}), LargeMessages: budget})
	return superDSN(p)
}

// waitBudgetFree waits until b holds nothing: each large message's memory
// is given back once a collection has freed it.
func waitBudgetFree(t *testing.T, b *proxy.MessageBudget) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		held, waiting := b.InUse()
		if held == 0 && waiting == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("budget still holds %d bytes (%d waiting) after the messages", held, waiting)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestLargeMessagesWithBudget sends a large Query, Parse and Bind through
// a proxy whose policy tracks prepared statements (so all three are read
// whole and charged to the budget), and a large Query that writes to a
// protected table, which is refused as too large to check.
func TestLargeMessagesWithBudget(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	table := newTable(t, "v text")
	budget := proxy.NewMessageBudget(64<<20, 10*time.Second)
	conn := connect(t, startFencedProxy(t, table, budget))
	ctx := ctxT(t)

	const size = 8 << 20
	literal := strings.Repeat("q", size)
	var n int
	for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeSimpleProtocol, pgx.QueryExecModeExec} {
		if err := conn.QueryRow(ctx, "SELECT length('"+literal+"')", mode).Scan(&n); err != nil || n != size {
			t.Fatalf("%v: length %d, %v", mode, n, err)
		}
	}
	if err := conn.QueryRow(ctx, "SELECT length($1::text)", literal).Scan(&n); err != nil || n != size {
		t.Fatalf("Bind: length %d, %v", n, err)
	}

	_, err := conn.Exec(ctx, "INSERT INTO "+table+" VALUES ('"+literal+"')", pgx.QueryExecModeSimpleProtocol)
	wantSQLState(t, err, "FP003")
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && !strings.Contains(pgErr.Message, "too large") {
		t.Errorf("refusal says %q, want it to say the statement is too large", pgErr.Message)
	}
	selectOne(t, conn)
	waitBudgetFree(t, budget)
}

// TestLargeMessageBudgetBound holds most of a small budget with a Query
// whose client stalls half-way, and checks that other sessions' large
// Query, Parse and Bind wait and are then refused with 53200, their
// sessions going on; the stalled Query runs once it is complete.
func TestLargeMessageBudgetBound(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	const limit = 4 << 20
	budget := proxy.NewMessageBudget(limit, 300*time.Millisecond)
	dsn := startFencedProxy(t, newTable(t, "v text"), budget)

	// The stalled session: a 3 MiB Query of which 1 MiB has arrived, so
	// that the proxy has sized its buffer for all of it.
	cfg, err := pgconn.ParseConfig(dsn)
	if err != nil {
		t.Fatal(err)
	}
	stalled, err := pgconn.ConnectConfig(ctxT(t), cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer stalled.Close(ctxT(t))
	const big = 3 << 20
	sql := "SELECT length('" + strings.Repeat("s", big-len("SELECT length('')")-1) + "')"
	msg := make([]byte, 5, 5+len(sql)+1)
	msg[0] = 'Q'
	binary.BigEndian.PutUint32(msg[1:], uint32(4+len(sql)+1))
	msg = append(append(msg, sql...), 0)
	hijacked, err := stalled.Hijack()
	if err != nil {
		t.Fatal(err)
	}
	raw := hijacked.Conn
	defer raw.Close()
	if _, err := raw.Write(msg[:1<<20]); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for {
		if held, _ := budget.InUse(); held >= big {
			break
		}
		if time.Now().After(deadline) {
			held, _ := budget.InUse()
			t.Fatalf("the stalled Query holds %d bytes of the budget, want at least %d", held, big)
		}
		time.Sleep(5 * time.Millisecond)
	}

	conn := connect(t, dsn)
	ctx := ctxT(t)
	other := strings.Repeat("o", 2<<20)
	for _, tc := range []struct {
		name     string
		run      func() error
		streamed bool // its bytes are copied through, not held: no budget needed
	}{
		{"query", func() error {
			_, err := conn.Exec(ctx, "SELECT length('"+other+"')", pgx.QueryExecModeSimpleProtocol)
			return err
		}, false},
		{"parse", func() error {
			_, err := conn.Exec(ctx, "SELECT length('"+other+"')", pgx.QueryExecModeExec)
			return err
		}, false},
		{"bind", func() error {
			var n int
			err := conn.QueryRow(ctx, "SELECT length($1::text)", other).Scan(&n)
			if err == nil && n != len(other) {
				return fmt.Errorf("length %d, want %d", n, len(other))
			}
			return err
		}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			start := time.Now()
			err := tc.run()
			if tc.streamed {
				// A large Bind's values are streamed: it runs whatever the
				// budget holds.
				if err != nil {
					t.Fatalf("streamed Bind: %v", err)
				}
				selectOne(t, conn)
				return
			}
			wantSQLState(t, err, "53200")
			if waited := time.Since(start); waited < 250*time.Millisecond {
				t.Errorf("refused after %v, want it to wait for the budget first", waited)
			}
			if held, _ := budget.InUse(); held > limit {
				t.Errorf("budget holds %d bytes, over its limit %d", held, limit)
			}
			selectOne(t, conn)
		})
	}

	// The stalled Query completes and runs.
	if _, err := raw.Write(msg[1<<20:]); err != nil {
		t.Fatal(err)
	}
	fe := newFrontend(raw)
	var got string
	for {
		m, err := fe.Receive()
		if err != nil {
			t.Fatal(err)
		}
		switch m := m.(type) {
		case *pgproto3.DataRow:
			got = string(m.Values[0])
		case *pgproto3.ErrorResponse:
			t.Fatalf("stalled Query failed: %s", m.Message)
		}
		if _, ok := m.(*pgproto3.ReadyForQuery); ok {
			break
		}
	}
	if want := len(sql) - len("SELECT length('')"); got != strconv.Itoa(want) {
		t.Errorf("stalled Query answered %q, want %d", got, want)
	}
	waitBudgetFree(t, budget)
}
