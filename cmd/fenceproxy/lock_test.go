package main

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/fenceproxy/fenceproxy/internal/dbsetup"
	"github.com/fenceproxy/fenceproxy/internal/etcdcluster/etcdtest"
	"github.com/fenceproxy/fenceproxy/internal/pgcluster"
	"github.com/fenceproxy/fenceproxy/internal/pgcluster/pgtest"
	"github.com/fenceproxy/fenceproxy/internal/rediscluster"
	"github.com/fenceproxy/fenceproxy/internal/rediscluster/redistest"
	"github.com/fenceproxy/fenceproxy/internal/testutil"
	"github.com/fenceproxy/fenceproxy/lock"
	"github.com/fenceproxy/fenceproxy/lock/etcdlock"
)

// waitFor polls until b contains s.
func waitFor(t *testing.T, b *testutil.SyncBuffer, s string, within time.Duration) {
	t.Helper()
	deadline := time.Now().Add(within)
	for !strings.Contains(b.String(), s) {
		if time.Now().After(deadline) {
			t.Fatalf("output %q does not contain %q after %v", b.String(), s, within)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

type lockEnv struct {
	etcd string
	cli  *clientv3.Client
}

func newLockEnv(t *testing.T) lockEnv {
	t.Helper()
	c := etcdtest.Start(t, 1)
	cli, err := c.Client()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cli.Close() })
	return lockEnv{etcd: strings.Join(c.Endpoints(), ","), cli: cli}
}

type lockRun struct {
	code           int
	stdout, stderr *testutil.SyncBuffer
}

// start runs lockMain with --etcd pointing at the test cluster in the
// background; wait returns its result.
func (e lockEnv) start(ctx context.Context, args ...string) (*testutil.SyncBuffer, *testutil.SyncBuffer, <-chan lockRun) {
	stdout, stderr := new(testutil.SyncBuffer), new(testutil.SyncBuffer)
	res := make(chan lockRun, 1)
	go func() {
		code := lockMain(ctx, append([]string{"--etcd", e.etcd}, args...), stdout, stderr)
		res <- lockRun{code, stdout, stderr}
	}()
	return stdout, stderr, res
}

func (e lockEnv) run(t *testing.T, args ...string) lockRun {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	_, _, res := e.start(ctx, args...)
	return wait(t, res, 30*time.Second)
}

func wait(t *testing.T, res <-chan lockRun, within time.Duration) lockRun {
	t.Helper()
	select {
	case r := <-res:
		return r
	case <-time.After(within):
		t.Fatalf("lockMain did not return within %v", within)
		return lockRun{}
	}
}

// assertFree checks that the lock command released key.
func (e lockEnv) assertFree(t *testing.T, key string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	l, err := etcdlock.TryAcquire(ctx, e.cli, key, lock.Options{})
	if err != nil {
		t.Fatalf("lock %q not free after the command: %v", key, err)
	}
	if err := l.Release(ctx); err != nil {
		t.Fatal(err)
	}
}

func TestLockRunsCommandWithToken(t *testing.T) {
	t.Parallel()
	e := newLockEnv(t)
	const key = "/locks/cli/token"

	r := e.run(t, key, "--", "sh", "-c", `echo "$FENCE_TOKEN $FENCE_LOCK_KEY"`)
	if r.code != 0 {
		t.Fatalf("exit %d, stderr %q", r.code, r.stderr)
	}
	fields := strings.Fields(r.stdout.String())
	if len(fields) != 2 {
		t.Fatalf("stdout %q, want token and key", r.stdout)
	}
	token, err := strconv.ParseInt(fields[0], 10, 64)
	if err != nil || token <= 0 {
		t.Fatalf("FENCE_TOKEN = %q, want a positive integer", fields[0])
	}
	if fields[1] != key {
		t.Errorf("FENCE_LOCK_KEY = %q, want %q", fields[1], key)
	}
	e.assertFree(t, key)

	// A second run gets a larger token.
	r = e.run(t, "--ttl", "2s", key, "sh", "-c", `echo "$FENCE_TOKEN"`)
	if r.code != 0 {
		t.Fatalf("second run: exit %d, stderr %q", r.code, r.stderr)
	}
	second, err := strconv.ParseInt(strings.TrimSpace(r.stdout.String()), 10, 64)
	if err != nil || second <= token {
		t.Fatalf("second token %q not above %d", r.stdout, token)
	}
}

func TestLockExitStatus(t *testing.T) {
	t.Parallel()
	e := newLockEnv(t)
	const key = "/locks/cli/status"

	for _, tc := range []struct {
		name string
		cmd  []string
		want int
	}{
		{"success", []string{"true"}, 0},
		{"failure", []string{"sh", "-c", "exit 7"}, 7},
		{"killed", []string{"sh", "-c", "kill -KILL $$"}, 128 + 9},
		{"not found", []string{"/nonexistent/fenceproxy-test-command"}, 127},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := e.run(t, append([]string{key, "--"}, tc.cmd...)...)
			if r.code != tc.want {
				t.Fatalf("exit %d, want %d; stderr %q", r.code, tc.want, r.stderr)
			}
			e.assertFree(t, key)
		})
	}
}

