// Package demo plays the stale-lock-holder timeline of docs/design.md against a
// throwaway PostgreSQL, an embedded etcd (or Redis, with Options.Redis)
// and a real fenceproxy, narrating each step, and then keeps the stack up
// for the user to try by hand.
package demo

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"

	"github.com/fenceproxy/fenceproxy/internal/config"
	"github.com/fenceproxy/fenceproxy/internal/dbsetup"
	"github.com/fenceproxy/fenceproxy/internal/etcdcluster"
	"github.com/fenceproxy/fenceproxy/internal/pgcluster"
	"github.com/fenceproxy/fenceproxy/internal/rediscluster"
	"github.com/fenceproxy/fenceproxy/internal/rules"
	"github.com/fenceproxy/fenceproxy/internal/service"
	"github.com/fenceproxy/fenceproxy/lock"
	"github.com/fenceproxy/fenceproxy/lock/etcdlock"
	"github.com/fenceproxy/fenceproxy/lock/redislock"
)

// Options configure Run.
type Options struct {
	// Out receives the narration.
	Out io.Writer
	// Listen is the proxy's address; if it is taken, a free port is used.
	// Default 127.0.0.1:6432.
	Listen string
	// LeaseTTL is the lock's lease. Default 2s.
	LeaseTTL time.Duration
	// Exit ends the demo after the narration instead of serving until ctx
	// is done.
	Exit bool
	// Logger receives the proxy's logs. Default: none.
	Logger *zap.Logger
	// Redis takes the locks from Redis instead of an embedded etcd:
	// RedisStart starts a throwaway redis-server (it must be installed,
	// see internal/rediscluster), a redis:// or rediss:// URL uses that
	// server. Default "": etcd.
	Redis string
}

// RedisStart is the Options.Redis that starts a throwaway redis-server.
const RedisStart = "start"

// Result reports what the narration observed; tests check it.
type Result struct {
	TokenA, TokenB int64
	// StaleErr is the error A's late write received; InsertErr the error
	// of its insert of a row B never touched.
	StaleErr, InsertErr *pgconn.PgError
	// Watermark is the lock's watermark at the end.
	Watermark int64
	// Payload and Fence are the row's final state.
	Payload string
	Fence   int64
	// ProxyAddr and EtcdEndpoint (or RedisURL) are where the stack
	// listened.
	ProxyAddr, EtcdEndpoint, RedisURL string
}

const lockKey = "demo/config/1"

