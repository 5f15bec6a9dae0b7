// Command guard measures what the database guard (fenceproxy setup
// --guard) costs a fenced single-row UPDATE sent directly to PostgreSQL,
// on one throwaway server: pgbench in prepared mode, one config row per
// client, with the token in fence.token (PGOPTIONS). Four workloads:
//
//   - hand: the hand-written conditional UPDATE (... last_fence = 42 WHERE
//     id = :id AND last_fence <= 42), no guard: the reference, what the
//     proxy's rewrite amounts to;
//   - guard: the plain UPDATE with the guard installed, which checks and
//     stamps the row;
//   - hand+guard: the conditional UPDATE with the guard installed, as a
//     write through the proxy costs once the guard is on (fenced twice);
//   - guard+lock: the plain UPDATE with the guard installed in a session
//     that names a lock (fence.lock): the guard registers the token for
//     the lock once per transaction, here once per UPDATE.
//
// For each it prints TPS and the server's CPU time per transaction
// (utime+stime of the postmaster, of its live children and of those it
// reaped, from /proc: the server runs on this machine), each the median of
// -reps runs, rounds interleaved, and their ratio to hand. CPU per
// transaction depends much less on other load than TPS does.
//
// With -callgrind it then counts the instructions of one UPDATE and its
// commit in each workload, which do not depend on the load at all: the
// server stopped, a single-user postgres under valgrind's callgrind runs
// the prepared UPDATE 200 and 1200 times, and the difference is divided by
// 1000. It adds the same pair on a table whose rows hold a 10 kB TOASTed
// value (wide, wide+guard).
//
//	bench/guard.sh [-duration 5s] [-clients 1,4] [-reps 3] [-callgrind]
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/fenceproxy/fenceproxy/bench/internal/pgcost"
	"github.com/fenceproxy/fenceproxy/internal/dbsetup"
	"github.com/fenceproxy/fenceproxy/internal/pgcluster"
	"github.com/fenceproxy/fenceproxy/internal/rules"
)

func main() {
	duration := flag.Duration("duration", 5*time.Second, "length of each pgbench run")
	clients := flag.String("clients", "1,4", "comma-separated client counts")
	reps := flag.Int("reps", 3, "runs per cell; the median is reported")
	syncModes := flag.String("sync", "off,on", "synchronous_commit values to measure")
	callgrind := flag.Bool("callgrind", false, "also count instructions per UPDATE with valgrind's callgrind (needs valgrind)")
	flag.Parse()
	if err := run(*duration, *clients, *reps, *syncModes, *callgrind); err != nil {
		fmt.Fprintln(os.Stderr, "guard bench:", err)
		os.Exit(1)
	}
}

// workload is one of the measured statements and how it runs.
type workload struct {
	name   string
	guard  bool   // with the guard installed
	script string // pgbench script
	lock   bool   // the session names a lock
}

const (
	plainUpdate = "\\set id :client_id + 1\nUPDATE config SET counter = counter + 1 WHERE id = :id;\n"
	handUpdate  = "\\set id :client_id + 1\nUPDATE config SET counter = counter + 1, last_fence = 42 WHERE id = :id AND last_fence <= 42;\n"
)

var workloads = []workload{
	{name: "hand", script: handUpdate},
	{name: "guard", guard: true, script: plainUpdate},
	{name: "hand+guard", guard: true, script: handUpdate},
	{name: "guard+lock", guard: true, script: plainUpdate, lock: true},
}

// result is one pgbench run.
type result struct {
	tps, latencyMS, cpuUS float64
}