func TestLockHeldElsewhere(t *testing.T) {
	t.Parallel()
	e := newLockEnv(t)
	const key = "/locks/cli/held"
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	holder, err := etcdlock.Acquire(ctx, e.cli, key, lock.Options{KeepAlive: true, Holder: "other-holder"})
	if err != nil {
		t.Fatal(err)
	}

	r := e.run(t, "--wait", "0", key, "--", "sh", "-c", "echo ran")
	if r.code != 1 || r.stdout.String() != "" {
		t.Fatalf("--wait 0: exit %d, stdout %q; want 1 and the command not run", r.code, r.stdout)
	}
	if !strings.Contains(r.stderr.String(), "other-holder") {
		t.Errorf("stderr %q does not name the holder", r.stderr)
	}

	start := time.Now()
	r = e.run(t, "--wait", "300ms", key, "--", "sh", "-c", "echo ran")
	if r.code != 1 || r.stdout.String() != "" {
		t.Fatalf("--wait 300ms: exit %d, stdout %q; want 1 and the command not run", r.code, r.stdout)
	}
	if d := time.Since(start); d < 300*time.Millisecond || d > 5*time.Second {
		t.Errorf("--wait 300ms returned after %v", d)
	}
	t.Logf("stderr: %s", r.stderr)

	// Without --wait the command waits, and runs once the holder lets go.
	stdout, stderr, res := e.start(ctx, key, "--", "sh", "-c", `echo "$FENCE_TOKEN"`)
	time.Sleep(300 * time.Millisecond)
	if stdout.String() != "" {
		t.Fatalf("command ran while the lock was held: %q", stdout)
	}
	if err := holder.Release(ctx); err != nil {
		t.Fatal(err)
	}
	r = wait(t, res, 5*time.Second)
	if r.code != 0 {
		t.Fatalf("exit %d, stderr %q", r.code, stderr)
	}
	if token, _ := strconv.ParseInt(strings.TrimSpace(stdout.String()), 10, 64); token <= holder.Token() {
		t.Errorf("token %q not above the previous holder's %d", stdout, holder.Token())
	}
}

// The child reports SIGTERM and exits 3; with its own process group the
// sleep it runs gets the signal too.
const trapTerm = `trap 'echo got-term; exit 3' TERM; echo ready; while :; do sleep 0.1; done`

func TestLockLeaseLost(t *testing.T) {
	t.Parallel()
	e := newLockEnv(t)

	for _, tc := range []struct {
		name string
		take func(ctx context.Context, kv *clientv3.GetResponse) error
	}{
		{"revoke", func(ctx context.Context, kv *clientv3.GetResponse) error {
			_, err := e.cli.Revoke(ctx, clientv3.LeaseID(kv.Kvs[0].Lease))
			return err
		}},
		{"delete", func(ctx context.Context, kv *clientv3.GetResponse) error {
			_, err := e.cli.Delete(ctx, string(kv.Kvs[0].Key))
			return err
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			key := "/locks/cli/lost/" + tc.name
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			stdout, stderr, res := e.start(ctx, key, "--", "sh", "-c", trapTerm)
			waitFor(t, stdout, "ready", 10*time.Second)

			kv, err := e.cli.Get(ctx, etcdlock.Prefix(key), clientv3.WithPrefix())
			if err != nil || len(kv.Kvs) != 1 {
				t.Fatalf("get %q: %v %v", key, kv, err)
			}
			lostAt := time.Now()
			if err := tc.take(ctx, kv); err != nil {
				t.Fatal(err)
			}
			r := wait(t, res, 10*time.Second)
			if r.code != exitLeaseLost {
				t.Fatalf("exit %d, want %d; stderr %q", r.code, exitLeaseLost, stderr)
			}
			if d := time.Since(lostAt); d > 3*time.Second {
				t.Errorf("took %v to stop after the lease was lost", d)
			}
			if !strings.Contains(stderr.String(), "fenceproxy lock: lease lost") {
				t.Errorf("stderr %q lacks the lease-lost message", stderr)
			}
			if !strings.Contains(stdout.String(), "got-term") {
				t.Errorf("child was not sent SIGTERM; stdout %q", stdout)
			}
			t.Logf("stderr: %s", stderr)
		})
	}
}

