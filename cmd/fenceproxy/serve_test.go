package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/fenceproxy/fenceproxy/internal/pgcluster"
	"github.com/fenceproxy/fenceproxy/internal/pgcluster/pgtest"
	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// TestMain lets the test binary act as the fenceproxy command, so tests can
// run `fenceproxy serve` as a real process and signal it.
func TestMain(m *testing.M) {
	if os.Getenv("FENCEPROXY_TEST_AS_MAIN") == "1" {
		os.Exit(runMain(os.Args[1:], os.Stdin, os.Stdout, os.Stderr))
	}
	os.Exit(testutil.Run(m))
}

// startServe runs `fenceproxy serve -c cfg` as a child process, killed
// when the test ends, and returns its standard error (its log).
func startServe(t *testing.T, cfg string) (*exec.Cmd, io.Reader) {
	t.Helper()
	cmd := exec.Command(os.Args[0], "serve", "-c", cfg)
	cmd.Env = append(os.Environ(), "FENCEPROXY_TEST_AS_MAIN=1")
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	})
	return cmd, stderr
}

// startServeProcess runs `fenceproxy serve -c cfg` (startServe) and
// returns its listen address, read from its log.
func startServeProcess(t *testing.T, cfg string) (*exec.Cmd, string, *strings.Builder) {
	t.Helper()
	cmd, stderr := startServe(t, cfg)
	logs := &strings.Builder{}
	addrc := make(chan string, 1)
	go func() {
		re := regexp.MustCompile(`"listen": ?"([0-9.:]+)"`)
		sc := bufio.NewScanner(stderr)
		for sc.Scan() {
			line := sc.Text()
			logs.WriteString(line + "\n")
			if m := re.FindStringSubmatch(line); m != nil && strings.Contains(line, "fenceproxy listening") {
				select {
				case addrc <- m[1]:
				default:
				}
			}
		}
		close(addrc)
	}()
	select {
	case addr, ok := <-addrc:
		if !ok {
			t.Fatalf("fenceproxy exited before listening:\n%s", logs)
		}
		return cmd, addr, logs
	case <-time.After(30 * time.Second):
		t.Fatalf("fenceproxy did not start:\n%s", logs)
	}
	return nil, "", nil
}

// TestServeDrainsOnSIGTERM: a transaction in flight when the process gets
// SIGTERM commits; a new connection is refused; the process exits 0 once
// the session ends.
func TestServeDrainsOnSIGTERM(t *testing.T) {
	pg := pgtest.Start(t, pgcluster.Options{})
	ctx := context.Background()
	if err := pg.Exec(ctx, "CREATE TABLE drained (id int)"); err != nil {
		t.Fatal(err)
	}
	cfg := filepath.Join(t.TempDir(), "fenceproxy.yaml")
	text := fmt.Sprintf("listen: 127.0.0.1:0\nupstream:\n  address: %s\nadmin:\n  listen: \"off\"\nshutdown:\n  drain_timeout: 30s\n", pg.Addr())
	if err := os.WriteFile(cfg, []byte(text), 0o644); err != nil {
		t.Fatal(err)
	}
	cmd, addr, logs := startServeProcess(t, cfg)
	dsn := "postgres://postgres@" + addr + "/postgres?sslmode=disable"

	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	tx, err := conn.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, "INSERT INTO drained VALUES (1)"); err != nil {
		t.Fatal(err)
	}
	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	// New connections are refused while the transaction drains.
	deadline := time.Now().Add(10 * time.Second)
	for {
		c, err := pgx.Connect(ctx, dsn)
		if err != nil {
			var pe *pgconn.PgError
			if errors.As(err, &pe) && pe.Code != "57P01" {
				t.Fatalf("new connection during drain: %v, want 57P01 or a refused connection", err)
			}
			break
		}
		c.Close(ctx)
		if time.Now().After(deadline) {
			t.Fatal("new connections still accepted 10s after SIGTERM")
		}
		time.Sleep(20 * time.Millisecond)
	}
	if _, err := tx.Exec(ctx, "INSERT INTO drained VALUES (2)"); err != nil {
		t.Fatalf("statement in the draining transaction: %v", err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatalf("commit during drain: %v", err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("fenceproxy exit: %v\n%s", err, logs)
		}
	case <-time.After(20 * time.Second):
		t.Fatalf("fenceproxy did not exit after the session became idle:\n%s", logs)
	}
	// The session was closed after its commit.
	if _, err := conn.Exec(ctx, "SELECT 1"); err == nil {
		t.Error("session still usable after the proxy exited")
	}
	var n int
	direct, err := pgx.Connect(ctx, pg.SuperuserDSN("postgres"))
	if err != nil {
		t.Fatal(err)
	}
	defer direct.Close(ctx)
	if err := direct.QueryRow(ctx, "SELECT count(*) FROM drained").Scan(&n); err != nil {
		t.Fatal(err)
	}
	if n != 2 {
		t.Fatalf("rows committed = %d, want 2", n)
	}
	if !strings.Contains(logs.String(), "shutting down") {
		t.Errorf("no shutdown log line:\n%s", logs)
	}
}

