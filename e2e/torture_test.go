package e2e_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

// Torture parameters. The lease is short and never renewed; the pauses are
// longer than the granted lease, so a paused holder always comes back
// stale, and most pauses hit a worker that holds a lock, so that stale
// writers reliably appear (the test asserts that some were fenced).
const (
	tortureTTL = 2 * time.Second // what etcd grants at least anyway
	// Think time between the read and the write: the window in which a
	// pause makes a holder stale.
	tortureMinThink = 50 * time.Millisecond
	tortureMaxThink = 400 * time.Millisecond
	// A pause is started every pauseEvery..2*pauseEvery, on a lock holder
	// with probability pauseHolderOdds, while fewer than workers/4 are
	// paused, and lasts the granted TTL + 1s..2s.
	pauseEvery      = 400 * time.Millisecond
	pauseHolderOdds = 0.8
	// One operation in five thinks again, briefly, inside its transaction
	// before COMMIT.
	tortureTxThinkOdds = 0.2
	// Every terminateEvery..2*terminateEvery the terminator ends one
	// worker's server session that is idle in a transaction (thinking, or
	// paused, before COMMIT), so some COMMITs fail with an unknown outcome
	// and workers reconnect through the proxy.
	terminateEvery = 2 * time.Second
)

// TestTorture runs the stamped read-modify-write protocol of docs/design.md in
// many worker processes against a few counter rows through fenceproxy,
// pausing random workers past their leases, and checks the outcome with
// check (see checker_test.go): no acknowledged write lost, no stale write
// accepted, no lost update, final state equal to the committed history.
func TestTorture(t *testing.T) {
	st := getStack(t)
	res := torture(t, st, st.proxyDSN(), true)
	if len(res.Anomalies) > 0 {
		t.Errorf("%d anomalies:\n%s", len(res.Anomalies), res.details(50))
	}
	if res.Fenced == 0 {
		t.Errorf("no operation was fenced: the pauses produced no stale writer, so the run proved nothing")
	}
	if res.Acked == 0 {
		t.Errorf("no operation was acknowledged")
	}
}

// TestTortureUnfencedControl runs the same workload straight to PostgreSQL,
// without fenceproxy, to show that the checker sees what fencing prevents.
// It is a demonstration, run only with FENCEPROXY_E2E_CONTROL=1, and
// asserts nothing: how many anomalies appear depends on timing.
func TestTortureUnfencedControl(t *testing.T) {
	if os.Getenv("FENCEPROXY_E2E_CONTROL") == "" {
		t.Skip("set FENCEPROXY_E2E_CONTROL=1 to run the unfenced control")
	}
	st := getStack(t)
	res := torture(t, st, st.directDSN(), false)
	t.Logf("without fencing the checker found %d anomalies:\n%s", len(res.Anomalies), res.details(20))
}

// tortureParams reads the run's size from the environment.
func tortureParams(t *testing.T) (duration time.Duration, workers, keys int) {
	t.Helper()
	duration = 40 * time.Second
	if testing.Short() {
		duration = 10 * time.Second
	}
	if s := os.Getenv("FENCEPROXY_TORTURE_DURATION"); s != "" {
		d, err := time.ParseDuration(s)
		if err != nil || d <= 0 {
			t.Fatalf("FENCEPROXY_TORTURE_DURATION=%q: want a positive Go duration like 40s or 10m", s)
		}
		duration = d
	}
	workers, keys = 8, 3
	for _, v := range []struct {
		env string
		n   *int
		min int
	}{{"FENCEPROXY_TORTURE_WORKERS", &workers, 2}, {"FENCEPROXY_TORTURE_KEYS", &keys, 1}} {
		if s := os.Getenv(v.env); s != "" {
			n, err := strconv.Atoi(s)
			if err != nil || n < v.min {
				t.Fatalf("%s=%q: want an integer >= %d", v.env, s, v.min)
			}
			*v.n = n
		}
	}
	return duration, workers, keys
}

