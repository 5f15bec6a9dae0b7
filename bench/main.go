// Command bench measures fenceproxy side by side with PostgreSQL and
// PgBouncer in one run against one throwaway server, and prints ratios.
//
//	go run ./bench [-duration 5s] [-clients 1,8] [-modes simple,extended,prepared]
//
// What it measures:
//   - select-only (pgbench -S) directly, through fenceproxy and through
//     PgBouncer in session mode;
//   - fenced writes: one config row per client, UPDATE through the proxy
//     (rewritten, token from PGOPTIONS; row fencing, and lock fencing with
//     fence.lock set too) versus the hand-written conditional UPDATE of
//     docs/design.md sent directly;
//   - what a fenced statement costs PostgreSQL itself (servercpu.go);
//   - the rewriter's and the relay's Go benchmarks (gobench.go).
//
// bench/run.sh installs PgBouncer if it is missing and runs this.
package main

import (
	"context"
	"flag"
	"fmt"
	"net"
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
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(1)
	}
}

type target struct {
	name string
	port int
}

type result struct {
	tps, latencyMS float64
	cpuPerTx       float64 // µs of the relay's CPU per transaction; 0 when not measured
}

func run() error {
	duration := flag.Duration("duration", 5*time.Second, "length of each pgbench run")
	clients := flag.String("clients", "1,8", "comma-separated client counts")
	modes := flag.String("modes", "simple,extended,prepared", "pgbench query modes")
	scale := flag.Int("scale", 10, "pgbench scale factor")
	proxyBin := flag.String("proxy", "", "fenceproxy binary (default: build it)")
	skipSelect := flag.Bool("skip-select", false, "skip the select-only comparison")
	skipFenced := flag.Bool("skip-fenced", false, "skip the fenced-write comparison")
	skipGo := flag.Bool("skip-gobench", false, "skip the rewriter's and relay's Go benchmarks")
	goCount := flag.Int("gobench-count", 3, "runs of each Go benchmark; the median is reported")
	goTime := flag.String("gobench-time", "1s", "go test -benchtime of each Go benchmark run")
	flag.Parse()

	ctx := context.Background()
	work, err := os.MkdirTemp("", "fenceproxy-bench-")
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
	fmt.Printf("# fenceproxy benchmark: %s, %d cores, Go %s, PostgreSQL at %s, %v per run, median of %d interleaved runs per cell\n",
		time.Now().UTC().Format("2006-01-02"), runtime.NumCPU(), runtime.Version(), cl.BinDir(), *duration, max(1, *reps))

	// First, while nothing else of the benchmark runs: they need no server.
	if !*skipGo {
		if err := goBenchTable(os.Stdout, "", *goCount, *goTime); err != nil {
			return err
		}
	}

	if err := initData(ctx, cl, pgbench, *scale); err != nil {
		return err
	}

	// fenceproxy's objects (`fenceproxy setup`) are in place before the
	// proxies start: their first check of the database finds them, so the
	// rewrites call the error raisers, as in a set-up production database.
	if err := setupObjects(ctx, cl); err != nil {
		return err
	}

	bin := *proxyBin
	if bin == "" {
		bin = filepath.Join(work, "fenceproxy")
		build := exec.Command("go", "build", "-o", bin, "./cmd/fenceproxy")
		build.Stdout, build.Stderr = os.Stderr, os.Stderr
		if err := build.Run(); err != nil {
			return fmt.Errorf("build fenceproxy: %w", err)
		}
	}
	proxyPort, stopProxy, err := startProxy(bin, work, cl.Port(), "")
	if err != nil {
		return err
	}
	defer stopProxy()
	// The same proxy held to one OS thread running Go code: on a small
	// machine shared with PostgreSQL this avoids cross-thread wake-ups.
	proxy1Port, stopProxy1, err := startProxy(bin, work, cl.Port(), "", "GOMAXPROCS=1")
	if err != nil {
		return err
	}
	defer stopProxy1()
	// With the proxy's own prepared statements for repeated simple
	// Queries (opt-in).
	proxyAutoPort, stopProxyAuto, err := startProxy(bin, work, cl.Port(), "auto_prepare: 2\n")
	if err != nil {
		return err
	}
	defer stopProxyAuto()

	var cs []int
	for _, s := range strings.Split(*clients, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(s))
		if err != nil {
			return fmt.Errorf("-clients: %w", err)
		}
		cs = append(cs, n)
	}

	bouncerPort, stopBouncer, err := startPgBouncer(work, cl.Port(), false)
	if err != nil {
		fmt.Fprintf(os.Stderr, "bench: PgBouncer not measured: %v\n", err)
		bouncerPort = 0
	} else {
		defer stopBouncer()
	}
	pooledPort := 0
	if bouncerPort != 0 {
		port, stop, err := startPgBouncer(work, cl.Port(), true)
		if err != nil {
			fmt.Fprintf(os.Stderr, "bench: pooled PgBouncer not measured: %v\n", err)
		} else {
			defer stop()
			pooledPort = port
		}
	}

	if !*skipSelect {
		targets := []target{{"direct", cl.Port()}, {"fenceproxy", proxyPort}, {"fenceproxy-1", proxy1Port}}
		if bouncerPort != 0 {
			targets = append(targets, target{"pgbouncer", bouncerPort})
		}
		if pooledPort != 0 {
			targets = append(targets, target{"pgbouncer-pooled", pooledPort})
		}
		// The relay prototypes (bench/relayproto): what the goroutine model
		// and an epoll loop cost with nothing else to do.
		protoBin := filepath.Join(work, "relayproto")
		build := exec.Command("go", "build", "-o", protoBin, "./bench/relayproto")
		build.Stdout, build.Stderr = os.Stderr, os.Stderr
		if err := build.Run(); err != nil {
			return fmt.Errorf("build relayproto: %w", err)
		}
		for _, mode := range []string{"raw", "copy"} {
			port, stop, err := startRelayProto(protoBin, mode, cl.Port())
			if err != nil {
				return err
			}
			defer stop()
			targets = append(targets, target{"proto-" + mode, port})
		}
		cols := []struct{ name, title string }{
			{"fenceproxy", "fenceproxy"}, {"fenceproxy-1", "fenceproxy GOMAXPROCS=1"}, {"pgbouncer", "pgbouncer (session)"},
			{"pgbouncer-pooled", "pgbouncer, pooled backends"}, {"proto-raw", "raw-syscall epoll prototype"}, {"proto-copy", "io.Copy relay prototype"},
		}
		fmt.Println()
		fmt.Println("## select-only (pgbench -S), TPS and ratio to direct TPS; relay CPU per transaction (the relay process's utime+stime / transactions)")
		fmt.Println()
		fmt.Println("(target: fenceproxy's ratio ≥ pgbouncer (session)'s in every row, and its CPU per transaction no higher)")
		fmt.Println()
		fmt.Println("(pgbouncer (session) closes a server connection with its client's, so each pgbench run meets new server processes, as it does directly and through fenceproxy; pooled backends: PgBouncer's default, which hands a new client an earlier client's server process, whose memory is already mapped — a pooling effect, not a relay cost)")
		fmt.Println()
		fmt.Printf("| %-8s | %2s | %-22s |", "mode", "-c", "direct")
		for _, c := range cols {
			fmt.Printf(" %-28s |", c.title)
		}
		fmt.Printf("\n|----------|----|------------------------|%s\n", strings.Repeat("------------------------------|", len(cols)))
		for _, mode := range strings.Split(*modes, ",") {
			for _, c := range cs {
				runs := make([]benchRun, len(targets))
				for i, t := range targets {
					runs[i] = benchRun{port: t.port, extra: []string{"-S"}}
				}
				rs, err := interleaved(pgbench, mode, c, *duration, runs)
				if err != nil {
					return fmt.Errorf("select-only %s -c %d: %w", mode, c, err)
				}
				res := map[string]result{}
				for i, t := range targets {
					res[t.name] = rs[i]
				}
				d := res["direct"]
				fmt.Printf("| %-8s | %2d | %8.0f tps %6.3f ms |", mode, c, d.tps, d.latencyMS)
				for _, col := range cols {
					r, ok := res[col.name]
					if !ok {
						fmt.Printf(" %-28s |", "n/a")
						continue
					}
					fmt.Printf(" %-28s |", fmt.Sprintf("%6.0f %.2fx %4.1f µs/tx", r.tps, r.tps/d.tps, r.cpuPerTx))
				}
				fmt.Println()
			}
		}
	}

	if !*skipFenced {
		if err := fencedBench(ctx, cl, pgbench, work, proxyPort, proxy1Port, proxyAutoPort, bouncerPort, cs, *duration); err != nil {
			return err
		}
		u := cl.URL("postgres", "", "postgres")
		u.Host = net.JoinHostPort("127.0.0.1", strconv.Itoa(proxyAutoPort))
		proxyDSN := u.String()
		if err := serverCPUTable(ctx, cl.SuperuserDSN("postgres"), proxyDSN); err != nil {
			return err
		}
		// Last: it stops the server for a while.
		if err := serverInstructionsTable(ctx, cl); err != nil {
			return err
		}
	}
	return nil
}

