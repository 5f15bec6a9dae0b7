package e2e_test

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/fenceproxy/fenceproxy/internal/rules"
	"github.com/fenceproxy/fenceproxy/internal/testutil"
	"github.com/fenceproxy/fenceproxy/lock"
	"github.com/fenceproxy/fenceproxy/lock/etcdlock"
	"github.com/fenceproxy/fenceproxy/lock/pgxlock"
)

// The worker side: what a re-executed test binary runs. Workers are the
// "application": they take a lock in etcd, set the session's fence.token
// and read and write through the proxy with pgx. They report on stdout,
// one line per event, each starting with linePrefix; stderr is for
// diagnostics.

// runWorker runs the worker named by role and returns the exit code.
func runWorker(role string) int {
	var cfg workerConfig
	if err := json.Unmarshal([]byte(os.Getenv(configEnv)), &cfg); err != nil {
		fmt.Fprintf(os.Stderr, "worker: bad $%s: %v\n", configEnv, err)
		return 2
	}
	var err error
	switch role {
	case roleClient:
		err = runClient(cfg)
	case roleTorture:
		err = runTortureWorker(cfg)
	default:
		err = fmt.Errorf("unknown role %q", role)
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "worker %s: %v\n", cfg.Name, err)
		return 1
	}
	return 0
}

// out writes protocol lines; a mutex keeps concurrent lines whole.
var out struct {
	mu sync.Mutex
}

// emit writes one protocol line. Fields are separated by spaces; the last
// one may contain spaces, never a newline.
func emit(fields ...any) {
	var b strings.Builder
	b.WriteString(linePrefix)
	for i, f := range fields {
		if i > 0 {
			b.WriteByte(' ')
		}
		b.WriteString(strings.ReplaceAll(fmt.Sprint(f), "\n", " "))
	}
	b.WriteByte('\n')
	out.mu.Lock()
	defer out.mu.Unlock()
	os.Stdout.WriteString(b.String())
}

func newEtcdClient(cfg workerConfig) (*clientv3.Client, error) {
	return clientv3.New(clientv3.Config{
		Endpoints:   cfg.Etcd,
		DialTimeout: 10 * time.Second,
		Logger:      zap.NewNop(),
	})
}

// connectPG connects to dsn with the session settings every worker uses,
// and with lease's token and lock name as startup parameters when lease is
// not nil (pgxlock.Configure). lock_timeout and statement_timeout bound
// the wait behind a paused worker that holds a row lock, or a lock's
// registration, in an open transaction: such a wait is expected
// (PostgreSQL keeps the row consistent, the register procedure makes a
// newer token wait for older ones) and ends either when the paused worker
// resumes or with an error, which the worker counts as a failed operation.
func connectPG(ctx context.Context, cfg workerConfig, dsn string, lease *etcdlock.Lease) (*pgx.Conn, error) {
	pc, err := pgx.ParseConfig(dsn)
	if err != nil {
		return nil, err
	}
	pc.RuntimeParams["application_name"] = "e2e-" + cfg.Name
	pc.RuntimeParams["lock_timeout"] = "5s"
	pc.RuntimeParams["statement_timeout"] = "15s"
	if cfg.SimpleProtocol {
		pc.DefaultQueryExecMode = pgx.QueryExecModeSimpleProtocol
	}
	if lease != nil {
		pgxlock.Configure(pc, lease.Fence(lock.Settings{}))
	}
	return pgx.ConnectConfig(ctx, pc)
}

func setToken(ctx context.Context, conn *pgx.Conn, token int64) error {
	_, err := conn.Exec(ctx, "SELECT pg_catalog.set_config('fence.token', $1, false)", strconv.FormatInt(token, 10))
	return err
}

// setLock sets the session's lock name and token. The setting names are
// written into the statement's text, not passed as parameters: the proxy
// starts registering a session's token only once it has seen the session
// mention fence.lock, in its startup parameters or in a statement's text.
func setLock(ctx context.Context, conn *pgx.Conn, lease *etcdlock.Lease) error {
	_, err := conn.Exec(ctx, "SELECT pg_catalog.set_config('fence.lock', $1, false), pg_catalog.set_config('fence.token', $2, false)",
		lease.Key(), strconv.FormatInt(lease.Token(), 10))
	return err
}