// Run starts the stack, plays the timeline and, unless opts.Exit, serves
// until ctx is done. Everything it started is stopped before it returns.
func Run(ctx context.Context, opts Options) (*Result, error) {
	if opts.Out == nil {
		opts.Out = io.Discard
	}
	if opts.Listen == "" {
		opts.Listen = "127.0.0.1:6432"
	}
	if opts.LeaseTTL <= 0 {
		opts.LeaseTTL = 2 * time.Second
	}
	log := opts.Logger
	if log == nil {
		log = zap.NewNop()
	}
	n := &narrator{w: opts.Out}

	n.step("Starting a throwaway PostgreSQL cluster")
	pg, err := pgcluster.Start(ctx, pgcluster.Options{})
	if err != nil {
		return nil, err
	}
	defer pg.Stop()
	n.detail("PostgreSQL listening on %s (binaries from %s)", pg.Addr(), pg.BinDir())
	if err := pg.Exec(ctx, `
		CREATE TABLE public.config (
			id         int PRIMARY KEY,
			payload    text NOT NULL,
			last_fence bigint NOT NULL DEFAULT 0
		);
		INSERT INTO public.config (id, payload) VALUES (1, 'initial');`); err != nil {
		return nil, fmt.Errorf("demo: create table: %w", err)
	}
	n.detail("created public.config (id, payload, last_fence bigint NOT NULL DEFAULT 0) with row 1 = 'initial'")
	if err := setupDB(ctx, pg); err != nil {
		return nil, err
	}
	n.detail("ran fenceproxy setup: the fenceproxy schema with one watermark per lock name")

	res := &Result{}
	var ls lockService
	if opts.Redis == "" {
		ls, err = startEtcd(ctx, n, res)
	} else {
		ls, err = startRedis(ctx, n, opts.Redis, res)
	}
	if err != nil {
		return nil, err
	}
	defer ls.close()

	n.step("Starting fenceproxy in front of PostgreSQL, protecting public.config")
	cfg := config.Defaults()
	cfg.Listen = freeOr(opts.Listen)
	cfg.Admin.Listen = freeOr("127.0.0.1:6438")
	cfg.Upstream.Address = pg.Addr()
	cfg.Tables = []rules.Table{{Table: "public.config"}}
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	inst, err := service.Start(&cfg, "", log)
	if err != nil {
		return nil, err
	}
	defer func() { _ = inst.Shutdown() }()
	n.detail("fenceproxy on %s, metrics on http://%s/metrics", inst.Addr(), inst.AdminAddr())

	res.ProxyAddr = inst.Addr()
	dsn := "postgres://postgres@" + inst.Addr() + "/postgres?sslmode=disable"
	if err := play(ctx, n, ls, dsn, opts.LeaseTTL, res); err != nil {
		return res, err
	}

	host, port, _ := net.SplitHostPort(inst.Addr())
	fmt.Fprintf(opts.Out, `
Try it yourself. In one terminal:

  psql "host=%s port=%s user=postgres dbname=postgres"
  =# SET fence.lock = '%s';
  =# SET fence.token = '%d';
  =# SELECT * FROM config;                                   -- refused: %d is older than the lock's %d
  =# SET fence.token = '%d';
  =# SELECT * FROM config;                                   -- B's token: accepted
  =# UPDATE config SET payload = 'mine' WHERE id = 1;        -- accepted

Or take the real lock from %s: fenceproxy lock sets fence.lock and
fence.token for every libpq connection the command opens (PGOPTIONS):

  fenceproxy lock %s --ttl 10s %s -- \
    psql "host=%s port=%s user=postgres dbname=postgres" -v ON_ERROR_STOP=1 \
       -c "SELECT payload FROM config WHERE id = 1" \
       -c "UPDATE config SET payload = 'locked' WHERE id = 1"


`, host, port, lockKey, res.TokenA, res.TokenA, res.TokenB, res.TokenB, ls.name, ls.flag, lockKey, host, port)
	if opts.Exit {
		return res, nil
	}
	fmt.Fprintln(opts.Out, "The stack keeps running; press Ctrl-C to stop it and clean up.")
	<-ctx.Done()
	fmt.Fprintf(opts.Out, "\nStopping fenceproxy, %s and PostgreSQL.\n", ls.name)
	return res, nil
}