// setupObjects installs fenceproxy's objects (the lock watermarks, the
// register procedure, the error raisers), as `fenceproxy setup` does.
func setupObjects(ctx context.Context, cl *pgcluster.Cluster) error {
	conn, err := pgx.Connect(ctx, cl.SuperuserDSN("postgres"))
	if err != nil {
		return err
	}
	defer conn.Close(ctx)
	if _, err = dbsetup.Setup(ctx, conn, nil, dbsetup.SetupOptions{}); err != nil {
		return err
	}
	// Functions with the signatures of the raisers that fenced rows call
	// and nothing in them: the floor of any form that calls PL/pgSQL.
	_, err = conn.Exec(ctx, `CREATE SCHEMA IF NOT EXISTS `+noopSchema+`;
		CREATE OR REPLACE FUNCTION `+noopSchema+`.tok_b(text, text) RETURNS boolean LANGUAGE plpgsql STABLE
			AS 'BEGIN RETURN true; END';
		CREATE OR REPLACE FUNCTION `+noopSchema+`.advance(text, bigint, boolean, text, text) RETURNS bigint LANGUAGE plpgsql STABLE
			AS 'BEGIN RETURN 42; END'`)
	return err
}

// noopSchema holds the no-op functions of setupObjects.
const noopSchema = "bench_noop"

