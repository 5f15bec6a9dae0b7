package pgbouncer_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/fenceproxy/fenceproxy/internal/pgbouncer"
	"github.com/fenceproxy/fenceproxy/internal/pgcluster"
	"github.com/fenceproxy/fenceproxy/internal/pgcluster/pgtest"
	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

func connect(t *testing.T, ctx context.Context, dsn string) *pgx.Conn {
	t.Helper()
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		t.Fatalf("connect: %v", err)
	}
	t.Cleanup(func() { conn.Close(context.Background()) })
	return conn
}

func backendPID(t *testing.T, ctx context.Context, conn *pgx.Conn) int {
	t.Helper()
	var pid int
	if err := conn.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&pid); err != nil {
		t.Fatal(err)
	}
	return pid
}

// TestTransactionPooling shows what the harness is for: with one server
// connection in transaction mode, two clients share a backend, and a
// session setting one client makes is seen by the other.
func TestTransactionPooling(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), 60*time.Second)
	defer cancel()
	pg := pgtest.Start(t, pgcluster.Options{})
	b := pgbouncer.Start(t, pg.Addr(), "transaction", 1)
	if b.PoolMode() != "transaction" || b.Port() == 0 || b.Host() != "127.0.0.1" {
		t.Fatalf("PoolMode %q Host %q Port %d", b.PoolMode(), b.Host(), b.Port())
	}

	// pgx sends extra_float_digits, ignored by default; the simple
	// protocol because PgBouncer 1.18 does not carry prepared statements.
	cfg := func() string { return b.DSN("postgres", "postgres") + "&default_query_exec_mode=simple_protocol" }
	a := connect(t, ctx, cfg())
	c := connect(t, ctx, cfg())
	if pa, pc := backendPID(t, ctx, a), backendPID(t, ctx, c); pa != pc {
		t.Errorf("backends %d and %d behind a pool of one", pa, pc)
	}
	if _, err := a.Exec(ctx, "SET application_name = 'leaked'"); err != nil {
		t.Fatal(err)
	}
	var name string
	if err := c.QueryRow(ctx, "SELECT current_setting('application_name')").Scan(&name); err != nil {
		t.Fatal(err)
	}
	if name != "leaked" {
		t.Errorf("other client sees application_name %q, want the leaked session setting", name)
	}

	admin := connect(t, ctx, b.AdminDSN()+"&default_query_exec_mode=simple_protocol")
	rows, err := admin.Query(ctx, "SHOW CONFIG")
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]string{}
	for rows.Next() {
		vals, err := rows.Values()
		if err != nil {
			t.Fatal(err)
		}
		k, _ := vals[0].(string)
		v, _ := vals[1].(string)
		got[k] = v
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	for k, want := range map[string]string{"pool_mode": "transaction", "default_pool_size": "1", "ignore_startup_parameters": "options,extra_float_digits"} {
		if got[k] != want {
			t.Errorf("SHOW CONFIG %s = %q, want %q", k, got[k], want)
		}
	}
}

// TestSessionModeAndSettings starts session pooling with extra settings
// and auth_type any, and checks a user not in the auth file gets in.
func TestSessionModeAndSettings(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), 60*time.Second)
	defer cancel()
	pg := pgtest.Start(t, pgcluster.Options{})
	b := pgbouncer.StartOptions(t, pg.Addr(), pgbouncer.Options{
		PoolMode:                "session",
		PoolSize:                3,
		AuthType:                "any",
		IgnoreStartupParameters: []string{"extra_float_digits"},
		Settings:                map[string]string{"server_lifetime": "60"},
	})
	conn := connect(t, ctx, b.DSN("someone", "postgres")+"&default_query_exec_mode=simple_protocol")
	var user string
	if err := conn.QueryRow(ctx, "SELECT current_user").Scan(&user); err != nil {
		t.Fatal(err)
	}
	if user != "postgres" {
		t.Errorf("auth_type any: current_user %q, want the server user postgres", user)
	}
	// options is not ignored now, so PgBouncer refuses it.
	_, err := pgx.Connect(ctx, b.DSN("postgres", "postgres")+"&options=-c%20fence.token%3D1")
	if err == nil || !strings.Contains(err.Error(), "unsupported startup parameter") {
		t.Errorf("options not ignored: connect error %v, want unsupported startup parameter", err)
	}
}

func TestBadOptions(t *testing.T) {
	for _, o := range []pgbouncer.Options{
		{PoolMode: "sessions"},
		{AuthType: "md5"},
		{Settings: map[string]string{"listen_port": "1"}},
	} {
		if s, err := pgbouncer.Run(t.Context(), "127.0.0.1:1", o); err == nil {
			s.Stop()
			t.Errorf("Run(%+v) succeeded", o)
		}
	}
}

func TestVersion(t *testing.T) {
	testutil.SkipSystem(t, "PgBouncer")
	v, err := pgbouncer.Version(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(v, "1.") {
		t.Errorf("Version() = %q", v)
	}
}
