package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/redis/go-redis/v9"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/fenceproxy/fenceproxy/lock"
	"github.com/fenceproxy/fenceproxy/lock/etcdlock"
	"github.com/fenceproxy/fenceproxy/lock/redislock"
)

const lockUsage = `usage: fenceproxy lock [flags] KEY [--] COMMAND [ARGS...]
       fenceproxy lock --redis URL --seed-from DSN [flags] KEY [[--] COMMAND [ARGS...]]

Takes the lock KEY in etcd (or in Redis with --redis), runs COMMAND while
holding it and releases it when COMMAND exits, like flock(1). COMMAND gets the fencing token in FENCE_TOKEN
and the key in FENCE_LOCK_KEY. The lease is renewed while COMMAND runs.

COMMAND's PGOPTIONS gets "-c fence.token=TOKEN -c fence.lock=KEY" appended
(setting names from --token-setting and --lock-setting), so every libpq
program it runs, psql included, sets both for each session it opens. A
connection string with its own options parameter overrides PGOPTIONS.

KEY is the same lock as "etcdctl lock KEY": the two exclude each other and
wait in one line; the token is the creation revision of the holder's key
KEY/<lease ID in hex>.

With --redis URL (redis:// or rediss:// for TLS; a password in the URL, in
$FENCEPROXY_REDIS, or in $FENCEPROXY_REDIS_PASSWORD, so that it stays off
the command line) the lock is the Redis hash KEY and the token comes from
the counter redisson_lock_token:{KEY}, drawn in the same script that takes
the lock: the layout of Redisson's RFencedLock, so Java services using it
and this command exclude each other and share one token sequence. Redis
must keep the counter (appendonly yes, appendfsync always, noeviction);
see docs/tokens.md.

After Redis lost the counter (a restart without persistence, a failover,
an eviction), --seed-from DSN raises it, before the lock is taken, to the
lock's watermark in that database (fenceproxy.locks) plus --seed-margin,
so that the next token is larger than every token the database accepted
and than those granted but not yet used; it never lowers the counter.
Without COMMAND it only seeds and prints the counter. Give the DSN's
password in $PGPASSWORD or ~/.pgpass, not in the DSN on the command line.

SIGINT and SIGTERM are forwarded to COMMAND. If the lease is lost, COMMAND
gets SIGTERM, then SIGKILL after 5s, and fenceproxy exits with status 75.
Unless stdin is a terminal, COMMAND runs in its own process group and
signals go to the whole group, so its children stop too.

Exit status: COMMAND's status (128+N if killed by signal N); 1 if the lock
was not taken (held with --wait 0, timed out, etcd or Redis error); 2 usage error;
75 lease lost; 126/127 COMMAND could not be run.

flags (each also from $FENCEPROXY_<NAME>, e.g. FENCEPROXY_ETCD):
`

// Exit statuses of the lock command besides the child's own.
const (
	exitFailed     = 1
	exitUsage      = 2
	exitLeaseLost  = 75 // EX_TEMPFAIL: the work may be retried
	exitCannotRun  = 126
	exitNotFound   = 127
	exitSignalBase = 128
)

const (
	// etcdTimeout bounds the first contact with etcd and the release.
	// Without it an unreachable etcd would make the command hang: the
	// client retries until its context ends.
	etcdTimeout = 5 * time.Second
	// killGrace is how long a child has to exit after SIGTERM on lease loss
	// before it gets SIGKILL.
	killGrace = 5 * time.Second
)

// waitFlag is --wait: unset means wait for as long as it takes.
type waitFlag struct {
	d   time.Duration
	set bool
}

func (w *waitFlag) String() string {
	if !w.set {
		return "forever"
	}
	return w.d.String()
}

func (w *waitFlag) Set(s string) error {
	d, err := time.ParseDuration(s)
	if err != nil {
		return err
	}
	if d < 0 {
		return errors.New("must not be negative")
	}
	w.d, w.set = d, true
	return nil
}