// sqlState is the shared test helper.
var sqlState = testutil.SQLState

// ---------------------------------------------------------------------------
// The scripted client: one command per stdin line, one reply per command,
// "ok ..." or "err <SQLSTATE or -> <message>". The timeline tests drive
// processes A and B with it, step by step.
//
//	lock KEY TTL [HOW]    take the lock (no keep-alive) and hand the grant
//	                      to the session; ok TOKEN GRANTED-TTL. HOW is
//	                      token (the default: set fence.token only),
//	                      set (set fence.lock and fence.token with
//	                      set_config) or startup (reconnect with both as
//	                      startup parameters, pgxlock.Configure)
//	stamp TABLE ID        UPDATE TABLE SET payload = payload WHERE id = ID;
//	                      ok ROWS
//	read TABLE ID         ok PAYLOAD
//	write TABLE ID TEXT   UPDATE TABLE SET payload = TEXT WHERE id = ID;
//	                      ok ROWS
//	insert TABLE ID TEXT  INSERT INTO TABLE (id, payload) VALUES (ID, TEXT);
//	                      ok ROWS
//	delete TABLE ID       DELETE FROM TABLE WHERE id = ID; ok ROWS
//	lease                 ok held | ok lost REASON
//	release               ok | err notheld MESSAGE

func runClient(cfg workerConfig) error {
	ctx := context.Background()
	cctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	conn, err := connectPG(cctx, cfg, cfg.DSN, nil)
	cancel()
	if err != nil {
		return fmt.Errorf("connect: %w", err)
	}
	c := &client{conn: conn, cfg: cfg}
	// c.conn, not conn: "lock KEY TTL startup" replaces the connection.
	defer func() { c.conn.Close(ctx) }()
	cli, err := newEtcdClient(cfg)
	if err != nil {
		return fmt.Errorf("etcd: %w", err)
	}
	defer cli.Close()
	c.cli = cli

	sc := bufio.NewScanner(os.Stdin)
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) == 0 {
			continue
		}
		cctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		reply := c.do(cctx, f[0], f[1:])
		cancel()
		emit(reply...)
	}
	if c.lease != nil {
		_ = c.lease.Release(ctx)
	}
	return sc.Err()
}

type client struct {
	conn  *pgx.Conn
	cli   *clientv3.Client
	cfg   workerConfig
	lease *etcdlock.Lease
}

