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
	res := torture(t, st, tortureSpec{
		dsns:     []string{st.proxyDSN()},
		via:      "fenceproxy",
		etcd:     st.etcdEndpoints(),
		size:     tortureParams(t, stampedSize()),
		minThink: tortureMinThink,
		maxThink: tortureMaxThink,
		fenced:   true,
	})
	res.wantFenced(t, "writer")
}

// wantFenced fails t unless the run found no anomaly, fenced at least one
// operation (stale names what the pauses must have produced) and
// acknowledged at least one.
func (res *tortureResult) wantFenced(t *testing.T, stale string) {
	t.Helper()
	if len(res.Anomalies) > 0 {
		t.Errorf("%d anomalies:\n%s", len(res.Anomalies), res.details(50))
	}
	if res.Fenced == 0 {
		t.Errorf("no operation was fenced: the pauses produced no stale %s, so the run proved nothing", stale)
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
	res := torture(t, st, tortureSpec{
		dsns:     []string{st.directDSN()},
		via:      "PostgreSQL directly (unfenced)",
		etcd:     st.etcdEndpoints(),
		size:     tortureParams(t, stampedSize()),
		minThink: tortureMinThink,
		maxThink: tortureMaxThink,
	})
	t.Logf("without fencing the checker found %d anomalies:\n%s", len(res.Anomalies), res.details(20))
}

// tortureSize is how long a torture runs, with how many workers on how
// many counter rows.
type tortureSize struct {
	duration      time.Duration
	workers, keys int
}

// stampedSize is the default size of TestTorture and its control: 40s
// (10s under -short), 8 workers, 3 keys.
func stampedSize() tortureSize {
	size := tortureSize{duration: 40 * time.Second, workers: 8, keys: 3}
	if testing.Short() {
		size.duration = 10 * time.Second
	}
	return size
}

// tortureParams returns size with what the environment overrides.
func tortureParams(t *testing.T, size tortureSize) tortureSize {
	t.Helper()
	if s := os.Getenv("FENCEPROXY_TORTURE_DURATION"); s != "" {
		d, err := time.ParseDuration(s)
		if err != nil || d <= 0 {
			t.Fatalf("FENCEPROXY_TORTURE_DURATION=%q: want a positive Go duration like 40s or 10m", s)
		}
		size.duration = d
	}
	for _, v := range []struct {
		env string
		n   *int
		min int
	}{{"FENCEPROXY_TORTURE_WORKERS", &size.workers, 2}, {"FENCEPROXY_TORTURE_KEYS", &size.keys, 1}} {
		if s := os.Getenv(v.env); s != "" {
			n, err := strconv.Atoi(s)
			if err != nil || n < v.min {
				t.Fatalf("%s=%q: want an integer >= %d", v.env, s, v.min)
			}
			*v.n = n
		}
	}
	return size
}

// tortureSpec describes one torture run.
type tortureSpec struct {
	dsns []string // workers connect to one of these, picked per connection
	via  string   // what dsns lead to, for the log
	etcd []string // every member's client URL
	size tortureSize
	// Think time between the read and the write.
	minThink, maxThink time.Duration
	// skipBusyOdds: see workerConfig.SkipBusyOdds.
	skipBusyOdds float64
	// fenced: counters and history are row-fenced by the proxy, so their
	// last_fence columns carry the writers' tokens.
	fenced bool
	// nameLock: workers follow the lock-fencing protocol (fence.lock set,
	// no stamp); see workerConfig.NameLock.
	nameLock bool
	// historyUnfenced: history has no fence column in the proxy's rules
	// (lock fencing alone protects it), so its last_fence stays 0.
	historyUnfenced bool
	// watermarks: read the lock watermarks from fenceproxy.locks and check
	// them against the committed tokens.
	watermarks bool
	// midRun, if set, is called once halfway through the run, while the
	// workers run and pauses go on; what it returns is logged.
	midRun func() string
	// resumeOnRead: a paused lock holder is resumed as soon as a newer
	// holder of the same lock reports its read, rather than only at the
	// end of its pause, so that its write races the newer holder's think
	// time: the gap between a read and its write that a stale write must
	// not land in.
	resumeOnRead bool
}

// tortureResult is the checker's report and what the run itself saw.
type tortureResult struct {
	*checkReport
	// ackedAfterMid counts operations acknowledged after midRun returned.
	ackedAfterMid int
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
	mu            sync.Mutex
	procs         []*proc
	ops           map[string]*opRecord
	holding       []bool
	current       []*opRecord // each worker's operation between lock and unlock
	paused        []bool
	pauseGen      []int         // counts each worker's pauses, so that a timed resume resumes its own pause only
	ttl           time.Duration // largest TTL granted so far
	pauses        int
	onHold        int // pauses that hit a lock holder
	resumeOnRead  bool
	earlyResumes  int // pauses ended by a newer holder's read
	bad           []string
	midDone       bool // spec.midRun has returned
	ackedAfterMid int
}

func torture(t *testing.T, st *stack, spec tortureSpec) *tortureResult {
	duration, nWorkers, nKeys := spec.size.duration, spec.size.workers, spec.size.keys
	st.exec(t, tortureSchema)
	var values []string
	for k := 1; k <= nKeys; k++ {
		values = append(values, fmt.Sprintf("(%d, 0)", k))
	}
	st.exec(t, "INSERT INTO public.counters (id, value) VALUES "+strings.Join(values, ", "))

	seed := uint64(time.Now().UnixNano())
	protocol := "stamp, read, write"
	if spec.nameLock {
		protocol = "fence.lock and fence.token, read, write (no stamp)"
	}
	t.Logf("torture: %d workers, %d keys, %v, lease TTL %v without keep-alive, think %v..%v, seed %d; %s; through %s",
		nWorkers, nKeys, duration, tortureTTL, spec.minThink, spec.maxThink, seed, protocol, spec.via)
	run := &tortureRun{
		ops:          make(map[string]*opRecord),
		holding:      make([]bool, nWorkers),
		current:      make([]*opRecord, nWorkers),
		paused:       make([]bool, nWorkers),
		pauseGen:     make([]int, nWorkers),
		ttl:          tortureTTL,
		resumeOnRead: spec.resumeOnRead,
	}
	keyPrefix := fmt.Sprintf("e2e/torture/%d/", runSeq.Add(1))
	procs := make([]*proc, nWorkers)
	run.procs = procs
	var readers sync.WaitGroup
	for i := range procs {
		procs[i] = startProc(t, roleTorture, workerConfig{
			Name:         fmt.Sprintf("w%d", i),
			DSNs:         spec.dsns,
			Etcd:         spec.etcd,
			KeyPrefix:    keyPrefix,
			Keys:         nKeys,
			TTL:          tortureTTL,
			MinThink:     spec.minThink,
			MaxThink:     spec.maxThink,
			TxThinkOdds:  tortureTxThinkOdds,
			SkipBusyOdds: spec.skipBusyOdds,
			// Half the workers use the simple query protocol, half pgx's
			// default extended protocol with cached prepared statements.
			// With nameLock, two in eight (one of each protocol) hand
			// their grants over as startup parameters of a connection per
			// grant, the others with set_config: a connection costs more
			// than the rest of an operation.
			SimpleProtocol: i%2 == 1,
			NameLock:       spec.nameLock,
			LockViaStartup: spec.nameLock && i%8 >= 6,
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
	var midRunner sync.WaitGroup
	if spec.midRun != nil {
		midRunner.Go(func() {
			time.Sleep(duration / 2)
			t.Logf("halfway: %s", spec.midRun())
			run.mu.Lock()
			run.midDone = true
			run.mu.Unlock()
		})
	}
	run.injectPauses(t, procs, duration, rand.New(rand.NewPCG(seed, 0)))
	close(stopTerminator)
	terminator.Wait()
	midRunner.Wait()

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

	in := checkInput{Ops: run.ops, Fenced: spec.fenced, Stampless: spec.nameLock, HistoryUnfenced: spec.historyUnfenced}
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
	if spec.watermarks {
		in.Watermarks = readWatermarks(t, st, keyPrefix)
	}
	res := check(in)
	for _, b := range run.bad {
		res.anomaly("%s", b)
	}

	t.Logf("pauses: %d (%d of a lock holder), each %v + 1..2s; server sessions terminated in a transaction: %d",
		run.pauses, run.onHold, run.ttl, terminated)
	if spec.resumeOnRead {
		t.Logf("pauses ended early by a newer holder's read of the same key: %d", run.earlyResumes)
	}
	t.Logf("operations: attempted %d, acknowledged %d, fenced %d, failed %d, unknown %d (%d of them committed)",
		res.Attempted, res.Acked, res.Fenced, res.Failed, res.Unknown, res.UnknownCommitted)
	if len(res.FencedBy) > 0 {
		t.Logf("fenced by phase: %v", res.FencedBy)
	}
	for _, k := range res.Keys {
		t.Logf("key %d: final value %d; %d acknowledged + %d unknown-but-committed increments; %d accepted stamps; last_fence %d",
			k.Key, k.Final, k.Acked, k.UnknownCommitted, k.Stamps, k.LastToken)
	}
	if spec.midRun != nil {
		t.Logf("acknowledged after the halfway event: %d", run.ackedAfterMid)
	}
	t.Logf("torture: ops=%d acked=%d fenced=%d unknown=%d anomalies=%d",
		res.Attempted, res.Acked, res.Fenced, res.Unknown, len(res.Anomalies))
	return &tortureResult{checkReport: res, ackedAfterMid: run.ackedAfterMid}
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
		op := &opRecord{ID: id, Key: key, Token: token}
		r.ops[id] = op
		r.holding[i] = true
		r.current[i] = op
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
	case "read":
		if r.resumeOnRead {
			r.resumeOlderHolders(op)
		}
	case "try":
		v, err := strconv.ParseInt(detail, 10, 64)
		if err != nil {
			bad("bad try line")
			return
		}
		op.Tried, op.NewValue = true, v
	case "ack":
		settle(acked)
		if r.midDone {
			r.ackedAfterMid++
		}
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
		r.current[i] = nil
		if op.Outcome == pending {
			bad("unlock before an outcome")
		}
	default:
		bad("unknown line")
	}
}

// resumeOlderHolders resumes the paused workers whose operation holds (or
// held) the lock of op's key with an older token: op's worker has just
// read, so their writes now race its think time. r.mu is held.
func (r *tortureRun) resumeOlderHolders(op *opRecord) {
	for i, cur := range r.current {
		if !r.paused[i] || cur == nil || cur.Key != op.Key || cur.Token >= op.Token {
			continue
		}
		// An error means the worker has exited; its wait reports why.
		_ = r.procs[i].signal(syscall.SIGCONT)
		r.paused[i] = false
		r.earlyResumes++
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
		r.pauseGen[i]++
		gen := r.pauseGen[i]
		r.pauses++
		if r.holding[i] {
			r.onHold++
		}
		d := r.ttl + time.Second + time.Duration(rng.Int64N(int64(time.Second)))

		// SIGSTOP under r.mu: a read reported meanwhile must not find
		// the worker marked paused before it is.
		err := procs[i].signal(syscall.SIGSTOP)
		r.mu.Unlock()
		if err != nil {
			t.Errorf("worker %s: SIGSTOP: %v", procs[i].name, err)
		}
		resumes.Go(func() {
			time.Sleep(d)
			r.mu.Lock()
			defer r.mu.Unlock()
			if !r.paused[i] || r.pauseGen[i] != gen {
				return // resumed early (resumeOnRead)
			}
			if err := procs[i].signal(syscall.SIGCONT); err != nil {
				t.Errorf("worker %s: SIGCONT: %v", procs[i].name, err)
			}
			r.paused[i] = false
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

// readWatermarks reads the lock watermarks of the run's locks (names
// keyPrefix + key) from fenceproxy.locks, keyed by counter row.
func readWatermarks(t *testing.T, st *stack, keyPrefix string) map[int]int64 {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	type lockRow struct {
		name  string
		token int64
	}
	rows, err := collect(ctx, st.direct(t), "SELECT name, token FROM fenceproxy.locks WHERE starts_with(name, $1)",
		func(r pgx.CollectableRow) (l lockRow, err error) { return l, r.Scan(&l.name, &l.token) }, keyPrefix)
	if err != nil {
		t.Fatalf("read fenceproxy.locks: %v", err)
	}
	w := make(map[int]int64, len(rows))
	for _, l := range rows {
		key, err := strconv.Atoi(strings.TrimPrefix(l.name, keyPrefix))
		if err != nil {
			t.Fatalf("fenceproxy.locks has lock %q under the run's prefix %q", l.name, keyPrefix)
		}
		w[key] = l.token
	}
	return w
}

func collect[T any](ctx context.Context, conn *pgx.Conn, sql string, scan pgx.RowToFunc[T], args ...any) ([]T, error) {
	rows, err := conn.Query(ctx, sql, args...)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, scan)
}