func initData(ctx context.Context, cl *pgcluster.Cluster, pgbench string, scale int) error {
	cmd := exec.Command(pgbench, "-i", "-q", "-s", strconv.Itoa(scale), "-h", "127.0.0.1", "-p", strconv.Itoa(cl.Port()), "-U", "postgres", "postgres")
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("pgbench -i: %v\n%s", err, out)
	}
	return cl.Exec(ctx, `
		CREATE TABLE public.config (id int PRIMARY KEY, payload text NOT NULL DEFAULT '', counter bigint NOT NULL DEFAULT 0,
		                            last_fence bigint NOT NULL DEFAULT 0);
		INSERT INTO public.config (id) SELECT g FROM generate_series(1, 256) g;
		CREATE TABLE public.config_plain (LIKE public.config INCLUDING ALL);
		INSERT INTO public.config_plain (id) SELECT g FROM generate_series(1, 256) g;`)
}

func fencedBench(ctx context.Context, cl *pgcluster.Cluster, pgbench, work string, proxyPort, proxy1Port, proxyAutoPort, bouncerPort int, cs []int, duration time.Duration) error {
	proxyScript := filepath.Join(work, "fenced-proxy.sql")
	directScript := filepath.Join(work, "fenced-direct.sql")
	plainScript := filepath.Join(work, "fenced-plain.sql")
	// One row per client; the proxy reads the token from fence.token (set
	// per connection through PGOPTIONS), the hand-written form carries it.
	if err := os.WriteFile(proxyScript, []byte("\\set id :client_id + 1\nUPDATE config SET counter = counter + 1 WHERE id = :id;\n"), 0o644); err != nil {
		return err
	}
	const hand = "\\set id :client_id + 1\nUPDATE %s SET counter = counter + 1, last_fence = :token WHERE id = :id AND last_fence <= :token;\n"
	if err := os.WriteFile(directScript, []byte(fmt.Sprintf(hand, "config")), 0o644); err != nil {
		return err
	}
	// The same hand-written statement on a table fenceproxy does not
	// protect: what relaying the write costs, without any fencing.
	if err := os.WriteFile(plainScript, []byte(fmt.Sprintf(hand, "config_plain")), 0o644); err != nil {
		return err
	}
	fmt.Println()
	fmt.Println("## fenced writes: UPDATE through fenceproxy vs the hand-written conditional UPDATE sent directly")
	fmt.Println()
	fmt.Println("(sync = synchronous_commit: on waits for the WAL flush of each commit, PostgreSQL's default)")
	fmt.Println()
	fmt.Println("(row: fence.token only; lock: fence.lock and fence.token, so each UPDATE is preceded by the lock registration; target ≥ 0.85x)")
	fmt.Println()
	fmt.Println("(relay only: the hand-written statement through PgBouncer (session mode, server connections not reused), and through fenceproxy on a table it does not protect: what relaying a write costs without fencing; µs/tx: the relay process's CPU per transaction, over the cell's runs)")
	fmt.Println()
	fmt.Println("(auto_prepare: fenceproxy with `auto_prepare: 2` (opt-in): from its second sending in a session, a simple Query it rewrites runs as a prepared statement of the proxy's own; the prepared rows are unchanged by it)")
	fmt.Println()
	fmt.Printf("| %-4s | %-8s | %2s | %-26s | %-28s | %-28s | %-28s | %-28s | %-28s | %-28s | %-28s |\n", "sync", "mode", "-c", "hand-written, direct",
		"relay only: pgbouncer", "relay only: fenceproxy", "fenceproxy, row", "fenceproxy GOMAXPROCS=1, row", "fenceproxy, lock",
		"auto_prepare, row", "auto_prepare, lock")
	fmt.Printf("|------|----------|----|----------------------------|%s\n", strings.Repeat("------------------------------|", 7))
	defer func() { _ = setSyncCommit(ctx, cl, "") }()
	for _, commit := range []string{"on", "off"} {
		// PgBouncer refuses the options startup parameter (PGOPTIONS), so
		// the server's default carries synchronous_commit for every run.
		if err := setSyncCommit(ctx, cl, commit); err != nil {
			return err
		}
		env := []string{"PGOPTIONS=-c synchronous_commit=" + commit}
		for _, mode := range []string{"simple", "prepared"} {
			for _, c := range cs {
				handArgs := func(script string) []string { return []string{"-f", script, "-D", "token=42"} }
				runs := []benchRun{
					{port: cl.Port(), env: env, extra: handArgs(directScript)},
					{port: bouncerPort, extra: handArgs(directScript)},
					{port: proxyPort, env: env, extra: handArgs(plainScript)},
				}
				for i, port := range []int{proxyPort, proxy1Port, proxyPort, proxyAutoPort, proxyAutoPort} {
					opts := "PGOPTIONS=-c fence.token=42 -c synchronous_commit=" + commit
					if i == 2 || i == 4 {
						opts += " -c fence.lock=bench"
					}
					runs = append(runs, benchRun{port: port, env: []string{opts}, extra: []string{"-f", proxyScript}})
				}
				// Every run starts from watermarks at zero.
				for i := range runs {
					runs[i].before = func() error {
						return cl.Exec(ctx, "UPDATE config SET last_fence = 0; UPDATE config_plain SET last_fence = 0")
					}
				}
				res, err := interleaved(pgbench, mode, c, duration, runs)
				if err != nil {
					return fmt.Errorf("fenced writes, %s -c %d: %w", mode, c, err)
				}
				d := res[0]
				fmt.Printf("| %-4s | %-8s | %2d | %8.0f tps %8.3f ms |", commit, mode, c, d.tps, d.latencyMS)
				for _, p := range res[1:] {
					cell := "n/a"
					if p.tps != 0 {
						cell = fmt.Sprintf("%6.0f tps %.2fx %5.1f µs/tx", p.tps, p.tps/d.tps, p.cpuPerTx)
					}
					fmt.Printf(" %-28s |", cell)
				}
				fmt.Println()
			}
		}
	}
	return nil
}

