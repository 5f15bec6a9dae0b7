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
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/redis/go-redis/v9"

	"github.com/fenceproxy/fenceproxy/lock"
	"github.com/fenceproxy/fenceproxy/lock/pgxlock"
	"github.com/fenceproxy/fenceproxy/lock/redislock"
)

// The Redis side of the workers (worker_test.go): a worker whose
// workerConfig.Etcd is one redis:// URL takes its locks with redislock.New
// instead of etcd, and otherwise speaks the same protocol, so the timeline
// and the torture drive it, and the checker reads its reports, unchanged.
// init runs it before TestMain's dispatch, which knows only etcd workers.

func init() {
	role := os.Getenv(roleEnv)
	if role != roleClient && role != roleTorture {
		return
	}
	var cfg workerConfig
	if err := json.Unmarshal([]byte(os.Getenv(configEnv)), &cfg); err != nil {
		return // runWorker reports it
	}
	url := redisWorkerURL(cfg)
	if url == "" {
		return
	}
	opt, err := redis.ParseURL(url)
	if err != nil {
		fmt.Fprintf(os.Stderr, "worker %s: redis URL: %v\n", cfg.Name, err)
		os.Exit(2)
	}
	rdb := redis.NewClient(opt)
	locker := redislock.New(rdb, redislock.Options{Poll: 200 * time.Millisecond})
	if role == roleClient {
		err = runRedisClient(cfg, locker)
	} else {
		err = runRedisTortureWorker(cfg, locker)
	}
	rdb.Close()
	if err != nil {
		fmt.Fprintf(os.Stderr, "worker %s: %v\n", cfg.Name, err)
		os.Exit(1)
	}
	os.Exit(0)
}

// redisWorkerURL returns the Redis URL a worker is to take its locks
// from, or "" for an etcd worker.
func redisWorkerURL(cfg workerConfig) string {
	if len(cfg.Etcd) == 1 && (strings.HasPrefix(cfg.Etcd[0], "redis://") || strings.HasPrefix(cfg.Etcd[0], "rediss://")) {
		return cfg.Etcd[0]
	}
	return ""
}

// connectGrant is connectPG with g's lock name and token as startup
// parameters.
func connectGrant(ctx context.Context, cfg workerConfig, dsn string, g lock.Grant) (*pgx.Conn, error) {
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
	pgxlock.Configure(pc, g.Fence(lock.Settings{}))
	return pgx.ConnectConfig(ctx, pc)
}

// setGrant is setLock for any grant.
func setGrant(ctx context.Context, conn *pgx.Conn, g lock.Grant) error {
	_, err := conn.Exec(ctx, "SELECT pg_catalog.set_config('fence.lock', $1, false), pg_catalog.set_config('fence.token', $2, false)",
		g.Key(), strconv.FormatInt(g.Token(), 10))
	return err
}

// runRedisClient is runClient with Redis locks; it knows the commands the
// timeline uses: lock (HOW token or set), stamp, read, write, release.
func runRedisClient(cfg workerConfig, locker lock.Locker) error {
	ctx := context.Background()
	cctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	conn, err := connectPG(cctx, cfg, cfg.DSN, nil)
	cancel()
	if err != nil {
		return fmt.Errorf("connect: %w", err)
	}
	defer conn.Close(ctx)
	var grant lock.Grant
	sc := bufio.NewScanner(os.Stdin)
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) == 0 {
			continue
		}
		cctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		reply := redisClientDo(cctx, conn, locker, cfg, &grant, f[0], f[1:])
		cancel()
		emit(reply...)
	}
	if grant != nil {
		_ = grant.Release(ctx)
	}
	return sc.Err()
}

func redisClientDo(ctx context.Context, conn *pgx.Conn, locker lock.Locker, cfg workerConfig, grant *lock.Grant, cmd string, args []string) []any {
	switch {
	case cmd == "lock" && (len(args) == 2 || len(args) == 3):
		ttl, err := time.ParseDuration(args[1])
		if err != nil {
			return errReply(err)
		}
		g, err := locker.Acquire(ctx, args[0], lock.Options{TTL: ttl, Holder: cfg.Name})
		if err != nil {
			return errReply(err)
		}
		*grant = g
		if len(args) == 3 && args[2] == "set" {
			err = setGrant(ctx, conn, g)
		} else {
			err = setToken(ctx, conn, g.Token())
		}
		if err != nil {
			return errReply(err)
		}
		return []any{"ok", g.Token(), ttl}
	case cmd == "stamp" && len(args) == 2:
		tag, err := conn.Exec(ctx, "UPDATE "+ident(args[0])+" SET payload = payload WHERE id = $1", args[1])
		if err != nil {
			return errReply(err)
		}
		return []any{"ok", tag.RowsAffected()}
	case cmd == "read" && len(args) == 2:
		var payload string
		if err := conn.QueryRow(ctx, "SELECT payload FROM "+ident(args[0])+" WHERE id = $1", args[1]).Scan(&payload); err != nil {
			return errReply(err)
		}
		return []any{"ok", payload}
	case cmd == "write" && len(args) == 3:
		tag, err := conn.Exec(ctx, "UPDATE "+ident(args[0])+" SET payload = $2 WHERE id = $1", args[1], args[2])
		if err != nil {
			return errReply(err)
		}
		return []any{"ok", tag.RowsAffected()}
	case cmd == "release" && len(args) == 0 && *grant != nil:
		err := (*grant).Release(ctx)
		*grant = nil
		if errors.Is(err, lock.ErrNotHeld) {
			return []any{"err", "notheld", err}
		}
		if err != nil {
			return errReply(err)
		}
		return []any{"ok"}
	}
	return []any{"err", "-", fmt.Sprintf("bad command %q %q", cmd, args)}
}

