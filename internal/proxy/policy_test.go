package proxy_test

import (
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"

	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/rules"
	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// stubPolicy exercises the relay's policy hooks without the rules package:
// it refuses any SQL mentioning "forbidden_table", rewrites the literal
// 'rewrite-me' to 'rewritten', rewrites "SELECT stale()" into a statement
// that raises a fenceproxy error, and translates that error.
type stubPolicy struct{ proxy.BasePolicy }

const staleSQL = `DO $$ BEGIN RAISE EXCEPTION 'fenceproxy-stale: token 7 is stale' USING ERRCODE = 'P0001'; END $$`

func (stubPolicy) Decide(_ *proxy.SessionInfo, _ proxy.Lexing, sql string) rules.Decision {
	switch {
	case strings.Contains(sql, "forbidden_table"):
		return rules.Decision{Action: proxy.Refuse, Tables: []string{"forbidden_table"}, Err: &rules.Error{
			Code:    "42501",
			Message: "fenceproxy: forbidden_table is protected", Hint: "ask nicely",
		}}
	case strings.Contains(sql, "'rewrite-me'"):
		return rules.Decision{Action: proxy.Rewrite, SQL: strings.ReplaceAll(sql, "'rewrite-me'", "'rewritten'")}
	case strings.TrimSpace(sql) == "SELECT stale()":
		return rules.Decision{Action: proxy.Rewrite, SQL: staleSQL}
	}
	return rules.Decision{}
}

func (stubPolicy) TranslateError(_ *proxy.SessionInfo, e *pgproto3.ErrorResponse) bool {
	if !strings.HasPrefix(e.Message, "fenceproxy-stale:") {
		return false
	}
	e.Code = "40001"
	e.Message = "fenceproxy: write fenced: " + strings.TrimPrefix(e.Message, "fenceproxy-stale: ")
	return true
}

// countingHooks counts what the relay reports.
type countingHooks struct {
	proxy.NopHooks
	opened, closed, failed atomic.Int64
	mu                     sync.Mutex
	actions                map[proxy.Action]int
}

func (h *countingHooks) SessionOpened()         { h.opened.Add(1) }
func (h *countingHooks) SessionClosed()         { h.closed.Add(1) }
func (h *countingHooks) UpstreamConnectFailed() { h.failed.Add(1) }
func (h *countingHooks) Statement(info *proxy.SessionInfo, d rules.Decision, _ time.Duration) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.actions == nil {
		h.actions = make(map[proxy.Action]int)
	}
	h.actions[d.Action]++
}

// TestPolicyHooks checks how the relay carries out a Policy's decisions:
// a refusal arrives as the policy's error in the statement's place (then
// ReadyForQuery in the simple protocol, skip-until-Sync in the extended
// one) and the session goes on; a rewrite runs the new SQL; an upstream
// error the policy recognises is translated.
func TestPolicyHooks(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	hooks := &countingHooks{}
	t.Cleanup(func() {
		// Registered before the proxy, so it runs after the proxy shut down.
		if o, c := hooks.opened.Load(), hooks.closed.Load(); o == 0 || o != c {
			t.Errorf("hooks saw %d sessions opened and %d closed", o, c)
		}
		hooks.mu.Lock()
		defer hooks.mu.Unlock()
		if hooks.actions[proxy.Refuse] == 0 || hooks.actions[proxy.Rewrite] == 0 || hooks.actions[proxy.Forward] == 0 {
			t.Errorf("hooks saw decisions %v, want each action", hooks.actions)
		}
	})
	p := startProxy(t, proxy.Options{Policy: stubPolicy{}, Hooks: hooks})
	for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeSimpleProtocol, pgx.QueryExecModeCacheStatement, pgx.QueryExecModeExec} {
		t.Run(mode.String(), func(t *testing.T) {
			cfg, err := pgx.ParseConfig(superDSN(p))
			if err != nil {
				t.Fatal(err)
			}
			cfg.DefaultQueryExecMode = mode
			conn := connectConfig(t, cfg)
			ctx := ctxT(t)

			_, err = conn.Exec(ctx, "SELECT * FROM forbidden_table WHERE id = $1", 1)
			wantSQLState(t, err, "42501")
			var pgErr *pgconn.PgError
			if !errors.As(err, &pgErr) || pgErr.Message != "fenceproxy: forbidden_table is protected" || pgErr.Hint != "ask nicely" || pgErr.Severity != "ERROR" {
				t.Errorf("refusal arrived as %+v", pgErr)
			}
			selectOne(t, conn)

			var s string
			if err := conn.QueryRow(ctx, "SELECT 'rewrite-me'::text || $1::text", "!").Scan(&s); err != nil || s != "rewritten!" {
				t.Errorf("rewritten query returned %q, %v", s, err)
			}

			_, err = conn.Exec(ctx, "SELECT stale()")
			wantSQLState(t, err, "40001")
			if !errors.As(err, &pgErr) || pgErr.Message != "fenceproxy: write fenced: token 7 is stale" || pgErr.Where != "" {
				t.Errorf("translated error arrived as %+v", pgErr)
			}

			// A refusal inside a transaction aborts it, like any error.
			tx, err := conn.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			_, err = tx.Exec(ctx, "DELETE FROM forbidden_table")
			wantSQLState(t, err, "42501")
			_, err = tx.Exec(ctx, "SELECT 1")
			wantSQLState(t, err, "25P02")
			if err := tx.Rollback(ctx); err != nil {
				t.Fatal(err)
			}
			selectOne(t, conn)
		})
	}

	t.Run("pipeline", func(t *testing.T) {
		conn := connect(t, superDSN(p))
		pl := conn.PgConn().StartPipeline(ctxT(t))
		pl.SendQueryParams("SELECT 'before'", nil, nil, nil, nil)
		pl.SendQueryParams("SELECT * FROM forbidden_table", nil, nil, nil, nil)
		pl.SendQueryParams("SELECT 'skipped'", nil, nil, nil, nil)
		if err := pl.Sync(); err != nil {
			t.Fatal(err)
		}
		pl.SendQueryParams("SELECT 'rewrite-me'", nil, nil, nil, nil)
		if err := pl.Sync(); err != nil {
			t.Fatal(err)
		}
		values, errs := readPipelineSegment(t, pl)
		if len(values) != 1 || values[0] != "before" || len(errs) != 1 || sqlState(errs[0]) != "42501" {
			t.Fatalf("segment with a refusal returned %q and %v", values, errs)
		}
		values, errs = readPipelineSegment(t, pl)
		if len(values) != 1 || values[0] != "rewritten" || len(errs) != 0 {
			t.Fatalf("segment after the refusal returned %q and %v", values, errs)
		}
		if err := pl.Close(); err != nil {
			t.Fatal(err)
		}
		selectOne(t, conn)
	})

	t.Run("multi-statement", func(t *testing.T) {
		conn := connect(t, superDSN(p))
		_, err := conn.PgConn().Exec(ctxT(t), "SELECT 1; SELECT * FROM forbidden_table; SELECT 3").ReadAll()
		wantSQLState(t, err, "42501")
		selectOne(t, conn)
	})

	// The client cannot forge a refusal marker: a statement that fails
	// the same way but was not refused by the proxy keeps its own error.
	t.Run("forged-marker", func(t *testing.T) {
		conn := connect(t, superDSN(p))
		_, err := conn.Exec(ctxT(t), "SELECT 'fenceproxy-refusal:0000000000000000:1'::pg_catalog.int8", pgx.QueryExecModeSimpleProtocol)
		wantSQLState(t, err, "22P02")
	})

}
