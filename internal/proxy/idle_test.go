package proxy_test

import (
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/fenceproxy/fenceproxy/internal/proxy"
)

// idlePolicy counts the relay's Idle calls.
type idlePolicy struct {
	proxy.BasePolicy
	idle atomic.Int64
}

func (p *idlePolicy) Idle(*proxy.SessionInfo) { p.idle.Add(1) }

// TestIdleHook: the policy hears of a session with no transaction open —
// after each statement outside a transaction and at COMMIT, not inside a
// transaction — and once more when the session ends.
func TestIdleHook(t *testing.T) {
	pol := &idlePolicy{}
	p := startProxy(t, proxy.Options{Policy: pol})
	for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeSimpleProtocol, pgx.QueryExecModeExec} {
		t.Run(mode.String(), func(t *testing.T) {
			cfg, err := pgx.ParseConfig(superDSN(p))
			if err != nil {
				t.Fatal(err)
			}
			cfg.DefaultQueryExecMode = mode
			conn := connectConfig(t, cfg)
			ctx := ctxT(t)
			selectOne(t, conn)
			before := pol.idle.Load()
			selectOne(t, conn)
			if got := pol.idle.Load() - before; got != 1 {
				t.Errorf("a statement outside a transaction: %d Idle calls, want 1", got)
			}
			tx, err := conn.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			in := pol.idle.Load()
			for range 3 {
				if _, err := tx.Exec(ctx, "SELECT 1"); err != nil {
					t.Fatal(err)
				}
			}
			if got := pol.idle.Load() - in; got != 0 {
				t.Errorf("inside a transaction: %d Idle calls, want 0", got)
			}
			if err := tx.Commit(ctx); err != nil {
				t.Fatal(err)
			}
			if got := pol.idle.Load() - in; got != 1 {
				t.Errorf("at COMMIT: %d Idle calls, want 1", got)
			}
			open := pol.idle.Load()
			if err := conn.Close(ctx); err != nil {
				t.Fatal(err)
			}
			waitFor(t, "an Idle call when the session ends", func() bool { return pol.idle.Load() == open+1 })
		})
	}
}