func run(duration time.Duration, clientList string, reps int, syncModes string, callgrind bool) error {
	var cs []int
	for _, s := range strings.Split(clientList, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(s))
		if err != nil || n < 1 {
			return fmt.Errorf("-clients: %q is not a client count", s)
		}
		cs = append(cs, n)
	}
	ctx := context.Background()
	work, err := os.MkdirTemp("", "fenceproxy-guard-bench-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(work)
	cl, err := pgcost.StartDurable(ctx)
	if err != nil {
		return err
	}
	defer cl.Stop()
	pgbench := filepath.Join(cl.BinDir(), "pgbench")
	if err := cl.Exec(ctx, `
		CREATE TABLE public.config (id int PRIMARY KEY, payload text NOT NULL DEFAULT '', counter bigint NOT NULL DEFAULT 0,
		                            last_fence bigint NOT NULL DEFAULT 0);
		INSERT INTO public.config (id) SELECT g FROM generate_series(1, 256) g;
		CREATE TABLE public.wide (id int PRIMARY KEY, payload text NOT NULL DEFAULT '', counter bigint NOT NULL DEFAULT 0,
		                          last_fence bigint NOT NULL DEFAULT 0);
		INSERT INTO public.wide (id, payload)
			SELECT g, (SELECT string_agg(md5(g::text || i::text), '') FROM generate_series(1, 300) i) FROM generate_series(1, 256) g;`); err != nil {
		return err
	}
	conn, err := pgx.Connect(ctx, cl.SuperuserDSN("postgres"))
	if err != nil {
		return err
	}
	defer conn.Close(ctx)
	tables := []rules.Table{{Table: "public.config"}, {Table: "public.wide"}}
	specs, err := rules.Specs(rules.Config{Tables: tables})
	if err != nil {
		return err
	}
	guard := func(on bool) error {
		c, err := pgx.Connect(ctx, cl.SuperuserDSN("postgres"))
		if err != nil {
			return err
		}
		defer c.Close(ctx)
		_, err = dbsetup.Setup(ctx, c, specs, dbsetup.SetupOptions{Guard: on, RemoveGuard: !on, Tables: tables})
		return err
	}
	scripts := map[string]string{}
	for _, w := range workloads {
		path := filepath.Join(work, strings.ReplaceAll(w.name, "+", "-")+".sql")
		if err := os.WriteFile(path, []byte(w.script), 0o644); err != nil {
			return err
		}
		scripts[w.name] = path
	}

	fmt.Printf("# database guard cost: %s, %d cores, PostgreSQL at %s, pgbench -M prepared, %v per run, median of %d runs per cell\n",
		time.Now().UTC().Format("2006-01-02"), runtime.NumCPU(), cl.BinDir(), duration, reps)
	fmt.Println("# single-row UPDATE of the client's own config row, token 42; ratio = workload / hand (TPS, and server CPU per transaction)")
	fmt.Println()
	fmt.Printf("| %-4s | %2s | %-10s | %9s | %8s | %5s | %11s | %5s |\n", "sync", "-c", "workload", "TPS", "latency", "ratio", "CPU/tx", "ratio")
	fmt.Println("|------|----|------------|-----------|----------|-------|-------------|-------|")
	for _, sync := range strings.Split(syncModes, ",") {
		for _, c := range cs {
			runs := map[string][]result{}
			for range max(1, reps) {
				// Rounds interleave the workloads, so that a slow spell of
				// the machine does not land on one of them only.
				for _, on := range []bool{false, true} {
					if err := guard(on); err != nil {
						return fmt.Errorf("setup (guard %v): %w", on, err)
					}
					for _, w := range workloads {
						if w.guard != on {
							continue
						}
						env := "PGOPTIONS=-c fence.token=42 -c synchronous_commit=" + sync
						if w.lock {
							env += " -c fence.lock=bench"
						}
						r, err := pgbenchRun(ctx, cl, conn, pgbench, env, c, duration, scripts[w.name])
						if err != nil {
							return fmt.Errorf("%s -c %d: %w", w.name, c, err)
						}
						runs[w.name] = append(runs[w.name], r)
					}
				}
			}
			ref := median(runs["hand"])
			for _, w := range workloads {
				m := median(runs[w.name])
				fmt.Printf("| %-4s | %2d | %-10s | %9.0f | %5.3f ms | %5.2f | %8.1f µs | %5.2f |\n",
					sync, c, w.name, m.tps, m.latencyMS, m.tps/ref.tps, m.cpuUS, m.cpuUS/ref.cpuUS)
			}
		}
	}
	if callgrind {
		return countInstructions(ctx, cl, guard)
	}
	return nil
}

// median returns the run with the median TPS, and the median CPU per
// transaction of the runs.
func median(rs []result) result {
	s := append([]result(nil), rs...)
	sort.Slice(s, func(i, j int) bool { return s[i].tps < s[j].tps })
	m := s[len(s)/2]
	sort.Slice(s, func(i, j int) bool { return s[i].cpuUS < s[j].cpuUS })
	m.cpuUS = s[len(s)/2].cpuUS
	return m
}

var (
	tpsRE = regexp.MustCompile(`tps = ([0-9.]+) \(without initial connection time\)`)
	latRE = regexp.MustCompile(`latency average = ([0-9.]+) ms`)
	txRE  = regexp.MustCompile(`number of transactions actually processed: ([0-9]+)`)
)