// TestServeRejectsBadConfig: an invalid file stops startup with a message
// naming the key.
func TestServeRejectsBadConfig(t *testing.T) {
	cfg := filepath.Join(t.TempDir(), "bad.yaml")
	if err := os.WriteFile(cfg, []byte("upstream:\n  address: 127.0.0.1:5432\nlimits:\n  max_connections: -1\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	var stderr strings.Builder
	code := runMain([]string{"serve", "-c", cfg}, strings.NewReader(""), io.Discard, &stderr)
	if code != 1 || !strings.Contains(stderr.String(), "limits.max_connections") {
		t.Fatalf("exit %d, stderr %q; want 1 and a message naming limits.max_connections", code, stderr.String())
	}
}

// TestRewriteCommand runs `fenceproxy rewrite` on the examples of
// docs/protecting-tables.md, "Rewrite forms".
func TestRewriteCommand(t *testing.T) {
	cfg := "../../config.example.yaml"
	cases := []struct {
		sql      string
		code     int
		contains []string
	}{
		{"UPDATE config SET payload = 'x' WHERE id = 1", 0, []string{"-- rewritten", "UPDATE config SET payload = 'x', \"last_fence\" = (CASE WHEN config.last_fence OPERATOR(pg_catalog.<=)", "current_setting('fence.token', true)"}},
		{"DELETE FROM config WHERE id = 1", 0, []string{"-- rewritten", "DELETE FROM config WHERE (id = 1) AND"}},
		{"INSERT INTO config (id, payload) VALUES (2, 'y')", 0, []string{"-- rewritten", "INSERT INTO config (id, payload, \"last_fence\") VALUES (2, 'y', (CASE"}},
		{"SELECT * FROM config", 0, []string{"-- forwarded unchanged"}},
		{"TRUNCATE config", 3, []string{"-- refused: ERROR FP003"}},
		{"COPY config FROM STDIN", 3, []string{"-- refused: ERROR FP003"}},
	}
	for _, c := range cases {
		var out, errb strings.Builder
		code := runMain([]string{"rewrite", "-c", cfg, c.sql}, strings.NewReader(""), &out, &errb)
		if code != c.code {
			t.Errorf("%s: exit %d, want %d (stderr %q)", c.sql, code, c.code, errb.String())
		}
		for _, want := range c.contains {
			if !strings.Contains(out.String(), want) {
				t.Errorf("%s: output lacks %q:\n%s", c.sql, want, out.String())
			}
		}
	}
	// The other forms: the raisers' calls; for a prepared statement the
	// token as its last parameter, and where the statement has no token
	// form (here: its text holds the placeholder's name) the token checks
	// behind the short pattern (with the raisers, the checks as
	// expressions and the calls behind it).
	const upd, noTok = "UPDATE config SET payload = $1 WHERE id = 1", "UPDATE config SET payload = 'fenceproxy_token_hole' WHERE id = 1"
	for _, f := range []struct {
		flags         []string
		sql           string
		want, without string
	}{
		{[]string{"--server-functions"}, upd, "fenceproxy.advance('fence.token', config.last_fence", "CASE"},
		{[]string{"--server-functions", "--prepared"}, upd, "config.last_fence OPERATOR(pg_catalog.<=) $2::bigint THEN $2::bigint ELSE fenceproxy.stale(", "current_setting"},
		{[]string{"--server-functions", "--prepared"}, upd, "-- $2: the session's token, bound by the proxy at each Bind", "fenceproxy.advance"},
		{[]string{"--prepared"}, upd, "THEN $2::bigint ELSE", "fenceproxy.stale"},
		{[]string{"--server-functions", "--prepared"}, noTok, "OPERATOR(pg_catalog.~) '^0*[1-9][0-9]{0,17}$' OR fenceproxy.tok_b(", "::bigint THEN $"},
		{[]string{"--prepared"}, noTok, "(pg_catalog.current_setting('fence.token', true) OPERATOR(pg_catalog.~) '^0*[1-9][0-9]{0,17}$' OR pg_catalog.current_setting(", "fenceproxy.tok_b"},
	} {
		var out, errb strings.Builder
		code := runMain(append(append([]string{"rewrite", "-c", cfg}, f.flags...), f.sql), strings.NewReader(""), &out, &errb)
		if code != 0 || !strings.Contains(out.String(), f.want) || strings.Contains(out.String(), f.without) {
			t.Errorf("%v %s: exit %d, output:\n%s\nstderr %q", f.flags, f.sql, code, out.String(), errb.String())
		}
	}
	// SQL from standard input.
	var out strings.Builder
	if code := runMain([]string{"rewrite", "-c", cfg, "-"}, strings.NewReader("UPDATE public.config SET payload = 'z'"), &out, io.Discard); code != 0 || !strings.Contains(out.String(), "-- rewritten") {
		t.Errorf("stdin: exit %d, output %q", code, out.String())
	}
}

// TestServeWithStalledLogOutput: when nothing reads the proxy's standard
// error, the proxy keeps serving (it would stop once the pipe is full if
// the threads that relay sessions wrote their log lines themselves); the
// lines it cannot queue are dropped and counted in the metric, and once
// the output is read again a notice says how many were lost.
func TestServeWithStalledLogOutput(t *testing.T) {
	pg := pgtest.Start(t, pgcluster.Options{})
	ctx := context.Background()
	cfg := filepath.Join(t.TempDir(), "fenceproxy.yaml")
	text := fmt.Sprintf("listen: 127.0.0.1:0\nupstream:\n  address: %s\nadmin:\n  listen: 127.0.0.1:0\nlimits:\n  relay_loops: 1\ntables:\n  - table: public.config\n", pg.Addr())
	if err := os.WriteFile(cfg, []byte(text), 0o644); err != nil {
		t.Fatal(err)
	}
	_, stderr := startServe(t, cfg)
	// Read up to the listening line, then stop reading.
	out := bufio.NewReader(stderr)
	re := regexp.MustCompile(`"listen": ?"([0-9.:]+)".*"admin": ?"([0-9.:]+)"`)
	var addr, admin string
	for addr == "" {
		line, err := out.ReadString('\n')
		if err != nil {
			t.Fatalf("fenceproxy exited before listening: %v", err)
		}
		if m := re.FindStringSubmatch(line); m != nil && strings.Contains(line, "fenceproxy listening") {
			addr, admin = m[1], m[2]
		}
	}

	cc, err := pgx.ParseConfig("postgres://postgres@" + addr + "/postgres?sslmode=disable")
	if err != nil {
		t.Fatal(err)
	}
	cc.DefaultQueryExecMode = pgx.QueryExecModeSimpleProtocol
	conn, err := pgx.ConnectConfig(ctx, cc)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	// Each refusal logs a line of about 300 bytes: 8,000 are more than the
	// pipe (64 KiB) and the proxy's queue (1 MiB) hold.
	const refused = "UPDATE config SET payload = 'x' WHERE pg_catalog.set_config('a.b', '1', false) = '1'"
	for i := range 8000 {
		sctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		_, err := conn.Exec(sctx, refused)
		cancel()
		var pe *pgconn.PgError
		if !errors.As(err, &pe) || pe.Code != "FP003" {
			t.Fatalf("statement %d: %v, want the proxy's FP003 refusal (a timeout means the relay waited for the log output)", i, err)
		}
	}
	var one int
	sctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := conn.QueryRow(sctx, "SELECT 1").Scan(&one); err != nil || one != 1 {
		t.Fatalf("SELECT 1 with the log output stalled: %d, %v", one, err)
	}
	dropped := func() float64 {
		resp, err := http.Get("http://" + admin + "/metrics")
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		m := regexp.MustCompile(`(?m)^fenceproxy_log_lines_dropped_total ([0-9.e+]+)$`).FindSubmatch(body)
		if m == nil {
			t.Fatalf("no fenceproxy_log_lines_dropped_total in /metrics:\n%s", body)
		}
		v, _ := strconv.ParseFloat(string(m[1]), 64)
		return v
	}
	n := dropped()
	if n < 1000 {
		t.Fatalf("fenceproxy_log_lines_dropped_total = %v after 8,000 refusals with the output stalled; want most of them", n)
	}

	// Read again: the queued lines come out, then the notice.
	found := make(chan string, 1)
	go func() {
		for {
			line, err := out.ReadString('\n')
			if err != nil {
				close(found)
				return
			}
			if strings.Contains(line, "log lines dropped") {
				found <- line
				_, _ = io.Copy(io.Discard, out)
				return
			}
		}
	}()
	select {
	case line, ok := <-found:
		if !ok {
			t.Fatal("the log ended without a notice of the dropped lines")
		}
		if !regexp.MustCompile(`"lines": ?[1-9][0-9]*`).MatchString(line) {
			t.Errorf("notice without the count: %s", line)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("no notice of the dropped lines once the output was read again")
	}
}