// setSyncCommit makes value the server's default synchronous_commit (""
// resets it) and gives the reload a moment to reach the backends (a
// backend applies it before its next statement; PgBouncer's open server
// connections included).
func setSyncCommit(ctx context.Context, cl *pgcluster.Cluster, value string) error {
	stmt := "ALTER SYSTEM RESET synchronous_commit"
	if value != "" {
		stmt = "ALTER SYSTEM SET synchronous_commit = " + value
	}
	// Two statements: ALTER SYSTEM refuses to run in a transaction block.
	if err := cl.Exec(ctx, stmt); err != nil {
		return err
	}
	if err := cl.Exec(ctx, "SELECT pg_reload_conf()"); err != nil {
		return err
	}
	// A reload reaches the backends a moment later; sessions that
	// PgBouncer keeps open take it before their next statement.
	time.Sleep(500 * time.Millisecond)
	return nil
}

var (
	tpsRE = regexp.MustCompile(`tps = ([0-9.]+) \(without initial connection time\)`)
	latRE = regexp.MustCompile(`latency average = ([0-9.]+) ms`)
)

// reps is how many times each cell is measured; the median run is kept, so
// one noisy run on a shared machine does not decide a row.
var reps = flag.Int("reps", 3, "runs per cell; the median is reported")