type lockArgs struct {
	endpoints  []string
	redisURL   string // empty: etcd
	seedFrom   string // a DSN; empty: no seeding
	seedMargin int64
	ttl        time.Duration
	wait       waitFlag
	settings   lock.Settings
	key        string
	command    []string
}

// parseLockArgs parses the command line. On failure it returns nil and the
// exit status.
func parseLockArgs(args []string, stdout, stderr io.Writer) (*lockArgs, int) {
	var a lockArgs
	c := newCommand("lock", "lock [flags] KEY [--] COMMAND [ARGS...]", stdout, stderr)
	fs := c.fs
	fs.Usage = func() {
		fmt.Fprint(fs.Output(), lockUsage)
		fs.PrintDefaults()
	}
	etcd := fs.String("etcd", "127.0.0.1:2379", "comma-separated etcd endpoints")
	fs.StringVar(&a.redisURL, "redis", "", "take the lock in Redis at this URL (redis://[[user]:password@]host:port[/db], rediss:// for TLS) instead of etcd")
	fs.StringVar(&a.seedFrom, "seed-from", "", "with --redis: first raise KEY's token counter above its watermark in the PostgreSQL database at this DSN")
	fs.Int64Var(&a.seedMargin, "seed-margin", defaultSeedMargin, "with --seed-from: what is added to the watermark")
	fs.DurationVar(&a.ttl, "ttl", lock.DefaultTTL, "lease TTL, whole seconds, at least 1s")
	fs.Var(&a.wait, "wait", "how long to wait for the lock; 0 fails at once if it is held")
	fs.StringVar(&a.settings.Token, "token-setting", lock.DefaultTokenSetting, "PostgreSQL setting that carries the token in PGOPTIONS")
	fs.StringVar(&a.settings.Lock, "lock-setting", lock.DefaultLockSetting, "PostgreSQL setting that carries KEY in PGOPTIONS")

	usageErr := func(format string, v ...any) (*lockArgs, int) {
		fmt.Fprintf(stderr, "fenceproxy lock: "+format+"\n", v...)
		fs.Usage()
		return nil, exitUsage
	}
	if code, ok := c.parse(args); !ok {
		return nil, code
	}
	rest := fs.Args()
	if len(rest) == 0 || rest[0] == "" {
		return usageErr("missing KEY")
	}
	a.key = rest[0]
	// Flags may also come between KEY and "--"; Parse consumes the "--".
	if err := fs.Parse(rest[1:]); err != nil {
		return nil, exitUsage
	}
	a.command = fs.Args()
	if a.seedFrom != "" && a.redisURL == "" {
		return usageErr("--seed-from needs --redis: etcd's tokens are its revisions, which cannot be seeded")
	}
	if a.seedMargin < 0 {
		return usageErr("--seed-margin must not be negative")
	}
	if len(a.command) == 0 && a.seedFrom == "" {
		return usageErr("missing COMMAND")
	}
	if a.ttl < time.Second {
		return usageErr("--ttl must be at least 1s, got %v", a.ttl)
	}
	if err := a.settings.Validate(); err != nil {
		return usageErr("%v", strings.TrimPrefix(err.Error(), "lock: "))
	}
	for _, ep := range strings.Split(*etcd, ",") {
		if ep = strings.TrimSpace(ep); ep != "" {
			a.endpoints = append(a.endpoints, ep)
		}
	}
	if len(a.endpoints) == 0 {
		return usageErr("--etcd names no endpoint")
	}
	return &a, 0
}