const tortureSchema = `
DROP TABLE IF EXISTS public.counters, public.history, public.counter_log;
CREATE TABLE public.counters (
	id         int PRIMARY KEY,
	value      bigint NOT NULL,
	last_fence bigint NOT NULL DEFAULT 0
);
CREATE TABLE public.history (
	op_id      text PRIMARY KEY,
	key        int NOT NULL,
	token      bigint NOT NULL,
	new_value  bigint NOT NULL,
	last_fence bigint NOT NULL DEFAULT 0
);
-- counter_log is test instrumentation, written by a trigger and never
-- through the proxy: the database's own record of every committed update
-- of a counter row, stamps included. Concurrent updates of one row wait
-- for each other's row lock, so per row seq follows commit order.
CREATE TABLE public.counter_log (
	seq       bigserial PRIMARY KEY,
	key       int NOT NULL,
	old_value bigint NOT NULL,
	new_value bigint NOT NULL,
	old_fence bigint NOT NULL,
	new_fence bigint NOT NULL
);
CREATE OR REPLACE FUNCTION public.e2e_log_counter() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
	INSERT INTO public.counter_log (key, old_value, new_value, old_fence, new_fence)
	VALUES (NEW.id, OLD.value, NEW.value, OLD.last_fence, NEW.last_fence);
	RETURN NULL;
END $$;
CREATE TRIGGER counters_log AFTER UPDATE ON public.counters
	FOR EACH ROW EXECUTE FUNCTION public.e2e_log_counter();
`

// tortureRun is the parent's view of a running torture: the operations as
// reported, which workers hold a lock, which are paused.
type tortureRun struct {
	mu      sync.Mutex
	ops     map[string]*opRecord
	holding []bool
	paused  []bool
	ttl     time.Duration // largest TTL granted so far
	pauses  int
	onHold  int // pauses that hit a lock holder
	bad     []string
}

func torture(t *testing.T, st *stack, dsn string, fenced bool) *checkReport {
	duration, nWorkers, nKeys := tortureParams(t)
	st.exec(t, tortureSchema)
	var values []string
	for k := 1; k <= nKeys; k++ {
		values = append(values, fmt.Sprintf("(%d, 0)", k))
	}
	st.exec(t, "INSERT INTO public.counters (id, value) VALUES "+strings.Join(values, ", "))

	seed := uint64(time.Now().UnixNano())
	t.Logf("torture: %d workers, %d keys, %v, lease TTL %v without keep-alive, seed %d, through %s",
		nWorkers, nKeys, duration, tortureTTL, seed, map[bool]string{true: "fenceproxy", false: "PostgreSQL directly (unfenced)"}[fenced])
	run := &tortureRun{
		ops:     make(map[string]*opRecord),
		holding: make([]bool, nWorkers),
		paused:  make([]bool, nWorkers),
		ttl:     tortureTTL,
	}
	keyPrefix := fmt.Sprintf("e2e/torture/%d/", runSeq.Add(1))
	procs := make([]*proc, nWorkers)
	var readers sync.WaitGroup
	for i := range procs {
		procs[i] = startProc(t, roleTorture, workerConfig{
			Name:        fmt.Sprintf("w%d", i),
			DSN:         dsn,
			Etcd:        st.etcdEndpoints(),
			KeyPrefix:   keyPrefix,
			Keys:        nKeys,
			TTL:         tortureTTL,
			MinThink:    tortureMinThink,
			MaxThink:    tortureMaxThink,
			TxThinkOdds: tortureTxThinkOdds,
			// Half the workers use the simple query protocol, half pgx's
			// default extended protocol with cached prepared statements.
			SimpleProtocol: i%2 == 1,
			Seed:           seed + uint64(i),
		})
		readers.Go(func() {
			for line := range procs[i].lines {
				run.handle(i, line)
			}
		})
	}

	stopTerminator := make(chan struct{})
	var terminated int
	var terminator sync.WaitGroup
	terminator.Go(func() { terminated = terminateIdleInTx(t, st, stopTerminator, rand.New(rand.NewPCG(seed, 1))) })
	run.injectPauses(t, procs, duration, rand.New(rand.NewPCG(seed, 0)))
	close(stopTerminator)
	terminator.Wait()

	for _, p := range procs {
		// Errors here mean the worker has exited; wait reports why.
		_ = p.signal(syscall.SIGCONT)
		_, _ = fmt.Fprintln(p.stdin, "stop")
	}
	for _, p := range procs {
		// A worker finishes the operation it is in; that can wait out a
		// lock_timeout behind a row lock, so the grace is generous.
		if err := p.wait(60 * time.Second); err != nil {
			t.Errorf("worker %s: %v; stderr:\n%s", p.name, err, p.stderr.String())
		}
	}
	readers.Wait()

	in := checkInput{Ops: run.ops, Fenced: fenced}
	for _, op := range run.ops {
		if op.Outcome == pending {
			// The worker ended inside the operation (it was killed):
			// after "try" the commit may have happened.
			if op.Tried {
				op.Outcome, op.Detail = unknown, "worker ended during COMMIT"
			} else {
				op.Outcome, op.Detail = failed, "worker ended before COMMIT"
			}
		}
	}
	readResults(t, st, &in)
	res := check(in)
	for _, b := range run.bad {
		res.anomaly("%s", b)
	}

	t.Logf("pauses: %d (%d of a lock holder), each %v + 1..2s; server sessions terminated in a transaction: %d",
		run.pauses, run.onHold, run.ttl, terminated)
	t.Logf("operations: attempted %d, acknowledged %d, fenced %d, failed %d, unknown %d (%d of them committed)",
		res.Attempted, res.Acked, res.Fenced, res.Failed, res.Unknown, res.UnknownCommitted)
	for _, k := range res.Keys {
		t.Logf("key %d: final value %d; %d acknowledged + %d unknown-but-committed increments; %d accepted stamps; last_fence %d",
			k.Key, k.Final, k.Acked, k.UnknownCommitted, k.Stamps, k.LastToken)
	}
	t.Logf("torture: ops=%d acked=%d fenced=%d unknown=%d anomalies=%d",
		res.Attempted, res.Acked, res.Fenced, res.Unknown, len(res.Anomalies))
	return res
}