// runRedisTortureWorker is runTortureWorker with Redis locks.
func runRedisTortureWorker(cfg workerConfig, locker lock.Locker) error {
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
	w := &redisTortureWorker{tortureWorker: tortureWorker{cfg: cfg, rng: rand.New(rand.NewPCG(cfg.Seed, 0))}, locker: locker}
	defer w.closeConn()

	var err error
	for seq := 1; ctx.Err() == nil; {
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
		g, err := w.acquire(ctx, key)
		if err != nil {
			if ctx.Err() == nil && !errors.Is(err, context.DeadlineExceeded) && !errors.Is(err, lock.ErrLocked) {
				fmt.Fprintf(os.Stderr, "acquire: %v\n", err)
			}
			// Not at once: the next key's lock may be taken too, or
			// Redis is restarting.
			sleep(ctx, time.Duration(w.rng.Int64N(int64(5*time.Millisecond))))
			continue
		}
		op := fmt.Sprintf("%s-%d", cfg.Name, seq)
		seq++
		emit("lock", op, key, g.Token(), cfg.TTL)
		w.readModifyWrite(op, key, g)
		rctx, rcancel := context.WithTimeout(context.Background(), 10*time.Second)
		_ = g.Release(rctx) // ErrNotHeld for a holder paused past its TTL, or after a restart that lost the key
		rcancel()
		emit("unlock", op)
		sleep(ctx, time.Duration(w.rng.Int64N(int64(20*time.Millisecond))))
	}
	return nil
}

type redisTortureWorker struct {
	tortureWorker
	locker lock.Locker
}

// acquire is tortureWorker.acquire against Redis.
func (w *redisTortureWorker) acquire(ctx context.Context, key int) (lock.Grant, error) {
	actx, acancel := context.WithTimeout(ctx, 10*time.Second)
	defer acancel()
	name, opts := lockKey(w.cfg.KeyPrefix, key), lock.Options{TTL: w.cfg.TTL, Holder: w.cfg.Name}
	if w.cfg.SkipBusyOdds > 0 {
		g, err := w.locker.TryAcquire(actx, name, opts)
		if !errors.Is(err, lock.ErrLocked) || w.rng.Float64() < w.cfg.SkipBusyOdds {
			return g, err
		}
	}
	return w.locker.Acquire(actx, name, opts)
}

// readModifyWrite is tortureWorker.readModifyWrite's lock-fenced protocol
// (NameLock) under any grant; the Redis runs use no stamp.
func (w *redisTortureWorker) readModifyWrite(op string, key int, g lock.Grant) {
	ctx, cancel := context.WithTimeout(context.Background(), opTimeout)
	defer cancel()
	conn := w.conn
	if w.cfg.LockViaStartup {
		cctx, ccancel := context.WithTimeout(ctx, 10*time.Second)
		c, err := connectGrant(cctx, w.cfg, w.pickDSN(), g)
		ccancel()
		if err != nil {
			w.notCommitted(op, "connect", err)
			return
		}
		w.conn, conn = c, c
		defer w.closeConn()
	} else if err := setGrant(ctx, conn, g); err != nil {
		w.notCommitted(op, "set-lock", err)
		return
	}
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
	if _, err := tx.Exec(ctx, "INSERT INTO public.history (op_id, key, token, new_value) VALUES ($1, $2, $3, $4)",
		op, key, g.Token(), newValue); err != nil {
		w.notCommitted(op, "history", err)
		return
	}
	if w.rng.Float64() < w.cfg.TxThinkOdds {
		time.Sleep(w.think() / 4)
	}
	emit("try", op, newValue)
	if err := tx.Commit(ctx); err != nil {
		emit("unknown", op, err)
		return
	}
	emit("ack", op)
}