func TestLockKillsChildIgnoringTerm(t *testing.T) {
	if testing.Short() {
		t.Skip("waits for the SIGKILL grace period")
	}
	t.Parallel()
	e := newLockEnv(t)
	const key = "/locks/cli/stubborn"
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	stdout, stderr, res := e.start(ctx, key, "--", "sh", "-c", `trap '' TERM; echo ready; while :; do sleep 0.1; done`)
	waitFor(t, stdout, "ready", 10*time.Second)
	if _, err := e.cli.Delete(ctx, etcdlock.Prefix(key), clientv3.WithPrefix()); err != nil {
		t.Fatal(err)
	}
	r := wait(t, res, killGrace+5*time.Second)
	if r.code != exitLeaseLost {
		t.Fatalf("exit %d, want %d; stderr %q", r.code, exitLeaseLost, stderr)
	}
	if !strings.Contains(stderr.String(), "SIGKILL") {
		t.Errorf("stderr %q does not mention SIGKILL", stderr)
	}
}

func TestLockCanceledContextStopsChild(t *testing.T) {
	t.Parallel()
	e := newLockEnv(t)
	const key = "/locks/cli/cancel"
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()

	stdout, stderr, res := e.start(ctx, key, "--", "sh", "-c", trapTerm)
	waitFor(t, stdout, "ready", 10*time.Second)
	cancel()
	r := wait(t, res, 10*time.Second)
	if r.code != 3 || !strings.Contains(stdout.String(), "got-term") {
		t.Fatalf("exit %d, stdout %q, stderr %q; want the child's SIGTERM exit 3", r.code, stdout, stderr)
	}
	e.assertFree(t, key)
}

// TestLockForwardsSignal sends the test process a real SIGTERM. It must not
// run in parallel: every lockMain running at that moment would forward it.
func TestLockForwardsSignal(t *testing.T) {
	e := newLockEnv(t)
	const key = "/locks/cli/signal"
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	// Keep SIGTERM from killing the test binary whatever happens.
	guard := make(chan os.Signal, 1)
	signal.Notify(guard, syscall.SIGTERM)
	defer signal.Stop(guard)

	stdout, stderr, res := e.start(ctx, key, "--", "sh", "-c", trapTerm)
	waitFor(t, stdout, "ready", 10*time.Second)
	if err := syscall.Kill(os.Getpid(), syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	r := wait(t, res, 10*time.Second)
	if r.code != 3 || !strings.Contains(stdout.String(), "got-term") {
		t.Fatalf("exit %d, stdout %q, stderr %q; want the child's SIGTERM exit 3", r.code, stdout, stderr)
	}
	e.assertFree(t, key)
}

func TestLockUsage(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		args []string
		want int
	}{
		{"no args", nil, exitUsage},
		{"no command", []string{"/k"}, exitUsage},
		{"only separator", []string{"/k", "--"}, exitUsage},
		{"short ttl", []string{"--ttl", "500ms", "/k", "--", "true"}, exitUsage},
		{"negative wait", []string{"--wait", "-1s", "/k", "--", "true"}, exitUsage},
		{"unknown flag", []string{"--bogus", "/k", "--", "true"}, exitUsage},
		{"empty etcd", []string{"--etcd", " , ", "/k", "--", "true"}, exitUsage},
		{"help", []string{"-h"}, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var stdout, stderr bytes.Buffer
			code := lockMain(context.Background(), tc.args, &stdout, &stderr)
			if code != tc.want {
				t.Fatalf("exit %d, want %d; stderr %q", code, tc.want, stderr.String())
			}
			if !strings.Contains(stderr.String(), "usage: fenceproxy lock") {
				t.Errorf("stderr %q lacks the usage text", stderr.String())
			}
		})
	}
}