// lockMain implements "fenceproxy lock": see lockUsage.
func lockMain(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	a, code := parseLockArgs(args, stdout, stderr)
	if a == nil {
		return code
	}
	fail := func(format string, v ...any) int {
		fmt.Fprintf(stderr, "fenceproxy lock: "+format+"\n", v...)
		return exitFailed
	}

	// Catch the signals before anything can block, so that they interrupt
	// the wait for the lock and then reach the child.
	sigs := make(chan os.Signal, 4)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM)
	defer signal.Stop(sigs)

	var locker lock.Locker
	if a.redisURL != "" {
		rcli, addr, err := redisClient(a.redisURL)
		if err != nil {
			return fail("--redis: %v", err)
		}
		defer rcli.Close()
		pctx, cancel := context.WithTimeout(ctx, etcdTimeout)
		err = rcli.Ping(pctx).Err()
		cancel()
		if err != nil {
			return fail("redis at %s: %v", addr, err)
		}
		rl := redislock.New(rcli, redislock.Options{})
		if a.seedFrom != "" {
			if code := seedRedis(ctx, rl, a, stdout, stderr); code != 0 || len(a.command) == 0 {
				return code
			}
		}
		locker = rl
	} else {
		cli, err := clientv3.New(clientv3.Config{
			Endpoints:   a.endpoints,
			DialTimeout: etcdTimeout,
			Logger:      zap.NewNop(),
		})
		if err != nil {
			return fail("etcd: %v", err)
		}
		defer cli.Close()
		pctx, cancel := context.WithTimeout(ctx, etcdTimeout)
		_, err = cli.Get(pctx, a.key, clientv3.WithCountOnly())
		cancel()
		if err != nil {
			return fail("etcd at %s: %v", strings.Join(a.endpoints, ","), err)
		}
		locker = etcdlock.New(cli)
	}

	l, code := acquireForCommand(ctx, locker, a, sigs, stderr)
	if l == nil {
		return code
	}
	return runHolding(ctx, l, a.command, a.settings, sigs, stdout, stderr)
}

// acquireForCommand takes the lock as --wait says. A SIGINT or SIGTERM
// meanwhile abandons the wait. On failure it returns nil and the exit
// status.
func acquireForCommand(ctx context.Context, locker lock.Locker, a *lockArgs, sigs <-chan os.Signal, stderr io.Writer) (lock.Grant, int) {
	actx, cancel := context.WithCancel(ctx)
	defer cancel()
	if a.wait.set && a.wait.d > 0 {
		actx, cancel = context.WithTimeout(actx, a.wait.d)
		defer cancel()
	}

	var caught os.Signal
	stop, stopped := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(stopped)
		select {
		case caught = <-sigs:
			cancel()
		case <-stop:
		}
	}()
	opts := lock.Options{TTL: a.ttl, KeepAlive: true}
	var (
		l   lock.Grant
		err error
	)
	if a.wait.set && a.wait.d == 0 {
		l, err = locker.TryAcquire(actx, a.key, opts)
	} else {
		l, err = locker.Acquire(actx, a.key, opts)
	}
	close(stop)
	<-stopped
	if err == nil {
		return l, 0
	}
	if caught == nil {
		// The caller's context may have been canceled by the same signal
		// before our handler saw it.
		select {
		case caught = <-sigs:
		default:
		}
	}

	var locked *lock.LockedError
	switch {
	case caught != nil:
		fmt.Fprintf(stderr, "fenceproxy lock: %v while waiting for %q\n", caught, a.key)
		return nil, exitSignalBase + signalNumber(caught)
	case errors.As(err, &locked):
		fmt.Fprintf(stderr, "fenceproxy lock: %q is held by %q (token %d)\n", a.key, locked.Holder, locked.Token)
	case errors.Is(err, context.DeadlineExceeded) && ctx.Err() == nil:
		fmt.Fprintf(stderr, "fenceproxy lock: %q still held after waiting %v\n", a.key, a.wait.d)
	default:
		fmt.Fprintf(stderr, "fenceproxy lock: %v\n", err)
	}
	return nil, exitFailed
}

