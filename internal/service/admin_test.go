package service_test

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"testing"
	"time"

	"github.com/fenceproxy/fenceproxy/internal/admin"
	"github.com/fenceproxy/fenceproxy/internal/pgcluster"
	"github.com/fenceproxy/fenceproxy/internal/pgcluster/pgtest"
	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/rules"
	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// TestSessionsEndpoint: /sessions lists a session with its startup
// parameters, state and counts of fenced and refused statements.
func TestSessionsEndpoint(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	createTable(t, "public.sessions_a")
	path := filepath.Join(t.TempDir(), "fenceproxy.yaml")
	writeConfig(t, path, cluster.Addr(), "public.sessions_a")
	in, _ := startInstance(t, path)
	ctx := context.Background()
	before := time.Now()
	c := connectApp(t, in.Addr(), "42", "svc-sessions")
	if _, err := c.Exec(ctx, "UPDATE sessions_a SET v = 'x' WHERE id = 1"); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Exec(ctx, "TRUNCATE sessions_a"); sqlstate(err) != rules.CodeRefused {
		t.Fatalf("truncate: %v, want %s", err, rules.CodeRefused)
	}
	local := c.PgConn().Conn().LocalAddr().String()

	find := func() proxy.SessionSnapshot {
		t.Helper()
		var list []proxy.SessionSnapshot
		body := get(t, "http://"+in.AdminAddr()+"/sessions", http.StatusOK)
		if err := json.Unmarshal([]byte(body), &list); err != nil {
			t.Fatalf("/sessions: %v\n%s", err, body)
		}
		for _, s := range list {
			if s.RemoteAddr == local {
				return s
			}
		}
		t.Fatalf("/sessions has no session from %s:\n%s", local, body)
		return proxy.SessionSnapshot{}
	}
	s := find()
	if s.User != "postgres" || s.Database != "postgres" || s.ApplicationName != "svc-sessions" || s.State != "idle" {
		t.Errorf("session = %+v, want user, database postgres, application_name svc-sessions, idle", s)
	}
	if s.StatementsFenced < 1 || s.StatementsRefused != 1 {
		t.Errorf("fenced, refused = %d, %d, want >= 1, 1", s.StatementsFenced, s.StatementsRefused)
	}
	if s.Since.Before(before.Add(-time.Second)) || s.Since.After(time.Now()) {
		t.Errorf("since = %v, want between %v and now", s.Since, before)
	}
	if _, err := c.Exec(ctx, "BEGIN"); err != nil {
		t.Fatal(err)
	}
	if s := find(); s.State != "idle in transaction" {
		t.Errorf("state in a transaction = %q, want idle in transaction", s.State)
	}
}

// TestRulesEndpointAfterReload: /rules shows the rules in force with the
// hash of the file they came from, and follows a reload.
func TestRulesEndpointAfterReload(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	path := filepath.Join(t.TempDir(), "fenceproxy.yaml")
	writeConfig(t, path, cluster.Addr(), "public.rules_a")
	in, _ := startInstance(t, path)

	rulesNow := func() admin.Rules {
		t.Helper()
		var r admin.Rules
		body := get(t, "http://"+in.AdminAddr()+"/rules", http.StatusOK)
		if err := json.Unmarshal([]byte(body), &r); err != nil {
			t.Fatalf("/rules: %v\n%s", err, body)
		}
		return r
	}
	fileHash := func() string {
		data, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		sum := sha256.Sum256(data)
		return hex.EncodeToString(sum[:])
	}
	r := rulesNow()
	want := admin.Table{Table: "public.rules_a", Column: "last_fence", Mode: "enforce", OnStale: "error", MissingToken: "reject"}
	if r.ConfigSHA256 != fileHash() || r.ConfigFile != path || r.TokenSetting != "fence.token" ||
		len(r.Tables) != 1 || fmt.Sprint(r.Tables[0]) != fmt.Sprint(want) {
		t.Fatalf("/rules = %+v, want the file's hash %s and table %+v", r, fileHash(), want)
	}
	first := r

	base := fmt.Sprintf("listen: 127.0.0.1:0\nupstream:\n  address: %s\nadmin:\n  listen: 127.0.0.1:0\n", cluster.Addr())
	writeFile(t, path, base+"tables:\n  - table: public.rules_b\n    mode: audit\n    scope:\n      users: [app]\n")
	if err := in.Reload(); err != nil {
		t.Fatal(err)
	}
	r = rulesNow()
	if r.ConfigSHA256 == first.ConfigSHA256 || r.ConfigSHA256 != fileHash() {
		t.Errorf("hash after reload = %s, want the new file's %s (was %s)", r.ConfigSHA256, fileHash(), first.ConfigSHA256)
	}
	if !r.LoadedAt.After(first.LoadedAt) {
		t.Errorf("loaded_at after reload = %v, not after %v", r.LoadedAt, first.LoadedAt)
	}
	if len(r.Tables) != 1 || r.Tables[0].Table != "public.rules_b" || r.Tables[0].Mode != "audit" ||
		len(r.Tables[0].Scope.Users) != 1 || r.Tables[0].Scope.Users[0] != "app" {
		t.Errorf("tables after reload = %+v", r.Tables)
	}
}