func TestLockFlagsAfterKey(t *testing.T) {
	t.Parallel()
	a, code := parseLockArgs([]string{"--etcd", "a:1, b:2", "/k", "--wait", "0", "--", "cmd", "--wait", "x"}, new(bytes.Buffer), new(bytes.Buffer))
	if a == nil {
		t.Fatalf("parse failed with %d", code)
	}
	if a.key != "/k" || !a.wait.set || a.wait.d != 0 {
		t.Errorf("key %q wait %+v", a.key, a.wait)
	}
	if got := strings.Join(a.endpoints, "|"); got != "a:1|b:2" {
		t.Errorf("endpoints %q", got)
	}
	if got := strings.Join(a.command, " "); got != "cmd --wait x" {
		t.Errorf("command %q", got)
	}
}

func TestLockEtcdUnreachable(t *testing.T) {
	t.Parallel()
	var stdout, stderr bytes.Buffer
	start := time.Now()
	code := lockMain(context.Background(), []string{"--etcd", "127.0.0.1:1", "/k", "--", "sh", "-c", "echo ran"}, &stdout, &stderr)
	if code != exitFailed || stdout.Len() != 0 {
		t.Fatalf("exit %d, stdout %q; want 1 and the command not run", code, stdout.String())
	}
	if d := time.Since(start); d > etcdTimeout+3*time.Second {
		t.Errorf("gave up after %v", d)
	}
	if !strings.Contains(stderr.String(), "etcd") {
		t.Errorf("stderr %q does not mention etcd", stderr.String())
	}
}