// benchRun is one cell of a table: pgbench against a port.
type benchRun struct {
	port   int // 0: not measured (the cell's result stays zero)
	env    []string
	extra  []string
	before func() error // run before each pgbench run, if set
}

// interleaved measures the runs of one table row reps times each, round
// after round (all runs once, then all again, each round starting at the
// next cell), so that the machine's load, which changes over the minutes a
// row takes, weighs on every cell alike. Each cell's result is its median
// run by TPS, with the CPU per transaction of the relay process listening
// on its port over all the cell's runs (connection set-up included, which
// pgbench's TPS leaves out: a slight overstatement).
func interleaved(pgbench, mode string, clients int, d time.Duration, runs []benchRun) ([]result, error) {
	all := make([][]result, len(runs))
	cpu := make([]int64, len(runs))
	txns := make([]float64, len(runs))
	for round := range max(1, *reps) {
		for j := range runs {
			// Each round starts at another cell, so that no cell always
			// follows the same one (the previous run's dead row versions,
			// a checkpoint it set off).
			i := (round + j) % len(runs)
			r := runs[i]
			if r.port == 0 {
				continue
			}
			if r.before != nil {
				if err := r.before(); err != nil {
					return nil, err
				}
			}
			pid, hasPid := pids[r.port]
			var before int64
			if hasPid {
				before, _ = procCPU(pid)
			}
			res, err := pgbenchOnce(pgbench, r.port, r.env, mode, clients, d, r.extra)
			if err != nil {
				return nil, fmt.Errorf("port %d: %w", r.port, err)
			}
			if hasPid {
				after, _ := procCPU(pid)
				cpu[i] += after - before
				txns[i] += res.tps * d.Seconds()
			}
			all[i] = append(all[i], res)
		}
	}
	out := make([]result, len(runs))
	for i, rs := range all {
		if len(rs) == 0 {
			continue
		}
		sort.Slice(rs, func(a, b int) bool { return rs[a].tps < rs[b].tps })
		out[i] = rs[len(rs)/2]
		if txns[i] > 0 {
			out[i].cpuPerTx = float64(cpu[i]) / txns[i]
		}
	}
	return out, nil
}

func pgbenchOnce(pgbench string, port int, env []string, mode string, clients int, d time.Duration, extra []string) (result, error) {
	jobs := min(clients, runtime.NumCPU())
	args := []string{"-n", "-M", mode, "-c", strconv.Itoa(clients), "-j", strconv.Itoa(jobs),
		"-T", strconv.Itoa(int(d.Seconds())), "-h", "127.0.0.1", "-p", strconv.Itoa(port), "-U", "postgres"}
	args = append(args, extra...)
	args = append(args, "postgres")
	cmd := exec.Command(pgbench, args...)
	cmd.Env = append(os.Environ(), env...)
	out, err := cmd.CombinedOutput()
	if err != nil {
		return result{}, fmt.Errorf("%v\n%s", err, out)
	}
	m := tpsRE.FindSubmatch(out)
	l := latRE.FindSubmatch(out)
	if m == nil || l == nil {
		return result{}, fmt.Errorf("cannot read pgbench output:\n%s", out)
	}
	tps, _ := strconv.ParseFloat(string(m[1]), 64)
	lat, _ := strconv.ParseFloat(string(l[1]), 64)
	return result{tps: tps, latencyMS: lat}, nil
}