// play runs the timeline with lock fencing: A locks, names its lock,
// reads, pauses past its lease; B locks, names it, reads (which registers
// B's token for the lock) and writes; A wakes and writes its stale copy,
// then tries to insert a row B never touched. No stamp step anywhere.
func play(ctx context.Context, n *narrator, ls lockService, dsn string, ttl time.Duration, res *Result) error {
	connA, err := pgx.Connect(ctx, dsn+"&application_name=service-A")
	if err != nil {
		return fmt.Errorf("demo: connect A: %w", err)
	}
	defer connA.Close(context.Background())
	connB, err := pgx.Connect(ctx, dsn+"&application_name=service-B")
	if err != nil {
		return fmt.Errorf("demo: connect B: %w", err)
	}
	defer connB.Close(context.Background())

	n.step("A takes the lock %q (lease %v, no renewal)", lockKey, ttl)
	leaseA, err := ls.locker.Acquire(ctx, lockKey, lock.Options{TTL: ttl, Holder: "service-A"})
	if err != nil {
		return err
	}
	res.TokenA = leaseA.Token()
	n.detail("A's fencing token is %d (%s)", res.TokenA, ls.token)
	if err := nameLock(ctx, connA, res.TokenA); err != nil {
		return err
	}
	n.detail("A sets fence.lock = %q and fence.token = %d in its session", lockKey, res.TokenA)
	var payload string
	if err := connA.QueryRow(ctx, "SELECT payload FROM config WHERE id = 1").Scan(&payload); err != nil {
		return err
	}
	n.detail("A read payload = %q (the read registered token %d for the lock) and starts computing", payload, res.TokenA)

	n.step("A stops (a long GC pause) and its lease expires")
	select {
	case <-leaseA.Done():
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(ttl + 10*time.Second):
		return errors.New("demo: A's lease did not expire")
	}
	n.detail("%s deleted A's lock key; A does not know, it is still paused", ls.name)

	n.step("B takes the lock, reads and writes")
	leaseB, err := ls.locker.Acquire(ctx, lockKey, lock.Options{TTL: 30 * time.Second, KeepAlive: true, Holder: "service-B"})
	if err != nil {
		return err
	}
	defer leaseB.Release(context.Background())
	res.TokenB = leaseB.Token()
	n.detail("B's fencing token is %d (> %d)", res.TokenB, res.TokenA)
	if err := nameLock(ctx, connB, res.TokenB); err != nil {
		return err
	}
	if err := connB.QueryRow(ctx, "SELECT payload FROM config WHERE id = 1").Scan(&payload); err != nil {
		return err
	}
	n.detail("B read %q: that read registered token %d for the lock, so from now on A can do nothing", payload, res.TokenB)
	if _, err := connB.Exec(ctx, "UPDATE config SET payload = $1 WHERE id = 1", "written by B"); err != nil {
		return fmt.Errorf("demo: B writes: %w", err)
	}
	n.detail("B wrote payload = 'written by B'")

	n.step("A wakes up and writes its stale copy with token %d", res.TokenA)
	_, err = connA.Exec(ctx, "UPDATE config SET payload = $1 WHERE id = 1", "stale copy from A")
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) {
		return fmt.Errorf("demo: A's stale write was not refused (err = %v)", err)
	}
	res.StaleErr = pgErr
	n.detail("fenceproxy refused it: ERROR %s: %s", pgErr.Code, pgErr.Message)
	_, err = connA.Exec(ctx, "INSERT INTO config (id, payload) VALUES (2, 'new row from A')")
	if !errors.As(err, &pgErr) {
		return fmt.Errorf("demo: A's stale insert was not refused (err = %v)", err)
	}
	res.InsertErr = pgErr
	n.detail("and its insert of a row B never touched: ERROR %s (row fencing alone could not refuse that)", pgErr.Code)

	n.step("Checking the row")
	if err := connB.QueryRow(ctx, "SELECT payload, last_fence FROM config WHERE id = 1").Scan(&res.Payload, &res.Fence); err != nil {
		return err
	}
	if err := connB.QueryRow(ctx, "SELECT token FROM fenceproxy.locks WHERE name = $1", lockKey).Scan(&res.Watermark); err != nil {
		return err
	}
	var rows int
	if err := connB.QueryRow(ctx, "SELECT count(*) FROM config").Scan(&rows); err != nil {
		return err
	}
	n.detail("payload = %q, last_fence = %d, %d row(s), lock watermark %d: B's data is intact", res.Payload, res.Fence, rows, res.Watermark)
	if res.Payload != "written by B" || res.Fence != res.TokenB || rows != 1 || res.Watermark != res.TokenB {
		return fmt.Errorf("demo: unexpected final state (%q, %d, %d rows, watermark %d)", res.Payload, res.Fence, rows, res.Watermark)
	}
	return nil
}

// lockService is the lock service the demo takes its locks from, with
// what the narration says about it.
type lockService struct {
	locker lock.Locker
	name   string // "etcd" or "Redis"
	token  string // what the token is
	flag   string // fenceproxy lock's flag that reaches it
	close  func()
}

