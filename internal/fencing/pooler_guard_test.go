package fencing_test

import (
	"testing"

	"github.com/jackc/pgx/v5"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"

	"github.com/fenceproxy/fenceproxy/internal/dbsetup"
	"github.com/fenceproxy/fenceproxy/internal/pgbouncer"
	"github.com/fenceproxy/fenceproxy/internal/policy"
	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/proxytest"
	"github.com/fenceproxy/fenceproxy/internal/rules"
	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// TestPoolerGuard: behind a transaction pooler, a write the proxy cannot
// see (a function called in a SELECT) is fenced by the database guard
// with the session's own token, never with the one its server connection
// carries from another client: in a guarded database the proxy applies
// the session's values before every statement that may write.
func TestPoolerGuard(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	checker, specs := startChecker(t, lockRules)
	b := pgbouncer.StartOptions(t, cluster.Addr(), pgbouncer.Options{
		PoolMode: "transaction", PoolSize: poolerPoolSize, IgnoreStartupParameters: poolerIgnored,
	})
	rs, err := rules.Compile(lockRules)
	if err != nil {
		t.Fatal(err)
	}
	p := proxytest.Start(t, b.Addr(), proxy.Options{
		Policy: policy.New(rs, false, policy.Options{Checks: checker}),
		Logger: zaptest.NewLogger(t, zaptest.Level(zap.WarnLevel)).Named("proxy"),
	})
	pe := &poolerEnv{bouncer: b, proxy: p}
	db := newLockDB(t, true)
	d := direct(t, db)
	ctx := ctxT(t)
	if _, err := dbsetup.Setup(ctx, d, specs, dbsetup.SetupOptions{Guard: true, Tables: lockRules.Tables}); err != nil {
		t.Fatal(err)
	}
	if _, err := d.Exec(ctx, `CREATE FUNCTION touch(i bigint) RETURNS int LANGUAGE sql AS $f$ UPDATE acct SET payload = 'via function' WHERE id = i RETURNING 1 $f$`); err != nil {
		t.Fatal(err)
	}
	// The direct connection resets rows behind the guard's back.
	if _, err := d.Exec(ctx, "SET session_replication_role = replica"); err != nil {
		t.Fatal(err)
	}
	for _, mode := range poolerModes {
		poolerReset(t, d)
		if _, err := d.Exec(ctx, "UPDATE acct SET last_fence = 42 WHERE id = 2"); err != nil {
			t.Fatal(err)
		}
		// Both server connections carry token 43 from other clients.
		pe.pollute(t, db, "43", "")
		before := snapshot(t, d, "acct")
		stale := pe.session(t, db, mode)
		mustSend(t, stale, "SET fence.token = '41'")
		if err := send(t, stale, "SELECT touch(2)"); err == nil {
			t.Errorf("%v: a stale write through a function landed", mode)
		}
		wantUnchanged(t, d, "acct", before)
		// A fresh holder's write through the function is stamped with its
		// own token.
		fresh := pe.session(t, db, mode)
		mustSend(t, fresh, "SET fence.token = '44'")
		mustSend(t, fresh, "SELECT touch(3)")
		var payload string
		var fence int64
		if err := d.QueryRow(ctx, "SELECT payload, last_fence FROM acct WHERE id = 3").Scan(&payload, &fence); err != nil {
			t.Fatal(err)
		}
		if payload != "via function" || fence != 44 {
			t.Errorf("%v: row 3 is %q at fence %d, want the fresh holder's write at 44", mode, payload, fence)
		}
		stale.Close(ctx)
		fresh.Close(ctx)
	}
	_ = pgx.QueryExecModeExec
}