// runHolding runs command while l is held, then releases l. It returns the
// command's exit status, or exitLeaseLost if the lease was lost while the
// command ran.
func runHolding(ctx context.Context, l lock.Grant, command []string, settings lock.Settings, sigs <-chan os.Signal, stdout, stderr io.Writer) int {
	defer func() {
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), etcdTimeout)
		defer cancel()
		if err := l.Release(rctx); err != nil && errors.Is(l.Err(), lock.ErrReleased) {
			// A lost lease has been reported already; anything else is
			// worth a line. The lease expires on its own in any case.
			fmt.Fprintf(stderr, "fenceproxy lock: release %q: %v\n", l.Key(), err)
		}
	}()
	if err := l.Err(); err != nil {
		reportLost(stderr, err, "")
		return exitLeaseLost
	}

	cmd := exec.Command(command[0], command[1:]...)
	cmd.Env = commandEnv(os.Environ(), l, settings)
	cmd.Stdin, cmd.Stdout, cmd.Stderr = os.Stdin, stdout, stderr
	// Do not let a grandchild that keeps our output pipes open hold us
	// after the child itself has exited.
	cmd.WaitDelay = killGrace
	ownGroup := !interactive()
	if ownGroup {
		// Its own process group lets signals reach the child's children
		// too. Not when stdin is a terminal: a background process group
		// is stopped when it reads from the terminal, and terminal
		// signals reach the child directly anyway.
		cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	}
	if err := cmd.Start(); err != nil {
		fmt.Fprintf(stderr, "fenceproxy lock: %v\n", err)
		if errors.Is(err, exec.ErrNotFound) || errors.Is(err, os.ErrNotExist) {
			return exitNotFound
		}
		return exitCannotRun
	}
	signalChild := func(s os.Signal) {
		if ownGroup {
			syscall.Kill(-cmd.Process.Pid, s.(syscall.Signal)) //nolint:errcheck // the group may be gone
		} else {
			cmd.Process.Signal(s) //nolint:errcheck // the child may be gone
		}
	}

	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	var (
		lost     bool
		kill     <-chan time.Time
		canceled = ctx.Done()
		lease    = l.Done()
	)
	for {
		select {
		case err := <-exited:
			if lost {
				return exitLeaseLost
			}
			if cmd.ProcessState == nil {
				fmt.Fprintf(stderr, "fenceproxy lock: %v\n", err)
				return exitFailed
			}
			return exitStatus(cmd.ProcessState)
		case s := <-sigs:
			signalChild(s)
		case <-canceled:
			canceled = nil
			// Our caller canceled us, most likely on the very signal that
			// is also waiting in sigs: pass that on rather than a second.
			select {
			case s := <-sigs:
				signalChild(s)
			default:
				signalChild(syscall.SIGTERM)
			}
		case <-lease:
			lease = nil
			lost = true
			reportLost(stderr, l.Err(), fmt.Sprintf("; sending SIGTERM to %s (pid %d)", command[0], cmd.Process.Pid))
			signalChild(syscall.SIGTERM)
			kill = time.After(killGrace)
		case <-kill:
			kill = nil
			fmt.Fprintf(stderr, "fenceproxy lock: %s still running %v after SIGTERM; sending SIGKILL\n", command[0], killGrace)
			signalChild(syscall.SIGKILL)
		}
	}
}

// commandEnv returns environ with the grant added: FENCE_TOKEN,
// FENCE_LOCK_KEY, and both settings appended to PGOPTIONS.
func commandEnv(environ []string, l lock.Grant, settings lock.Settings) []string {
	env := make([]string, 0, len(environ)+3)
	var (
		pgoptions string
		seen      bool
	)
	for _, kv := range environ {
		name, value, _ := strings.Cut(kv, "=")
		switch name {
		case "PGOPTIONS":
			// Keep the first, the one getenv(3) in libpq would see.
			if !seen {
				pgoptions, seen = value, true
			}
		case "FENCE_TOKEN", "FENCE_LOCK_KEY":
		default:
			env = append(env, kv)
		}
	}
	return append(env,
		"FENCE_TOKEN="+strconv.FormatInt(l.Token(), 10),
		"FENCE_LOCK_KEY="+l.Key(),
		"PGOPTIONS="+lock.AppendPGOptions(pgoptions, l.Fence(settings).PGOptions()),
	)
}

