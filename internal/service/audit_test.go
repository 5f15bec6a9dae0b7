package service_test

import (
	"context"
	"fmt"
	"path/filepath"
	"testing"

	"github.com/jackc/pgx/v5"
	"go.uber.org/zap/zapcore"

	"github.com/fenceproxy/fenceproxy/internal/rules"
	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// TestAuditThenEnforce: in audit mode a stale write succeeds with its
// normal result, keeps the watermark where it was, and is recorded (log
// line with table and client, metric); after switching the table to
// enforce, the same write is rejected.
func TestAuditThenEnforce(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	createTable(t, "public.audit_a")
	ctx := context.Background()
	path := filepath.Join(t.TempDir(), "fenceproxy.yaml")
	base := fmt.Sprintf("listen: 127.0.0.1:0\nupstream:\n  address: %s\nadmin:\n  listen: 127.0.0.1:0\n", cluster.Addr())
	writeFile(t, path, base+"tables:\n  - table: public.audit_a\n    mode: audit\n")
	in, logs := startInstance(t, path)

	newer := connectApp(t, in.Addr(), "42", "svc-new")
	stale := connectApp(t, in.Addr(), "41", "svc-old")
	if _, err := newer.Exec(ctx, "UPDATE audit_a SET v = 'new' WHERE id = 1"); err != nil {
		t.Fatal(err)
	}
	tag, err := stale.Exec(ctx, "UPDATE audit_a SET v = 'old' WHERE id = 1")
	if err != nil {
		t.Fatalf("audit mode blocked a stale write: %v", err)
	}
	if tag.RowsAffected() != 1 {
		t.Fatalf("stale write in audit mode affected %d rows, want 1 (client-visible result unchanged)", tag.RowsAffected())
	}
	var v string
	var fence int64
	if err := newer.QueryRow(ctx, "SELECT v, last_fence FROM audit_a WHERE id = 1").Scan(&v, &fence); err != nil {
		t.Fatal(err)
	}
	if v != "old" || fence != 42 {
		t.Fatalf("row = (%q, %d), want ('old', 42): audit writes through and never moves the watermark back", v, fence)
	}
	// A write without a token is recorded too.
	noTok := connectApp(t, in.Addr(), "", "svc-untokened")
	if _, err := noTok.Exec(ctx, "UPDATE audit_a SET v = 'untokened' WHERE id = 2"); err != nil {
		t.Fatalf("audit mode blocked an untokened write: %v", err)
	}

	waitFor(t, func() bool {
		return metric(t, in, `fenceproxy_audit_would_reject_total{reason="stale",table="public.audit_a"}`) == 1 &&
			metric(t, in, `fenceproxy_audit_would_reject_total{reason="missing_token",table="public.audit_a"}`) == 1
	})
	entries := logs.FilterMessage("audit: enforce mode would have rejected this write").FilterField(zapcore.Field{Key: "reason", Type: zapcore.StringType, String: "stale"}).All()
	if len(entries) != 1 {
		t.Fatalf("%d stale audit log lines, want 1", len(entries))
	}
	f := entries[0].ContextMap()
	for k, want := range map[string]any{"table": "public.audit_a", "application-name": "svc-old", "user": "postgres", "database": "postgres", "token": "41", "watermark": int64(42)} {
		if f[k] != want {
			t.Errorf("audit log field %s = %v, want %v (all: %v)", k, f[k], want, f)
		}
	}
	// A rolled-back write is not recorded (notifications fire on commit).
	tx, err := stale.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, "UPDATE audit_a SET v = 'old' WHERE id = 1"); err != nil {
		t.Fatal(err)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}

	// Switch to enforce: the same stale write is now rejected.
	writeFile(t, path, base+"tables:\n  - table: public.audit_a\n")
	if err := in.Reload(); err != nil {
		t.Fatal(err)
	}
	_, err = stale.Exec(ctx, "UPDATE audit_a SET v = 'old' WHERE id = 1")
	if sqlstate(err) != rules.CodeStaleToken {
		t.Fatalf("after switching to enforce: %v, want %s", err, rules.CodeStaleToken)
	}
	if got := metric(t, in, `fenceproxy_audit_would_reject_total{reason="stale",table="public.audit_a"}`); got != 1 {
		t.Errorf("audit counter = %v after a rollback and enforce, want 1", got)
	}
}