func (c *client) do(ctx context.Context, cmd string, args []string) []any {
	// Arguments: at least min, at most max.
	need := map[string][2]int{
		"lock": {2, 3}, "stamp": {2, 2}, "read": {2, 2}, "write": {3, 3},
		"insert": {3, 3}, "delete": {2, 2}, "lease": {0, 0}, "release": {0, 0},
	}
	n, ok := need[cmd]
	if !ok || len(args) < n[0] || len(args) > n[1] {
		return []any{"err", "-", fmt.Sprintf("bad command %q %q", cmd, args)}
	}
	switch cmd {
	case "lock":
		ttl, err := time.ParseDuration(args[1])
		if err != nil {
			return errReply(err)
		}
		how := "token"
		if len(args) == 3 {
			how = args[2]
		}
		if how != "token" && how != "set" && how != "startup" {
			return []any{"err", "-", fmt.Sprintf("lock: unknown way %q", how)}
		}
		l, err := etcdlock.Acquire(ctx, c.cli, args[0], lock.Options{TTL: ttl, Holder: c.cfg.Name})
		if err != nil {
			return errReply(err)
		}
		c.lease = l
		switch how {
		case "token":
			err = setToken(ctx, c.conn, l.Token())
		case "set":
			err = setLock(ctx, c.conn, l)
		case "startup":
			var conn *pgx.Conn
			if conn, err = connectPG(ctx, c.cfg, c.cfg.DSN, l); err == nil {
				_ = c.conn.Close(ctx)
				c.conn = conn
			}
		}
		if err != nil {
			return errReply(err)
		}
		return []any{"ok", l.Token(), l.TTL()}
	case "stamp":
		tag, err := c.conn.Exec(ctx, "UPDATE "+ident(args[0])+" SET payload = payload WHERE id = $1", args[1])
		if err != nil {
			return errReply(err)
		}
		return []any{"ok", tag.RowsAffected()}
	case "read":
		var payload string
		if err := c.conn.QueryRow(ctx, "SELECT payload FROM "+ident(args[0])+" WHERE id = $1", args[1]).Scan(&payload); err != nil {
			return errReply(err)
		}
		return []any{"ok", payload}
	case "write":
		tag, err := c.conn.Exec(ctx, "UPDATE "+ident(args[0])+" SET payload = $2 WHERE id = $1", args[1], args[2])
		if err != nil {
			return errReply(err)
		}
		return []any{"ok", tag.RowsAffected()}
	case "insert":
		tag, err := c.conn.Exec(ctx, "INSERT INTO "+ident(args[0])+" (id, payload) VALUES ($1, $2)", args[1], args[2])
		if err != nil {
			return errReply(err)
		}
		return []any{"ok", tag.RowsAffected()}
	case "delete":
		tag, err := c.conn.Exec(ctx, "DELETE FROM "+ident(args[0])+" WHERE id = $1", args[1])
		if err != nil {
			return errReply(err)
		}
		return []any{"ok", tag.RowsAffected()}
	case "lease":
		if c.lease == nil {
			return []any{"err", "-", "no lease"}
		}
		if err := c.lease.Err(); err != nil {
			return []any{"ok", "lost", err}
		}
		return []any{"ok", "held"}
	case "release":
		if c.lease == nil {
			return []any{"err", "-", "no lease"}
		}
		err := c.lease.Release(ctx)
		c.lease = nil
		if errors.Is(err, lock.ErrNotHeld) {
			return []any{"err", "notheld", err}
		}
		if err != nil {
			return errReply(err)
		}
		return []any{"ok"}
	}
	panic("unreachable")
}

func errReply(err error) []any {
	code := sqlState(err)
	if code == "" {
		code = "-"
	}
	return []any{"err", code, err}
}

// ident quotes a schema-qualified name the test chose.
func ident(qualified string) string {
	return pgx.Identifier(strings.Split(qualified, ".")).Sanitize()
}

// ---------------------------------------------------------------------------
// The torture worker: until stdin says "stop" or closes, repeatedly
//
//	lock a random key → SET fence.token → stamp the row → read it →
//	think (random sleep) → BEGIN; UPDATE the row to old+1; INSERT history;
//	[sometimes think again] COMMIT → release
//
// or, with NameLock, the same without the stamp, the session naming the
// lock as well as the token:
//
//	lock a random key → SET fence.lock, fence.token (or connect with
//	both as startup parameters) → read → think → BEGIN; UPDATE; INSERT
//	history; [think] COMMIT → release
//
// reporting each operation on stdout:
//
//	lock OP KEY TOKEN TTL   the lock is held; OP is this operation's id
//	read OP VALUE           the row was read; the think time starts
//	try OP NEW              the write and history row are in, COMMIT is next
//	ack OP                  COMMIT succeeded
//	fenced OP PHASE MSG     FP001: the stamp, the read (lock fencing) or
//	                        the write was refused
//	failed OP PHASE MSG     an error before COMMIT: nothing was committed
//	unknown OP MSG          COMMIT failed or the connection broke during
//	                        it: the write may or may not be committed
//	odd OP MSG              something that must not happen (a wrong row
//	                        count, FP002); the checker reports it
//	unlock OP               the lock was released (or found lost)
//
// The worker deliberately does not look at Lease.Done before writing:
// checking the lock before the write leaves a gap anyway (docs/design.md), and
// the test wants stale holders to really try their writes.

// opTimeout bounds one operation's SQL as a safety net; the session's
// lock_timeout and statement_timeout fire first.
const opTimeout = 30 * time.Second