// TestLockPGOptionsPsql runs real psql under fenceproxy lock against a
// throwaway PostgreSQL: SHOW reads back the token and the key, for keys
// with spaces and backslashes, with custom setting names, and with a
// PGOPTIONS of the caller's kept. It sets PGOPTIONS for the process, so it
// does not run in parallel.
func TestLockPGOptionsPsql(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL, psql")
	psql, err := exec.LookPath("psql")
	if err != nil {
		t.Fatalf("psql not found: %v", err)
	}
	e := newLockEnv(t)
	pg := pgtest.Start(t, pgcluster.Options{})
	dsn := pg.SuperuserDSN("postgres")
	// A caller's own options, one of them fence.token, which the
	// command's token overrides because later options win.
	t.Setenv("PGOPTIONS", `-c app.job=nightly\ report -c fence.token=1`)

	for _, tc := range []struct {
		name  string
		key   string
		flags []string
		token string
		lock  string
	}{
		{"plain", "locks/report", nil, "fence.token", "fence.lock"},
		{"space", "locks/tenant 7 config", nil, "fence.token", "fence.lock"},
		{"backslash", `locks\a\\b\ c\`, nil, "fence.token", "fence.lock"},
		{"custom settings", "locks/custom",
			[]string{"--token-setting", "app.fence_token", "--lock-setting", "app.fence_lock"},
			"app.fence_token", "app.fence_lock"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			args := append(append([]string{}, tc.flags...), tc.key, "--",
				psql, "-X", "-At", "-v", "ON_ERROR_STOP=1", "-d", dsn,
				"-c", "SHOW "+tc.token, "-c", "SHOW "+tc.lock, "-c", "SHOW app.job")
			r := e.run(t, args...)
			if r.code != 0 {
				t.Fatalf("exit %d, stderr %q", r.code, r.stderr)
			}
			lines := strings.Split(strings.TrimSuffix(r.stdout.String(), "\n"), "\n")
			if len(lines) != 3 {
				t.Fatalf("psql printed %q, want three lines", r.stdout)
			}
			token, err := strconv.ParseInt(lines[0], 10, 64)
			if err != nil || token <= 1 {
				t.Errorf("SHOW %s = %q, want the lock's token", tc.token, lines[0])
			}
			if lines[1] != tc.key {
				t.Errorf("SHOW %s = %q, want %q", tc.lock, lines[1], tc.key)
			}
			if lines[2] != "nightly report" {
				t.Errorf("SHOW app.job = %q: the caller's PGOPTIONS was not kept", lines[2])
			}
			e.assertFree(t, tc.key)
		})
	}
}

// TestLockPGOptionsEnv checks the command's environment: the token in
// FENCE_TOKEN and in PGOPTIONS agree, and only the first PGOPTIONS, the one
// libpq sees, is extended.
func TestLockPGOptionsEnv(t *testing.T) {
	t.Parallel()
	e := newLockEnv(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	l, err := etcdlock.Acquire(ctx, e.cli, "locks/env a", lock.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Release(ctx) //nolint:errcheck // the test checks the environment only

	env := commandEnv([]string{"HOME=/h", "PGOPTIONS=-c a.b=1", "FENCE_TOKEN=3", "PGOPTIONS=-c a.b=2"}, l, lock.Settings{})
	want := []string{
		"HOME=/h",
		"FENCE_TOKEN=" + strconv.FormatInt(l.Token(), 10),
		"FENCE_LOCK_KEY=locks/env a",
		"PGOPTIONS=-c a.b=1 -c fence.token=" + strconv.FormatInt(l.Token(), 10) + ` -c fence.lock=locks/env\ a`,
	}
	if strings.Join(env, "\n") != strings.Join(want, "\n") {
		t.Errorf("environment\n%q\nwant\n%q", env, want)
	}
}

// TestLockRedis runs fenceproxy lock --redis end to end: real psql reads
// the token and the key from PGOPTIONS, a second command waits for the
// first and gets a larger token, the password comes from the environment
// and stays out of every message, and the lock is free afterwards.
func TestLockRedis(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL, psql")
	psql, err := exec.LookPath("psql")
	if err != nil {
		t.Fatalf("psql not found: %v", err)
	}
	const password = "s3cret-pw"
	rs := redistest.Start(t, rediscluster.Options{Args: []string{"requirepass", password}})
	pg := pgtest.Start(t, pgcluster.Options{})
	t.Setenv("FENCEPROXY_REDIS_PASSWORD", password)
	url := rs.URL()
	run := func(ctx context.Context, args ...string) (*testutil.SyncBuffer, *testutil.SyncBuffer, <-chan lockRun) {
		stdout, stderr := new(testutil.SyncBuffer), new(testutil.SyncBuffer)
		res := make(chan lockRun, 1)
		go func() {
			code := lockMain(ctx, append([]string{"--redis", url}, args...), stdout, stderr)
			res <- lockRun{code, stdout, stderr}
		}()
		return stdout, stderr, res
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()

	const key = "locks/redis report"
	r := wait(t, func() <-chan lockRun {
		_, _, res := run(ctx, key, "--", psql, "-X", "-At", "-v", "ON_ERROR_STOP=1", "-d", pg.SuperuserDSN("postgres"),
			"-c", "SHOW fence.token", "-c", "SHOW fence.lock")
		return res
	}(), 30*time.Second)
	if r.code != 0 {
		t.Fatalf("exit %d, stderr %q", r.code, r.stderr)
	}
	lines := strings.Split(strings.TrimSuffix(r.stdout.String(), "\n"), "\n")
	if len(lines) != 2 || lines[0] != "1" || lines[1] != key {
		t.Fatalf("psql printed %q, want token 1 and %q", r.stdout, key)
	}

	// A holder that sleeps, and a second command that waits for it.
	_, errA, resA := run(ctx, key, "--", "sh", "-c", `echo "a $FENCE_TOKEN"; sleep 0.5`)
	time.Sleep(150 * time.Millisecond)
	outB, _, resB := run(ctx, key, "--", "sh", "-c", `echo "b $FENCE_TOKEN"`)
	if a := wait(t, resA, 30*time.Second); a.code != 0 || a.stdout.String() != "a 2\n" {
		t.Fatalf("first: exit %d, stdout %q, stderr %q", a.code, a.stdout, errA)
	}
	if b := wait(t, resB, 30*time.Second); b.code != 0 || outB.String() != "b 3\n" {
		t.Fatalf("second: exit %d, stdout %q, stderr %q", b.code, outB, b.stderr)
	}

	// --wait 0 while held fails at once with exit 1.
	_, _, resH := run(ctx, key, "--", "sleep", "2")
	time.Sleep(300 * time.Millisecond)
	if f := wait(t, func() <-chan lockRun { _, _, res := run(ctx, "--wait", "0", key, "--", "true"); return res }(), 10*time.Second); f.code != exitFailed || !strings.Contains(f.stderr.String(), "is held") {
		t.Errorf("--wait 0 while held: exit %d, stderr %q", f.code, f.stderr)
	}
	wait(t, resH, 30*time.Second)

	// A wrong password: the message names the address, never the secret.
	t.Setenv("FENCEPROXY_REDIS_PASSWORD", "wrong-"+password)
	f := wait(t, func() <-chan lockRun { _, _, res := run(ctx, key, "--", "true"); return res }(), 10*time.Second)
	if f.code != exitFailed || strings.Contains(f.stderr.String(), password) || !strings.Contains(f.stderr.String(), rs.Addr()) {
		t.Errorf("wrong password: exit %d, stderr %q", f.code, f.stderr)
	}
	if f := lockMain(ctx, []string{"--redis", "redis://:" + password + "@[bad", key, "--", "true"}, new(bytes.Buffer), new(testutil.SyncBuffer)); f != exitFailed {
		t.Errorf("bad URL: exit %d", f)
	}
}

// TestLockRedisLeaseLost: when the key is deleted under the command (as a
// Redis restart without persistence would), the command gets SIGTERM and
// fenceproxy lock exits 75.
func TestLockRedisLeaseLost(t *testing.T) {
	t.Parallel()
	rs := redistest.Start(t, rediscluster.Options{})
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	stdout, stderr := new(testutil.SyncBuffer), new(testutil.SyncBuffer)
	res := make(chan lockRun, 1)
	go func() {
		code := lockMain(ctx, []string{"--redis", rs.URL(), "--ttl", "3s", "locks/lost", "--", "sh", "-c", "echo started; sleep 30"}, stdout, stderr)
		res <- lockRun{code, stdout, stderr}
	}()
	waitFor(t, stdout, "started", 10*time.Second)
	rs.Crash()
	if err := rs.Restart(ctx); err != nil {
		t.Fatal(err)
	}
	r := wait(t, res, 20*time.Second)
	if r.code != exitLeaseLost || !strings.Contains(r.stderr.String(), "lease lost") {
		t.Errorf("exit %d, stderr %q; want %d and lease lost", r.code, r.stderr, exitLeaseLost)
	}
}

// TestLockRedisSeed: after a Redis restart without persistence the
// counter starts again at 1; --seed-from raises it above the lock's
// watermark in the database plus --seed-margin, without COMMAND only
// seeding, and never lowers it.
func TestLockRedisSeed(t *testing.T) {
	rs := redistest.Start(t, rediscluster.Options{})
	pg := pgtest.Start(t, pgcluster.Options{})
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, pg.SuperuserDSN("postgres"))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	if _, err := dbsetup.Setup(ctx, conn, nil, dbsetup.SetupOptions{}); err != nil {
		t.Fatal(err)
	}
	const key = "locks/seeded"
	if _, err := conn.Exec(ctx, "INSERT INTO fenceproxy.locks (name, token) VALUES ($1, 41)", key); err != nil {
		t.Fatal(err)
	}
	run := func(args ...string) (int, string, string) {
		stdout, stderr := new(testutil.SyncBuffer), new(testutil.SyncBuffer)
		code := lockMain(ctx, append([]string{"--redis", rs.URL()}, args...), stdout, stderr)
		return code, stdout.String(), stderr.String()
	}
	if code, out, errOut := run("--seed-from", pg.SuperuserDSN("postgres"), "--seed-margin", "10", key); code != 0 || out != "51\n" {
		t.Fatalf("seed: exit %d, stdout %q, stderr %q; want 51", code, out, errOut)
	}
	if code, out, errOut := run(key, "--", "sh", "-c", `echo "$FENCE_TOKEN"`); code != 0 || out != "52\n" {
		t.Fatalf("after seeding: exit %d, stdout %q, stderr %q; want token 52", code, out, errOut)
	}
	// Seeding again with a smaller result leaves the counter alone, and
	// then runs COMMAND.
	if code, out, errOut := run("--seed-from", pg.SuperuserDSN("postgres"), "--seed-margin", "0", key, "--", "sh", "-c", `echo "$FENCE_TOKEN"`); code != 0 || out != "52\n53\n" {
		t.Fatalf("seed lower, then run: exit %d, stdout %q, stderr %q; want 52 then token 53", code, out, errOut)
	}
	// A lock with no watermark is seeded to the margin.
	if code, out, _ := run("--seed-from", pg.SuperuserDSN("postgres"), "locks/never-used"); code != 0 || out != strconv.Itoa(defaultSeedMargin)+"\n" {
		t.Errorf("seed a lock without watermark: exit %d, stdout %q", code, out)
	}
	if code, _, errOut := run("--seed-from", "postgres://u:pw-secret@[bad", key); code != exitFailed || strings.Contains(errOut, "pw-secret") {
		t.Errorf("bad DSN: exit %d, stderr %q", code, errOut)
	}
	stderr := new(testutil.SyncBuffer)
	if code := lockMain(ctx, []string{"--seed-from", pg.SuperuserDSN("postgres"), key}, new(bytes.Buffer), stderr); code != exitUsage {
		t.Errorf("--seed-from without --redis: exit %d, stderr %q", code, stderr)
	}
}
