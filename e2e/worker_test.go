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

	"github.com/fenceproxy/fenceproxy/internal/testutil"
	"github.com/fenceproxy/fenceproxy/lock"
	"github.com/fenceproxy/fenceproxy/rules"
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

// connectPG connects to cfg.DSN with the session settings every worker
// uses. lock_timeout and statement_timeout bound the wait behind a paused
// worker that holds a row lock in an open transaction: such a wait is
// expected (PostgreSQL keeps the row consistent) and ends either when the
// paused worker resumes or with an error, which the worker counts as a
// failed operation.
func connectPG(ctx context.Context, cfg workerConfig) (*pgx.Conn, error) {
	pc, err := pgx.ParseConfig(cfg.DSN)
	if err != nil {
		return nil, err
	}
	pc.RuntimeParams["application_name"] = "e2e-" + cfg.Name
	pc.RuntimeParams["lock_timeout"] = "5s"
	pc.RuntimeParams["statement_timeout"] = "15s"
	if cfg.SimpleProtocol {
		pc.DefaultQueryExecMode = pgx.QueryExecModeSimpleProtocol
	}
	return pgx.ConnectConfig(ctx, pc)
}

func setToken(ctx context.Context, conn *pgx.Conn, token int64) error {
	_, err := conn.Exec(ctx, "SELECT pg_catalog.set_config('fence.token', $1, false)", strconv.FormatInt(token, 10))
	return err
}

// sqlState is the shared test helper.
var sqlState = testutil.SQLState

// ---------------------------------------------------------------------------
// The scripted client: one command per stdin line, one reply per command,
// "ok ..." or "err <SQLSTATE or -> <message>". The timeline tests drive
// processes A and B with it, step by step.
//
//	lock KEY TTL          take the lock (no keep-alive), set fence.token;
//	                      ok TOKEN GRANTED-TTL
//	stamp TABLE ID        UPDATE TABLE SET payload = payload WHERE id = ID;
//	                      ok ROWS
//	read TABLE ID         ok PAYLOAD
//	write TABLE ID TEXT   UPDATE TABLE SET payload = TEXT WHERE id = ID;
//	                      ok ROWS
//	lease                 ok held | ok lost REASON
//	release               ok | err notheld MESSAGE

func runClient(cfg workerConfig) error {
	ctx := context.Background()
	cctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	conn, err := connectPG(cctx, cfg)
	cancel()
	if err != nil {
		return fmt.Errorf("connect: %w", err)
	}
	defer conn.Close(ctx)
	cli, err := newEtcdClient(cfg)
	if err != nil {
		return fmt.Errorf("etcd: %w", err)
	}
	defer cli.Close()

	c := &client{conn: conn, cli: cli, name: cfg.Name}
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
	name  string
	lease *lock.Lease
}

func (c *client) do(ctx context.Context, cmd string, args []string) []any {
	need := map[string]int{"lock": 2, "stamp": 2, "read": 2, "write": 3, "lease": 0, "release": 0}
	n, ok := need[cmd]
	if !ok || len(args) != n {
		return []any{"err", "-", fmt.Sprintf("bad command %q %q", cmd, args)}
	}
	switch cmd {
	case "lock":
		ttl, err := time.ParseDuration(args[1])
		if err != nil {
			return errReply(err)
		}
		l, err := lock.Acquire(ctx, c.cli, args[0], lock.Options{TTL: ttl, Holder: c.name})
		if err != nil {
			return errReply(err)
		}
		c.lease = l
		if err := setToken(ctx, c.conn, l.Token()); err != nil {
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
// reporting each operation on stdout:
//
//	lock OP KEY TOKEN TTL   the lock is held; OP is this operation's id
//	try OP NEW              the write and history row are in, COMMIT is next
//	ack OP                  COMMIT succeeded
//	fenced OP PHASE MSG     FP001: the stamp or the write was refused
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
		if w.conn == nil || w.conn.IsClosed() {
			w.closeConn()
			cctx, cancel := context.WithTimeout(ctx, 30*time.Second)
			w.conn, err = connectPG(cctx, cfg)
			cancel()
			if err != nil {
				fmt.Fprintf(os.Stderr, "connect: %v\n", err)
				w.conn = nil
				sleep(ctx, 200*time.Millisecond)
				continue
			}
		}
		key := 1 + w.rng.IntN(cfg.Keys)
		// Acquire waits for the holder to release or its lease to end;
		// "stop" cancels the wait, the timeout is only a safety net.
		actx, acancel := context.WithTimeout(ctx, 10*time.Second)
		lease, err := lock.Acquire(actx, cli, lockKey(cfg.KeyPrefix, key), lock.Options{TTL: cfg.TTL, Holder: cfg.Name})
		acancel()
		if err != nil {
			if ctx.Err() == nil && !errors.Is(err, context.DeadlineExceeded) {
				fmt.Fprintf(os.Stderr, "acquire: %v\n", err)
			}
			continue
		}
		op := fmt.Sprintf("%s-%d", cfg.Name, seq)
		seq++
		emit("lock", op, key, lease.Token(), lease.TTL())
		w.readModifyWrite(op, key, lease.Token())
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

func (w *tortureWorker) closeConn() {
	if w.conn != nil {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		_ = w.conn.Close(ctx)
		cancel()
		w.conn = nil
	}
}

// readModifyWrite is one operation under the lock with token, following the
// stamped protocol of docs/design.md. It does not take the stop context: once
// the lock is held, the operation runs to its end.
func (w *tortureWorker) readModifyWrite(op string, key int, token int64) {
	ctx, cancel := context.WithTimeout(context.Background(), opTimeout)
	defer cancel()
	conn := w.conn
	if err := setToken(ctx, conn, token); err != nil {
		w.notCommitted(op, "set-token", err)
		return
	}
	// The stamp: a fenced no-op write that registers the token on the row
	// before the read, so that no older holder can write after it.
	tag, err := conn.Exec(ctx, "UPDATE public.counters SET value = value WHERE id = $1", key)
	if err != nil {
		w.notCommitted(op, "stamp", err)
		return
	}
	if tag.RowsAffected() != 1 {
		emit("odd", op, fmt.Sprintf("stamp updated %d rows, want 1", tag.RowsAffected()))
		return
	}
	var old int64
	if err := conn.QueryRow(ctx, "SELECT value FROM public.counters WHERE id = $1", key).Scan(&old); err != nil {
		w.notCommitted(op, "read", err)
		return
	}
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
	tag, err = tx.Exec(ctx, "UPDATE public.counters SET value = $2 WHERE id = $1", key, newValue)
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