// startEtcd starts an embedded single-member etcd.
func startEtcd(ctx context.Context, n *narrator, res *Result) (lockService, error) {
	n.step("Starting an embedded etcd (the lock service)")
	etcd, err := etcdcluster.Start(ctx, etcdcluster.Options{Members: 1})
	if err != nil {
		return lockService{}, err
	}
	cli, err := etcd.Client()
	if err != nil {
		etcd.Close()
		return lockService{}, err
	}
	res.EtcdEndpoint = etcd.Endpoints()[0]
	n.detail("etcd at %s", res.EtcdEndpoint)
	return lockService{
		locker: etcdlock.New(cli),
		name:   "etcd",
		token:  "the etcd revision of its grant",
		flag:   "--etcd " + res.EtcdEndpoint,
		close: func() {
			cli.Close()
			etcd.Close()
		},
	}, nil
}

// startRedis starts a throwaway redis-server (how is RedisStart) or
// connects to the one at the URL how.
func startRedis(ctx context.Context, n *narrator, how string, res *Result) (lockService, error) {
	var stop func()
	url := how
	if how == RedisStart {
		n.step("Starting a throwaway redis-server (the lock service), append-only file with appendfsync always")
		srv, err := rediscluster.Start(ctx, rediscluster.Options{AppendFsync: "always", Args: []string{"maxmemory-policy", "noeviction"}})
		if err != nil {
			return lockService{}, fmt.Errorf("demo: --redis: %w", err)
		}
		stop = func() { _ = srv.Stop() }
		url = srv.URL()
	} else {
		n.step("Using the Redis at the given URL (the lock service)")
	}
	opt, err := redis.ParseURL(url)
	if err != nil {
		if stop != nil {
			stop()
		}
		return lockService{}, fmt.Errorf("demo: --redis: %w", err)
	}
	cli := redis.NewClient(opt)
	if err := cli.Ping(ctx).Err(); err != nil {
		cli.Close()
		if stop != nil {
			stop()
		}
		return lockService{}, fmt.Errorf("demo: redis at %s: %w", opt.Addr, err)
	}
	res.RedisURL = "redis://" + opt.Addr + "/" + strconv.Itoa(opt.DB)
	n.detail("Redis at %s", opt.Addr)
	return lockService{
		locker: redislock.New(cli, redislock.Options{}),
		name:   "Redis",
		token:  "drawn from the lock's counter in the script that took the lock",
		// The URL without a password: set FENCEPROXY_REDIS_PASSWORD.
		flag: "--redis " + res.RedisURL,
		close: func() {
			cli.Close()
			if stop != nil {
				stop()
			}
		},
	}, nil
}

// nameLock sets the session's lock name and token (as pgxlock.Configure
// or fenceproxy lock would at connection time).
func nameLock(ctx context.Context, c *pgx.Conn, token int64) error {
	_, err := c.Exec(ctx, "SELECT set_config('fence.lock', $1, false), set_config('fence.token', $2, false)", lockKey, strconv.FormatInt(token, 10))
	return err
}

// setupDB installs fenceproxy's objects in the demo database, as
// fenceproxy setup does.
func setupDB(ctx context.Context, pg *pgcluster.Cluster) error {
	conn, err := pgx.Connect(ctx, pg.SuperuserDSN("postgres"))
	if err != nil {
		return err
	}
	defer conn.Close(ctx)
	if _, err := dbsetup.Setup(ctx, conn, nil, dbsetup.SetupOptions{}); err != nil {
		return fmt.Errorf("demo: setup: %w", err)
	}
	return nil
}

// freeOr returns addr if it can be bound now, else a free port on its host.
func freeOr(addr string) string {
	l, err := net.Listen("tcp", addr)
	if err == nil {
		_ = l.Close()
		return addr
	}
	host, _, _ := net.SplitHostPort(addr)
	return net.JoinHostPort(host, "0")
}

type narrator struct {
	w     io.Writer
	n     int
	start time.Time
}

func (n *narrator) step(format string, args ...any) {
	if n.start.IsZero() {
		n.start = time.Now()
	}
	n.n++
	fmt.Fprintf(n.w, "\n[%5.1fs] %d. %s\n", time.Since(n.start).Seconds(), n.n, fmt.Sprintf(format, args...))
}

func (n *narrator) detail(format string, args ...any) {
	fmt.Fprintf(n.w, "         %s\n", fmt.Sprintf(format, args...))
}
