package main

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"
)

// The select-only comparison (pgbench -S): what relaying costs, against
// PgBouncer and against relays that do nothing but relay.

// selectConfig is what the select-only comparison runs against: the
// ports of the relays (0: not running).
type selectConfig struct {
	pgbench, work                          string
	modes                                  []string
	clients                                []int
	duration                               time.Duration
	direct, proxy, proxy1, bouncer, pooled int
}

// fenceSettings are the session's fence settings of the select-only
// column that carries them: reads of an unprotected table, which fencing
// must leave alone.
const fenceSettings = "PGOPTIONS=-c fence.token=42 -c fence.lock=bench"

// target is one column of the select-only table.
type target struct {
	name string
	port int
	env  []string
}

// selectRow is one row of the select-only table: each column's result by
// target name.
type selectRow struct {
	mode    string
	clients int
	res     map[string]result
}

// selectOnlyBench measures select-only through every relay and prints the
// table, then the relay target's table from the same runs.
func selectOnlyBench(cfg selectConfig) error {
	targets := []target{{"direct", cfg.direct, nil}, {"fenceproxy", cfg.proxy, nil},
		{"fenceproxy-fence", cfg.proxy, []string{fenceSettings}}, {"fenceproxy-1", cfg.proxy1, nil}}
	if cfg.bouncer != 0 {
		targets = append(targets, target{"pgbouncer", cfg.bouncer, nil})
	}
	if cfg.pooled != 0 {
		targets = append(targets, target{"pgbouncer-pooled", cfg.pooled, nil})
	}
	// The relay prototypes (bench/relayproto): what the goroutine model
	// and an epoll loop cost with nothing else to do.
	protoBin := filepath.Join(cfg.work, "relayproto")
	build := exec.Command("go", "build", "-o", protoBin, "./bench/relayproto")
	build.Stdout, build.Stderr = os.Stderr, os.Stderr
	if err := build.Run(); err != nil {
		return fmt.Errorf("build relayproto: %w", err)
	}
	for _, mode := range []string{"raw", "copy"} {
		port, stop, err := startRelayProto(protoBin, mode, cfg.direct)
		if err != nil {
			return err
		}
		defer stop()
		targets = append(targets, target{"proto-" + mode, port, nil})
	}
	cols := []struct{ name, title string }{
		{"fenceproxy", "fenceproxy"}, {"fenceproxy-fence", "fenceproxy, fence settings"},
		{"fenceproxy-1", "fenceproxy GOMAXPROCS=1"}, {"pgbouncer", "pgbouncer (session)"},
		{"pgbouncer-pooled", "pgbouncer, pooled backends"}, {"proto-raw", "raw-syscall epoll prototype"}, {"proto-copy", "io.Copy relay prototype"},
	}
	fmt.Println()
	fmt.Println("## select-only (pgbench -S), TPS and ratio to direct TPS; relay CPU per transaction (the relay process's utime+stime / transactions)")
	fmt.Println()
	fmt.Println("(pgbouncer (session) closes a server connection with its client's, so each pgbench run meets new server processes, as it does directly and through fenceproxy; pooled backends: PgBouncer's default, which hands a new client an earlier client's server process, whose memory is already mapped — a pooling effect, not a relay cost)")
	fmt.Println()
	fmt.Println("(fence settings: the same fenceproxy, the sessions with fence.token and fence.lock set (PGOPTIONS); pgbench's tables are not protected)")
	fmt.Println()
	fmt.Printf("| %-8s | %2s | %-22s |", "mode", "-c", "direct")
	for _, c := range cols {
		fmt.Printf(" %-28s |", c.title)
	}
	fmt.Printf("\n|----------|----|------------------------|%s\n", strings.Repeat("------------------------------|", len(cols)))
	var rows []selectRow
	for _, mode := range cfg.modes {
		for _, c := range cfg.clients {
			runs := make([]benchRun, len(targets))
			for i, t := range targets {
				runs[i] = benchRun{port: t.port, env: t.env, extra: []string{"-S"}}
			}
			rs, err := interleaved(cfg.pgbench, mode, c, cfg.duration, runs)
			if err != nil {
				return fmt.Errorf("select-only %s -c %d: %w", mode, c, err)
			}
			row := selectRow{mode, c, map[string]result{}}
			for i, t := range targets {
				row.res[t.name] = rs[i]
			}
			rows = append(rows, row)
			d := row.res["direct"]
			fmt.Printf("| %-8s | %2d | %8.0f tps %6.3f ms |", mode, c, d.tps, d.latencyMS)
			for _, col := range cols {
				r, ok := row.res[col.name]
				if !ok {
					fmt.Printf(" %-28s |", "n/a")
					continue
				}
				fmt.Printf(" %-28s |", fmt.Sprintf("%6.0f %.2fx %4.1f µs/tx", r.tps, r.tps/d.tps, r.cpuPerTx))
			}
			fmt.Println()
		}
	}
	selectTargetTable(rows)
	return nil
}