// TestScopeByApplicationName: one service is switched to enforce while the
// others stay in audit.
func TestScopeByApplicationName(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	createTable(t, "public.scoped_a")
	ctx := context.Background()
	path := filepath.Join(t.TempDir(), "fenceproxy.yaml")
	writeFile(t, path, fmt.Sprintf(`listen: 127.0.0.1:0
upstream:
  address: %s
admin:
  listen: 127.0.0.1:0
tables:
  - table: public.scoped_a
    scope:
      application_names: [billing]
  - table: public.scoped_a
    mode: audit
`, cluster.Addr()))
	in, _ := startInstance(t, path)
	if err := cluster.Exec(ctx, "UPDATE scoped_a SET last_fence = 100"); err != nil {
		t.Fatal(err)
	}
	billing := connectApp(t, in.Addr(), "41", "billing")
	reports := connectApp(t, in.Addr(), "41", "reports")
	_, err := billing.Exec(ctx, "UPDATE scoped_a SET v = 'x' WHERE id = 1")
	if sqlstate(err) != rules.CodeStaleToken {
		t.Fatalf("billing (enforce): %v, want %s", err, rules.CodeStaleToken)
	}
	if _, err := reports.Exec(ctx, "UPDATE scoped_a SET v = 'x' WHERE id = 1"); err != nil {
		t.Fatalf("reports (audit): %v, want success", err)
	}
	waitFor(t, func() bool {
		return metric(t, in, `fenceproxy_audit_would_reject_total{reason="stale",table="public.scoped_a"}`) == 1
	})
}

func connectApp(t *testing.T, addr, token, app string) *pgx.Conn {
	t.Helper()
	dsn := "postgres://postgres@" + addr + "/postgres?sslmode=disable&application_name=" + app
	if token != "" {
		dsn += "&options=-c%20fence.token%3D" + token
	}
	c, err := pgx.Connect(context.Background(), dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close(context.Background()) })
	return c
}

// TestMissingTokenAllowedIsCounted: with missing_token: allow an untokened
// write goes through unfenced and is counted.
func TestMissingTokenAllowedIsCounted(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	createTable(t, "public.allow_a")
	ctx := context.Background()
	path := filepath.Join(t.TempDir(), "fenceproxy.yaml")
	writeFile(t, path, fmt.Sprintf("listen: 127.0.0.1:0\nupstream:\n  address: %s\nadmin:\n  listen: 127.0.0.1:0\ntables:\n  - table: public.allow_a\n    missing_token: allow\n", cluster.Addr()))
	in, _ := startInstance(t, path)
	c := connectApp(t, in.Addr(), "", "legacy")
	tag, err := c.Exec(ctx, "UPDATE allow_a SET v = 'legacy' WHERE id = 3")
	if err != nil || tag.RowsAffected() != 1 {
		t.Fatalf("untokened write with missing_token: allow: %v, %d rows", err, tag.RowsAffected())
	}
	waitFor(t, func() bool {
		return metric(t, in, `fenceproxy_missing_tokens_total{outcome="allowed",table="public.allow_a"}`) == 1
	})
	// A tokened stale write is still fenced.
	if err := cluster.Exec(ctx, "UPDATE allow_a SET last_fence = 100 WHERE id = 3"); err != nil {
		t.Fatal(err)
	}
	tok := connectApp(t, in.Addr(), "5", "legacy")
	if _, err := tok.Exec(ctx, "UPDATE allow_a SET v = 'x' WHERE id = 3"); sqlstate(err) != rules.CodeStaleToken {
		t.Fatalf("stale tokened write: %v, want %s", err, rules.CodeStaleToken)
	}
}

// TestAuditRecordsRefusals: a statement enforce would refuse (TRUNCATE) is
// forwarded in audit mode and recorded.
func TestAuditRecordsRefusals(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	createTable(t, "public.audit_r")
	ctx := context.Background()
	path := filepath.Join(t.TempDir(), "fenceproxy.yaml")
	writeFile(t, path, fmt.Sprintf("listen: 127.0.0.1:0\nupstream:\n  address: %s\nadmin:\n  listen: 127.0.0.1:0\ntables:\n  - table: public.audit_r\n    mode: audit\n", cluster.Addr()))
	in, logs := startInstance(t, path)
	c := connectApp(t, in.Addr(), "42", "maint")
	if _, err := c.Exec(ctx, "TRUNCATE audit_r"); err != nil {
		t.Fatalf("TRUNCATE in audit mode: %v", err)
	}
	if got := metric(t, in, `fenceproxy_audit_would_reject_total{reason="refused",table="public.audit_r"}`); got != 1 {
		t.Errorf("refused counter = %v, want 1", got)
	}
	if n := logs.FilterMessage("audit: enforce mode would have rejected this write").FilterField(zapcore.Field{Key: "reason", Type: zapcore.StringType, String: "refused"}).Len(); n != 1 {
		t.Errorf("%d refusal audit lines, want 1", n)
	}
}