// handle records one report line of worker i.
func (r *tortureRun) handle(i int, line string) {
	f := strings.SplitN(line, " ", 4)
	r.mu.Lock()
	defer r.mu.Unlock()
	bad := func(why string) { r.bad = append(r.bad, fmt.Sprintf("worker w%d: %s: %q", i, why, line)) }
	if len(f) < 2 {
		bad("short line")
		return
	}
	kind, id := f[0], f[1]
	if kind == "lock" {
		g := strings.Fields(line)
		if len(g) != 5 {
			bad("bad lock line")
			return
		}
		key, err1 := strconv.Atoi(g[2])
		token, err2 := strconv.ParseInt(g[3], 10, 64)
		ttl, err3 := time.ParseDuration(g[4])
		if err1 != nil || err2 != nil || err3 != nil {
			bad("bad lock line")
			return
		}
		if _, dup := r.ops[id]; dup {
			bad("duplicate op id")
			return
		}
		r.ops[id] = &opRecord{ID: id, Key: key, Token: token}
		r.holding[i] = true
		r.ttl = max(r.ttl, ttl)
		return
	}
	op, ok := r.ops[id]
	if !ok {
		bad("unknown op")
		return
	}
	detail := strings.Join(f[2:], " ")
	settle := func(o outcome) {
		if op.Outcome != pending {
			bad("second outcome")
			return
		}
		op.Outcome, op.Detail = o, detail
	}
	switch kind {
	case "try":
		v, err := strconv.ParseInt(detail, 10, 64)
		if err != nil {
			bad("bad try line")
			return
		}
		op.Tried, op.NewValue = true, v
	case "ack":
		settle(acked)
	case "fenced":
		settle(fenced)
	case "failed":
		settle(failed)
	case "unknown":
		settle(unknown)
	case "odd":
		settle(abnormal)
	case "unlock":
		r.holding[i] = false
		if op.Outcome == pending {
			bad("unlock before an outcome")
		}
	default:
		bad("unknown line")
	}
}