func runTortureWorker(cfg workerConfig) error {
	stop := make(chan struct{})
	go func() {
		sc := bufio.NewScanner(os.Stdin)
		for sc.Scan() && sc.Text() != "stop" {
		}
		close(stop)
	}()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() {
		<-stop
		cancel()
	}()

	cli, err := newEtcdClient(cfg)
	if err != nil {
		return fmt.Errorf("etcd: %w", err)
	}
	defer cli.Close()
	w := &tortureWorker{cfg: cfg, cli: cli, rng: rand.New(rand.NewPCG(cfg.Seed, 0))}
	defer w.closeConn()

	for seq := 1; ctx.Err() == nil; {
		// A worker that connects per operation does so holding the lock.
		if !cfg.LockViaStartup && (w.conn == nil || w.conn.IsClosed()) {
			w.closeConn()
			cctx, cancel := context.WithTimeout(ctx, 30*time.Second)
			w.conn, err = connectPG(cctx, cfg, w.pickDSN(), nil)
			cancel()
			if err != nil {
				fmt.Fprintf(os.Stderr, "connect: %v\n", err)
				w.conn = nil
				sleep(ctx, 200*time.Millisecond)
				continue
			}
		}
		key := 1 + w.rng.IntN(cfg.Keys)
		lease, err := w.acquire(ctx, key)
		if err != nil {
			if ctx.Err() == nil && !errors.Is(err, context.DeadlineExceeded) && !errors.Is(err, lock.ErrLocked) {
				fmt.Fprintf(os.Stderr, "acquire: %v\n", err)
			}
			// Not at once: the next key's lock may be taken too.
			sleep(ctx, time.Duration(w.rng.Int64N(int64(5*time.Millisecond))))
			continue
		}
		op := fmt.Sprintf("%s-%d", cfg.Name, seq)
		seq++
		emit("lock", op, key, lease.Token(), lease.TTL())
		w.readModifyWrite(op, key, lease)
		rctx, rcancel := context.WithTimeout(context.Background(), 10*time.Second)
		_ = lease.Release(rctx) // ErrNotHeld for a holder that was paused past its lease
		rcancel()
		emit("unlock", op)
		sleep(ctx, time.Duration(w.rng.Int64N(int64(20*time.Millisecond))))
	}
	return nil
}

func lockKey(prefix string, key int) string { return prefix + strconv.Itoa(key) }

type tortureWorker struct {
	cfg  workerConfig
	cli  *clientv3.Client
	conn *pgx.Conn
	rng  *rand.Rand
}

// acquire takes the lock of key. A worker with SkipBusyOdds first tries
// without waiting and, finding the lock taken, moves on (lock.ErrLocked)
// with that probability, the way a worker of a job queue takes other
// work; otherwise it waits in line: for the holder to release or its
// lease to end. "stop" cancels the wait; the timeout is only a safety net.
func (w *tortureWorker) acquire(ctx context.Context, key int) (*etcdlock.Lease, error) {
	actx, acancel := context.WithTimeout(ctx, 10*time.Second)
	defer acancel()
	name, opts := lockKey(w.cfg.KeyPrefix, key), lock.Options{TTL: w.cfg.TTL, Holder: w.cfg.Name}
	if w.cfg.SkipBusyOdds > 0 {
		lease, err := etcdlock.TryAcquire(actx, w.cli, name, opts)
		if !errors.Is(err, lock.ErrLocked) || w.rng.Float64() < w.cfg.SkipBusyOdds {
			return lease, err
		}
	}
	return etcdlock.Acquire(actx, w.cli, name, opts)
}

// pickDSN returns one of the configured DSNs at random.
func (w *tortureWorker) pickDSN() string {
	return w.cfg.DSNs[w.rng.IntN(len(w.cfg.DSNs))]
}

func (w *tortureWorker) closeConn() {
	if w.conn != nil {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		_ = w.conn.Close(ctx)
		cancel()
		w.conn = nil
	}
}