// defaultSeedMargin is --seed-margin's default: more grants than a lock
// sees between two registrations of a token in the database.
const defaultSeedMargin = 1_000_000

// seedRedis raises the token counter of a.key to its watermark in the
// database at a.seedFrom plus a.seedMargin and prints the counter.
func seedRedis(ctx context.Context, rl *redislock.Locker, a *lockArgs, stdout, stderr io.Writer) int {
	fail := func(format string, v ...any) int {
		fmt.Fprintf(stderr, "fenceproxy lock: --seed-from: "+format+"\n", v...)
		return exitFailed
	}
	cfg, err := pgx.ParseConfig(a.seedFrom)
	if err != nil {
		// ParseConfig's errors may quote the DSN, password and all.
		return fail("not a PostgreSQL connection string")
	}
	cctx, cancel := context.WithTimeout(ctx, etcdTimeout)
	defer cancel()
	conn, err := pgx.ConnectConfig(cctx, cfg)
	if err != nil {
		return fail("connect to %s: %v", cfg.Host, err)
	}
	defer conn.Close(context.Background())
	var w int64
	err = conn.QueryRow(cctx, "SELECT token FROM fenceproxy.locks WHERE name = $1", a.key).Scan(&w)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		// No watermark: nothing the database accepted to stay above.
	case err != nil:
		return fail("read the watermark of %q: %v", a.key, err)
	}
	v, err := rl.SeedToken(cctx, a.key, w+a.seedMargin)
	if err != nil {
		return fail("%v", err)
	}
	fmt.Fprintf(stdout, "%d\n", v)
	fmt.Fprintf(stderr, "fenceproxy lock: token counter of %q is %d (watermark %d, margin %d)\n", a.key, v, w, a.seedMargin)
	return 0
}

// redisClient connects to the Redis URL u; a password missing from u is
// taken from $FENCEPROXY_REDIS_PASSWORD. It returns the address, the part
// of u that is safe to print.
func redisClient(u string) (*redis.Client, string, error) {
	opt, err := redis.ParseURL(u)
	if err != nil {
		// ParseURL's errors may quote the URL, password and all.
		return nil, "", errors.New("not a redis:// or rediss:// URL")
	}
	if opt.Password == "" {
		opt.Password = os.Getenv(envPrefix + "REDIS_PASSWORD")
	}
	opt.DialTimeout = etcdTimeout
	return redis.NewClient(opt), opt.Addr, nil
}

func reportLost(stderr io.Writer, err error, then string) {
	reason := err.Error()
	var lostErr *lock.LostError
	if errors.As(err, &lostErr) {
		reason = fmt.Sprintf("%s (key %q, token %d)", lostErr.Reason, lostErr.Key, lostErr.Token)
	}
	fmt.Fprintf(stderr, "fenceproxy lock: lease lost: %s%s\n", reason, then)
}

// exitStatus maps how the child ended to our exit status, the way shells
// do: its exit code, or 128+N if signal N killed it.
func exitStatus(ps *os.ProcessState) int {
	if ws, ok := ps.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
		return exitSignalBase + int(ws.Signal())
	}
	if code := ps.ExitCode(); code >= 0 {
		return code
	}
	return exitFailed
}

func signalNumber(s os.Signal) int {
	if n, ok := s.(syscall.Signal); ok {
		return int(n)
	}
	return 0
}

// interactive reports whether stdin is a terminal. A character device other
// than /dev/null is taken for one; it needs no terminal ioctl, which differs
// per platform.
func interactive() bool {
	fi, err := os.Stdin.Stat()
	if err != nil || fi.Mode()&os.ModeCharDevice == 0 {
		return false
	}
	null, err := os.Stat(os.DevNull)
	return err != nil || !os.SameFile(fi, null)
}