// TestReloadTimestampAndBuildInfo: build_info is 1, and the last reload
// time is set at start, moves with a reload and stays put after a failed
// one.
func TestReloadTimestampAndBuildInfo(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	path := filepath.Join(t.TempDir(), "fenceproxy.yaml")
	writeConfig(t, path, cluster.Addr())
	in, _ := startInstance(t, path)
	body := get(t, "http://"+in.AdminAddr()+"/metrics", http.StatusOK)
	if !regexp.MustCompile(`(?m)^fenceproxy_build_info\{goversion="go[^"]+",revision="[^"]+",version="[^"]+"\} 1$`).MatchString(body) {
		t.Errorf("no fenceproxy_build_info sample of 1 in /metrics")
	}
	// The off-loop gauges read the running server (idle here).
	for _, state := range []string{"running", "waiting"} {
		if !regexp.MustCompile(`(?m)^fenceproxy_off_loop_tasks\{state="` + state + `"\} 0$`).MatchString(body) {
			t.Errorf("no fenceproxy_off_loop_tasks{state=%q} sample of 0 in /metrics", state)
		}
	}
	const name = "fenceproxy_config_last_reload_success_timestamp_seconds"
	start := metric(t, in, name)
	if now := float64(time.Now().Unix()); start < now-60 || start > now+1 {
		t.Fatalf("%s = %v at start, want about %v", name, start, now)
	}
	time.Sleep(20 * time.Millisecond)
	if err := in.Reload(); err != nil {
		t.Fatal(err)
	}
	ok := metric(t, in, name)
	if ok <= start {
		t.Errorf("%s = %v after a reload, want > %v", name, ok, start)
	}
	writeFile(t, path, "tables: [")
	if err := in.Reload(); err == nil {
		t.Fatal("reload of a broken file succeeded")
	}
	if got := metric(t, in, name); got != ok {
		t.Errorf("%s = %v after a failed reload, want %v", name, got, ok)
	}
}

// TestAuditListenerUpMetric: the audit listener's gauge is 1 once it
// listens and 0 when its server goes away.
func TestAuditListenerUpMetric(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	pg := pgtest.Start(t, pgcluster.Options{}) // stopped below
	if err := pg.Exec(context.Background(), `
		CREATE TABLE audit_up (id int PRIMARY KEY, v text NOT NULL DEFAULT '', last_fence bigint NOT NULL DEFAULT 0);
		INSERT INTO audit_up (id) VALUES (1);`); err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), "fenceproxy.yaml")
	base := fmt.Sprintf("listen: 127.0.0.1:0\nupstream:\n  address: %s\nadmin:\n  listen: 127.0.0.1:0\n", pg.Addr())
	writeFile(t, path, base+"tables:\n  - table: public.audit_up\n    mode: audit\n")
	in, _ := startInstance(t, path)
	c := connectApp(t, in.Addr(), "", "svc-audit-up")
	if _, err := c.Exec(context.Background(), "UPDATE audit_up SET v = 'x' WHERE id = 1"); err != nil {
		t.Fatal(err)
	}
	const sample = `fenceproxy_audit_listener_up{database="postgres"}`
	if got := metric(t, in, sample); got != 1 {
		t.Fatalf("%s = %v after an audited write, want 1", sample, got)
	}
	if err := pg.StopServer(); err != nil {
		t.Fatal(err)
	}
	waitFor(t, func() bool { return metric(t, in, sample) == 0 })
}

// TestPprofSwitch: /debug/pprof/ is served only with admin.pprof: true.
func TestPprofSwitch(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	dir := t.TempDir()
	off := filepath.Join(dir, "off.yaml")
	writeConfig(t, off, cluster.Addr())
	in, _ := startInstance(t, off)
	get(t, "http://"+in.AdminAddr()+"/debug/pprof/", http.StatusNotFound)

	on := filepath.Join(dir, "on.yaml")
	writeFile(t, on, fmt.Sprintf("listen: 127.0.0.1:0\nupstream:\n  address: %s\nadmin:\n  listen: 127.0.0.1:0\n  pprof: true\n", cluster.Addr()))
	in, _ = startInstance(t, on)
	get(t, "http://"+in.AdminAddr()+"/debug/pprof/", http.StatusOK)
	get(t, "http://"+in.AdminAddr()+"/debug/pprof/goroutine?debug=1", http.StatusOK)
}