// readModifyWrite is one operation under lease: the stamped protocol of
// docs/design.md, or with NameLock the lock-fenced one without a stamp. It
// does not take the stop context: once the lock is held, the operation
// runs to its end.
func (w *tortureWorker) readModifyWrite(op string, key int, lease *etcdlock.Lease) {
	ctx, cancel := context.WithTimeout(context.Background(), opTimeout)
	defer cancel()
	token := lease.Token()
	conn := w.conn
	switch {
	case !w.cfg.NameLock:
		if err := setToken(ctx, conn, token); err != nil {
			w.notCommitted(op, "set-token", err)
			return
		}
		// The stamp: a fenced no-op write that registers the token on the
		// row before the read, so that no older holder can write after it.
		tag, err := conn.Exec(ctx, "UPDATE public.counters SET value = value WHERE id = $1", key)
		if err != nil {
			w.notCommitted(op, "stamp", err)
			return
		}
		if tag.RowsAffected() != 1 {
			emit("odd", op, fmt.Sprintf("stamp updated %d rows, want 1", tag.RowsAffected()))
			return
		}
	case w.cfg.LockViaStartup:
		// A connection of this grant's own, through a proxy picked now:
		// the startup parameters carry the lock's name and token, and no
		// statement sets them.
		cctx, ccancel := context.WithTimeout(ctx, 10*time.Second)
		c, err := connectPG(cctx, w.cfg, w.pickDSN(), lease)
		ccancel()
		if err != nil {
			w.notCommitted(op, "connect", err)
			return
		}
		w.conn, conn = c, c
		defer w.closeConn()
	default:
		if err := setLock(ctx, conn, lease); err != nil {
			w.notCommitted(op, "set-lock", err)
			return
		}
	}
	// No stamp with NameLock: the read itself registers the token for the
	// lock, and from then on no older holder of the lock gets past the
	// proxy on a lock-fenced table.
	var old int64
	if err := conn.QueryRow(ctx, "SELECT value FROM public.counters WHERE id = $1", key).Scan(&old); err != nil {
		w.notCommitted(op, "read", err)
		return
	}
	emit("read", op, old)
	time.Sleep(w.think())

	tx, err := conn.Begin(ctx)
	if err != nil {
		w.notCommitted(op, "begin", err)
		return
	}
	// Rollback after Commit is a no-op; after an error it ends the aborted
	// transaction, or does nothing on a broken connection.
	defer func() { _ = tx.Rollback(ctx) }()
	newValue := old + 1
	tag, err := tx.Exec(ctx, "UPDATE public.counters SET value = $2 WHERE id = $1", key, newValue)
	if err != nil {
		w.notCommitted(op, "write", err)
		return
	}
	if tag.RowsAffected() != 1 {
		emit("odd", op, fmt.Sprintf("write updated %d rows, want 1", tag.RowsAffected()))
		return
	}
	// The history row goes in the same transaction as the counter update,
	// so an acknowledged (committed) increment always has its row.
	if _, err := tx.Exec(ctx, "INSERT INTO public.history (op_id, key, token, new_value) VALUES ($1, $2, $3, $4)",
		op, key, token, newValue); err != nil {
		w.notCommitted(op, "history", err)
		return
	}
	// Sometimes think inside the transaction too, holding the row lock:
	// a pause here makes the next holder's stamp wait for the row
	// (PostgreSQL then re-checks the fence against the committed version),
	// and the parent's terminator finds idle-in-transaction sessions to
	// break, which exercises the unknown-outcome path.
	if w.rng.Float64() < w.cfg.TxThinkOdds {
		time.Sleep(w.think() / 4)
	}
	emit("try", op, newValue)
	if err := tx.Commit(ctx); err != nil {
		// Whatever the error, the outcome is not known for sure: the
		// commit may have been applied before the connection broke.
		emit("unknown", op, err)
		return
	}
	emit("ack", op)
}

// think returns a random think time.
func (w *tortureWorker) think() time.Duration {
	d := w.cfg.MinThink
	if spread := w.cfg.MaxThink - w.cfg.MinThink; spread > 0 {
		d += time.Duration(w.rng.Int64N(int64(spread)))
	}
	return d
}

// notCommitted reports an operation that failed before COMMIT was sent, so
// that nothing of it can be committed.
func (w *tortureWorker) notCommitted(op, phase string, err error) {
	switch sqlState(err) {
	case rules.CodeStaleToken:
		emit("fenced", op, phase, err)
	case rules.CodeMissingToken:
		emit("odd", op, phase+": "+err.Error())
	default:
		emit("failed", op, phase, err)
	}
}

func sleep(ctx context.Context, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
	case <-ctx.Done():
	}
}