// selectTargetTable prints, from the select-only runs, the relay's
// targets row by row: fenceproxy's ratio to direct at least PgBouncer's
// (session mode) with no more CPU per transaction; and the session's
// fence settings adding nothing measurable to these reads of unprotected
// tables — the TPS with them within the run-to-run spread of fenceproxy's
// runs without (at least the lowest), and their CPU per transaction no
// higher than the highest of a run without.
func selectTargetTable(rows []selectRow) {
	fmt.Println()
	fmt.Println("## select-only: the relay's targets (from the runs above)")
	fmt.Println()
	fmt.Println("(target: fenceproxy's ratio to direct ≥ pgbouncer (session)'s in every row, and its CPU per transaction no higher; the fence settings add nothing measurable: with them, TPS at least the lowest of fenceproxy's runs without and CPU per transaction at most the highest of a run without)")
	fmt.Println()
	fmt.Println("| mode | -c | fenceproxy | pgbouncer (session) | ratio ≥ pgbouncer's | fenceproxy µs/tx | pgbouncer µs/tx | CPU ≤ pgbouncer's | fence settings: TPS vs without (lowest run without) | fence settings: µs/tx (highest run without) | fence settings add nothing measurable |")
	fmt.Println("|---|---|---|---|---|---|---|---|---|---|---|")
	for _, row := range rows {
		d, fp, fs := row.res["direct"], row.res["fenceproxy"], row.res["fenceproxy-fence"]
		fmt.Printf("| %s | %d | %.2fx |", row.mode, row.clients, fp.tps/d.tps)
		if pb, ok := row.res["pgbouncer"]; ok {
			fmt.Printf(" %.2fx | %s | %.1f | %.1f | %s |", pb.tps/d.tps, atLeast(fp.tps/d.tps, pb.tps/d.tps, 2, ""),
				fp.cpuPerTx, pb.cpuPerTx, atMost(fp.cpuPerTx, pb.cpuPerTx, 1, " µs"))
		} else {
			fmt.Printf(" n/a | n/a | %.1f | n/a | n/a |", fp.cpuPerTx)
		}
		lowest := fp.minTPS / fp.tps
		tpsVerdict := atLeast(fs.tps/fp.tps, lowest, 2, "")
		cpuVerdict := atMost(fs.cpuPerTx, fp.maxCPUPerTx, 1, " µs")
		v := "holds"
		switch {
		case tpsVerdict != "holds" && cpuVerdict != "holds":
			v = "TPS " + tpsVerdict + ", CPU " + cpuVerdict
		case tpsVerdict != "holds":
			v = "TPS " + tpsVerdict
		case cpuVerdict != "holds":
			v = "CPU " + cpuVerdict
		}
		fmt.Printf(" %.2fx (%.2fx) | %.1f (%.1f) | %s |\n", fs.tps/fp.tps, lowest, fs.cpuPerTx, fp.maxCPUPerTx, v)
	}
}