// injectPauses stops random workers (mostly lock holders) with SIGSTOP for
// longer than their lease and resumes them with SIGCONT, until duration has
// passed. It returns with every worker resumed.
func (r *tortureRun) injectPauses(t *testing.T, procs []*proc, duration time.Duration, rng *rand.Rand) {
	maxPaused := max(1, len(procs)/4)
	var resumes sync.WaitGroup
	end := time.Now().Add(duration)
	for time.Now().Before(end) {
		time.Sleep(pauseEvery + time.Duration(rng.Int64N(int64(pauseEvery))))

		r.mu.Lock()
		var holders, others []int
		npaused := 0
		for i := range procs {
			switch {
			case r.paused[i]:
				npaused++
			case r.holding[i]:
				holders = append(holders, i)
			default:
				others = append(others, i)
			}
		}
		if npaused >= maxPaused || len(holders)+len(others) == 0 {
			r.mu.Unlock()
			continue
		}
		pool := others
		if len(holders) > 0 && (len(others) == 0 || rng.Float64() < pauseHolderOdds) {
			pool = holders
		}
		i := pool[rng.IntN(len(pool))]
		r.paused[i] = true
		r.pauses++
		if r.holding[i] {
			r.onHold++
		}
		d := r.ttl + time.Second + time.Duration(rng.Int64N(int64(time.Second)))
		r.mu.Unlock()

		if err := procs[i].signal(syscall.SIGSTOP); err != nil {
			t.Errorf("worker %s: SIGSTOP: %v", procs[i].name, err)
		}
		resumes.Go(func() {
			time.Sleep(d)
			if err := procs[i].signal(syscall.SIGCONT); err != nil {
				t.Errorf("worker %s: SIGCONT: %v", procs[i].name, err)
			}
			r.mu.Lock()
			r.paused[i] = false
			r.mu.Unlock()
		})
	}
	resumes.Wait()
}

// terminateIdleInTx ends, now and then, the server session of one worker
// that is idle in a transaction, until stop is closed. It returns how many
// it ended.
func terminateIdleInTx(t *testing.T, st *stack, stop <-chan struct{}, rng *rand.Rand) int {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() {
		<-stop
		cancel()
	}()
	conn, err := pgx.Connect(ctx, st.directDSN())
	if err != nil {
		t.Errorf("terminator: connect: %v", err)
		return 0
	}
	defer conn.Close(context.Background())
	n := 0
	wait := terminateEvery + time.Duration(rng.Int64N(int64(terminateEvery)))
	for {
		sleep(ctx, wait)
		if ctx.Err() != nil {
			return n
		}
		var ended int
		err := conn.QueryRow(ctx, `
			SELECT count(*) FROM (
				SELECT pg_catalog.pg_terminate_backend(pid)
				FROM pg_catalog.pg_stat_activity
				WHERE application_name LIKE 'e2e-w%' AND state = 'idle in transaction'
				ORDER BY random() LIMIT 1
			) AS ended`).Scan(&ended)
		if err != nil {
			if ctx.Err() == nil {
				t.Errorf("terminator: %v", err)
			}
			return n
		}
		n += ended
		// Look again soon if no session was idle in a transaction.
		wait = 100 * time.Millisecond
		if ended > 0 {
			wait = terminateEvery + time.Duration(rng.Int64N(int64(terminateEvery)))
		}
	}
}

// readResults reads history, counter_log and counters straight from
// PostgreSQL into in.
func readResults(t *testing.T, st *stack, in *checkInput) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	conn := st.direct(t)
	var err error
	in.History, err = collect(ctx, conn, "SELECT op_id, key, token, new_value, last_fence FROM public.history",
		func(r pgx.CollectableRow) (h historyRow, err error) {
			return h, r.Scan(&h.OpID, &h.Key, &h.Token, &h.NewValue, &h.Fence)
		})
	if err != nil {
		t.Fatalf("read history: %v", err)
	}
	in.Log, err = collect(ctx, conn, "SELECT seq, key, old_value, new_value, old_fence, new_fence FROM public.counter_log ORDER BY seq",
		func(r pgx.CollectableRow) (l logRow, err error) {
			return l, r.Scan(&l.Seq, &l.Key, &l.OldValue, &l.NewValue, &l.OldFence, &l.NewFence)
		})
	if err != nil {
		t.Fatalf("read counter_log: %v", err)
	}
	in.Counters, err = collect(ctx, conn, "SELECT id, value, last_fence FROM public.counters ORDER BY id",
		func(r pgx.CollectableRow) (c counterRow, err error) {
			return c, r.Scan(&c.Key, &c.Value, &c.Fence)
		})
	if err != nil {
		t.Fatalf("read counters: %v", err)
	}
}

func collect[T any](ctx context.Context, conn *pgx.Conn, sql string, scan pgx.RowToFunc[T]) ([]T, error) {
	rows, err := conn.Query(ctx, sql)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, scan)
}
