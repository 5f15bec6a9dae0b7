// Command bench measures fenceproxy side by side with PostgreSQL and
// PgBouncer in one run against one throwaway server, and prints ratios.
//
//	go run ./bench [-duration 5s] [-clients 1,8] [-modes simple,extended,prepared]
//
// What it measures, each table with its targets and whether each holds:
//   - select-only (pgbench -S) directly, through fenceproxy (also with the
//     session's fence settings set) and through PgBouncer in session mode
//     (selectonly.go), then the relay's targets from the same runs;
//   - fenced writes: one config row per client, UPDATE through the proxy
//     (rewritten, token from PGOPTIONS; row fencing, and lock fencing with
//     fence.lock set too) versus the hand-written conditional UPDATE of
//     docs/design.md sent directly and relayed, then fencing against
//     relaying alone from the same runs (fenced.go);
//   - what a fenced statement costs PostgreSQL itself against the
//     hand-written statements, in CPU time (servercpu.go) and in
//     instructions (instructions.go);
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
	"runtime"
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
	cpuStmts := flag.Int("cpu-statements", 5000, "statements per round of each row of the server CPU table")
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
	// The proxies and poolers, stopped in reverse order at the end or by
	// an earlier stopAll.
	var stops []func()
	stopAll := func() {
		for i := len(stops) - 1; i >= 0; i-- {
			stops[i]()
		}
		stops = nil
	}
	defer func() { stopAll() }()
	proxyPort, stopProxy, err := startProxy(bin, work, cl.Port(), "")
	if err != nil {
		return err
	}
	stops = append(stops, stopProxy)
	// The same proxy held to one OS thread running Go code: on a small
	// machine shared with PostgreSQL this avoids cross-thread wake-ups.
	proxy1Port, stopProxy1, err := startProxy(bin, work, cl.Port(), "", "GOMAXPROCS=1")
	if err != nil {
		return err
	}
	stops = append(stops, stopProxy1)
	// With the proxy's own prepared statements for repeated simple
	// Queries (opt-in).
	proxyAutoPort, stopProxyAuto, err := startProxy(bin, work, cl.Port(), "auto_prepare: 2\n")
	if err != nil {
		return err
	}
	stops = append(stops, stopProxyAuto)

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
		stops = append(stops, stopBouncer)
	}
	pooledPort := 0
	if bouncerPort != 0 {
		port, stop, err := startPgBouncer(work, cl.Port(), true)
		if err != nil {
			fmt.Fprintf(os.Stderr, "bench: pooled PgBouncer not measured: %v\n", err)
		} else {
			stops = append(stops, stop)
			pooledPort = port
		}
	}

	if !*skipSelect {
		cfg := selectConfig{pgbench: pgbench, work: work, modes: strings.Split(*modes, ","), clients: cs, duration: *duration,
			direct: cl.Port(), proxy: proxyPort, proxy1: proxy1Port, bouncer: bouncerPort, pooled: pooledPort}
		if err := selectOnlyBench(cfg); err != nil {
			return err
		}
	}

	if !*skipFenced {
		if err := fencedBench(ctx, cl, pgbench, work, proxyPort, proxy1Port, proxyAutoPort, bouncerPort, cs, *duration); err != nil {
			return err
		}
		u := cl.URL("postgres", "", "postgres")
		u.Host = net.JoinHostPort("127.0.0.1", strconv.Itoa(proxyAutoPort))
		proxyDSN := u.String()
		forms, err := newFencedForms()
		if err != nil {
			return err
		}
		if err := serverCPUTable(ctx, cl.SuperuserDSN("postgres"), proxyDSN, forms, max(1, *cpuStmts)); err != nil {
			return err
		}
		// Last: it stops the server for a while. The proxies and poolers
		// go first, so that nothing of theirs retries connecting (and logs
		// it) meanwhile.
		stopAll()
		if err := serverInstructionsTable(ctx, cl, forms); err != nil {
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