func pgbenchRun(ctx context.Context, cl *pgcluster.Cluster, conn *pgx.Conn, pgbench, env string, clients int, d time.Duration, script string) (result, error) {
	before, err := serverCPU(cl.PID())
	if err != nil {
		return result{}, err
	}
	args := []string{"-n", "-M", "prepared", "-c", strconv.Itoa(clients), "-j", strconv.Itoa(min(clients, runtime.NumCPU())),
		"-T", strconv.Itoa(max(1, int(d.Seconds()))), "-h", cl.Host(), "-p", strconv.Itoa(cl.Port()), "-U", "postgres", "-f", script, "postgres"}
	cmd := exec.CommandContext(ctx, pgbench, args...)
	cmd.Env = append(os.Environ(), env)
	out, err := cmd.CombinedOutput()
	if err != nil {
		return result{}, fmt.Errorf("%v\n%s", err, out)
	}
	// pgbench's backends have exited once the postmaster has reaped them
	// (their CPU time then counts in its cutime and cstime).
	for range 100 {
		var n int
		if err := conn.QueryRow(ctx, "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'pgbench'").Scan(&n); err != nil {
			return result{}, err
		}
		if n == 0 {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	time.Sleep(50 * time.Millisecond)
	after, err := serverCPU(cl.PID())
	if err != nil {
		return result{}, err
	}
	m, l, x := tpsRE.FindSubmatch(out), latRE.FindSubmatch(out), txRE.FindSubmatch(out)
	if m == nil || l == nil || x == nil {
		return result{}, fmt.Errorf("cannot read pgbench output:\n%s", out)
	}
	tps, _ := strconv.ParseFloat(string(m[1]), 64)
	lat, _ := strconv.ParseFloat(string(l[1]), 64)
	txs, _ := strconv.ParseFloat(string(x[1]), 64)
	return result{tps: tps, latencyMS: lat, cpuUS: (after - before).Seconds() * 1e6 / txs}, nil
}

// clockTick is the unit of the times in /proc/<pid>/stat (USER_HZ, 100 on
// Linux).
const clockTick = 10 * time.Millisecond

// serverCPU returns the CPU time of the postmaster pid, of its children
// that have exited and been reaped, and of those still running.
func serverCPU(pid int) (time.Duration, error) {
	fields, err := procStat(pid)
	if err != nil {
		return 0, err
	}
	total := ticks(fields, 14, 15, 16, 17) // utime stime cutime cstime
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return 0, err
	}
	for _, e := range entries {
		child, err := strconv.Atoi(e.Name())
		if err != nil || child == pid {
			continue
		}
		f, err := procStat(child)
		if err != nil || len(f) < 18 || f[4] != strconv.Itoa(pid) { // gone, or not a child
			continue
		}
		total += ticks(f, 14, 15)
	}
	return time.Duration(total) * clockTick, nil
}

// procStat returns the fields of /proc/<pid>/stat, numbered from 1 as in
// proc(5) (index 0 is empty); the command name may hold spaces.
func procStat(pid int) ([]string, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return nil, err
	}
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	if i < 0 {
		return nil, fmt.Errorf("/proc/%d/stat: no command name", pid)
	}
	return append([]string{"", strconv.Itoa(pid), s[:i+1]}, strings.Fields(s[i+1:])...), nil
}

func ticks(f []string, idx ...int) int64 {
	var n int64
	for _, i := range idx {
		if i < len(f) {
			v, _ := strconv.ParseInt(f[i], 10, 64)
			n += v
		}
	}
	return n
}

// countInstructions prints the instructions per UPDATE of each workload,
// counted by callgrind in a single-user postgres.
func countInstructions(ctx context.Context, cl *pgcluster.Cluster, guard func(on bool) error) error {
	valgrind, err := pgcost.Valgrind()
	if err != nil {
		return fmt.Errorf("-callgrind: %w", err)
	}
	counter := pgcost.Counter{Valgrind: valgrind, BinDir: cl.BinDir(), DataDir: cl.DataDir()}
	hand := func(table string) string {
		return "UPDATE " + table + " SET counter = counter + 1, last_fence = 42 WHERE id = $1 AND last_fence <= 42"
	}
	plain := func(table string) string { return "UPDATE " + table + " SET counter = counter + 1 WHERE id = $1" }
	type count struct {
		name, sql string
		guard     bool
		lock      bool
	}
	counts := []count{
		{name: "hand", sql: hand("config")},
		{name: "guard", sql: plain("config"), guard: true},
		{name: "hand+guard", sql: hand("config"), guard: true},
		{name: "guard+lock", sql: plain("config"), guard: true, lock: true},
		{name: "wide", sql: hand("wide")},
		{name: "wide+guard", sql: plain("wide"), guard: true},
	}
	fmt.Println()
	fmt.Println("# instructions per UPDATE and commit (callgrind, single-user postgres, prepared statement); ratio to hand, or to wide")
	fmt.Println()
	fmt.Printf("| %-10s | %12s | %5s |\n", "workload", "instructions", "ratio")
	fmt.Println("|------------|--------------|-------|")
	var ref float64
	for _, c := range counts {
		// Setup needs the server; the single-user postgres needs it stopped.
		if err := cl.StartServer(ctx); err != nil {
			return err
		}
		if err := guard(c.guard); err != nil {
			return err
		}
		if err := cl.StopServer(); err != nil {
			return err
		}
		// A prepared statement: single-user mode reads one statement per
		// line.
		setup := []string{"SET fence.token = '42';"}
		if c.lock {
			setup = append(setup, "SET fence.lock = 'bench';")
		}
		setup = append(setup, fmt.Sprintf("PREPARE u(int) AS %s;", c.sql))
		per, err := counter.PerStatement(setup, func(i int) string { return fmt.Sprintf("EXECUTE u(%d);", i%256+1) })
		if err != nil {
			return fmt.Errorf("%s: %w", c.name, err)
		}
		if !c.guard {
			ref = per
		}
		fmt.Printf("| %-10s | %12.0f | %5.2f |\n", c.name, per, per/ref)
	}
	return cl.StartServer(ctx)
}
