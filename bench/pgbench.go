package main

import (
	"flag"
	"fmt"
	"os"
	"os/exec"
	"regexp"
	"runtime"
	"sort"
	"strconv"
	"time"
)

// Running pgbench: one table row's cells, interleaved.

// result is one cell: its median pgbench run.
type result struct {
	tps, latencyMS float64
	// minTPS and maxTPS are the lowest and highest TPS of the cell's
	// runs: its run-to-run spread.
	minTPS, maxTPS float64
	// cpuPerTx is µs of the relay's CPU per transaction over the cell's
	// runs, maxCPUPerTx the highest of a single run's; 0 when not measured.
	cpuPerTx, maxCPUPerTx float64
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
	cpu := make([]float64, len(runs))
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
			var before float64
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
				if res.tps > 0 {
					res.cpuPerTx = (after - before) / (res.tps * d.Seconds())
				}
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
		out[i].minTPS, out[i].maxTPS = rs[0].tps, rs[len(rs)-1].tps
		for _, r := range rs {
			out[i].maxCPUPerTx = max(out[i].maxCPUPerTx, r.cpuPerTx)
		}
		if txns[i] > 0 {
			out[i].cpuPerTx = cpu[i] / txns[i]
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
