package main

import (
	"bufio"
	"fmt"
	"io"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
)

// The rewriter's and the relay's Go benchmarks (internal/rules/bench_test.go,
// internal/proxy/relay_bench_test.go), run by `go test -bench` from the module's
// root and summed up with their targets: the figures of the benchmark
// table that do not need a server.

// goBenchCase is one figure of the Go benchmarks' table.
type goBenchCase struct {
	pkg, bench string // package directory and benchmark name (without "Benchmark")
	title      string
	// metric is the figure shown and checked: "ns/op" or "ns/message".
	metric string
	// maxNS is the target on metric (0: none); maxAllocs the target on
	// allocs/op (-1: none).
	maxNS     float64
	maxAllocs float64
	target    string
}

var goBenchCases = []goBenchCase{
	{"./internal/rules", "PrecheckRead", "pre-check of a read that names no protected table", "ns/op", 200, 0, "≤ 200 ns, 0 allocs"},
	{"./internal/rules", "RewriteCached", "cached decision", "ns/op", 100, 0, "≤ 100 ns, 0 allocs"},
	{"./internal/rules", "RewriteFirstSeen", "first-seen UPDATE, inline form", "ns/op", 100_000, -1, "≤ 100 µs"},
	{"./internal/rules", "RewriteFirstSeenRaisers", "first-seen UPDATE, with the error raisers", "ns/op", 100_000, -1, "≤ 100 µs"},
	{"./internal/rules", "RewriteInsert1000", "1,000-row INSERT", "ns/op", 0, -1, ""},
	{"./internal/rules", "RewriteInsert5000", "5,000-row INSERT", "ns/op", 0, -1, "linear: per row ≤ 1.5× the 1,000-row INSERT's (quadratic: 5×)"},
	{"./internal/proxy", "RelaySimpleQuery", "relay, simple Query + 10 rows", "ns/message", 0, 0, "0 allocs"},
	{"./internal/proxy", "RelayExtended", "relay, Bind/Execute/Sync + 10 rows", "ns/message", 0, 0, "0 allocs"},
	{"./internal/proxy", "RelayNoPolicy", "relay without a policy, simple Query + 10 rows", "ns/message", 0, 0, "0 allocs"},
}

// goBenchResult is one benchmark's figures, by unit ("ns/op",
// "allocs/op", "ns/message", …).
type goBenchResult map[string]float64

// parseGoBench reads `go test -bench -benchmem` output and returns, per
// benchmark name (without "Benchmark" and the -N GOMAXPROCS suffix), the
// figures of each run in the order printed.
func parseGoBench(out string) map[string][]goBenchResult {
	res := map[string][]goBenchResult{}
	sc := bufio.NewScanner(strings.NewReader(out))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) < 4 || !strings.HasPrefix(f[0], "Benchmark") {
			continue
		}
		if _, err := strconv.Atoi(f[1]); err != nil {
			continue // a log line, not a result
		}
		name := strings.TrimPrefix(f[0], "Benchmark")
		if i := strings.LastIndexByte(name, '-'); i > 0 {
			if _, err := strconv.Atoi(name[i+1:]); err == nil {
				name = name[:i]
			}
		}
		r := goBenchResult{}
		for i := 2; i+1 < len(f); i += 2 {
			v, err := strconv.ParseFloat(f[i], 64)
			if err != nil {
				break
			}
			r[f[i+1]] = v
		}
		res[name] = append(res[name], r)
	}
	return res
}

// median returns the median of unit over runs (the lower middle of an even
// count), and whether every run has it.
func median(runs []goBenchResult, unit string) (float64, bool) {
	var vs []float64
	for _, r := range runs {
		v, ok := r[unit]
		if !ok {
			return 0, false
		}
		vs = append(vs, v)
	}
	if len(vs) == 0 {
		return 0, false
	}
	slices.Sort(vs)
	return vs[(len(vs)-1)/2], true
}

// goBenchRow is a table row: the figure, allocations, and whether the
// target holds ("" without a target).
type goBenchRow struct {
	c          goBenchCase
	ns, allocs float64
	verdict    string
	note       string // shown after the time
}

// goBenchRows computes the table's rows from the parsed runs.
func goBenchRows(runs map[string][]goBenchResult) ([]goBenchRow, error) {
	var rows []goBenchRow
	perRow := map[string]float64{}
	for _, c := range goBenchCases {
		ns, ok := median(runs[c.bench], c.metric)
		if !ok {
			return nil, fmt.Errorf("go benchmark %s: no %s in its output", c.bench, c.metric)
		}
		allocs, ok := median(runs[c.bench], "allocs/op")
		if !ok {
			return nil, fmt.Errorf("go benchmark %s: no allocs/op in its output (-benchmem)", c.bench)
		}
		row := goBenchRow{c: c, ns: ns, allocs: allocs}
		switch c.bench {
		case "RewriteInsert1000":
			perRow[c.bench] = ns / 1000
			row.note = fmt.Sprintf(" (%s per row)", formatNS(perRow[c.bench]))
		case "RewriteInsert5000":
			perRow[c.bench] = ns / 5000
			row.note = fmt.Sprintf(" (%s per row)", formatNS(perRow[c.bench]))
			row.verdict = holds(perRow["RewriteInsert5000"] <= 1.5*perRow["RewriteInsert1000"])
		}
		if c.maxNS > 0 || c.maxAllocs >= 0 {
			row.verdict = holds((c.maxNS == 0 || ns <= c.maxNS) && (c.maxAllocs < 0 || allocs <= c.maxAllocs))
		}
		rows = append(rows, row)
	}
	return rows, nil
}

func holds(ok bool) string {
	if ok {
		return "holds"
	}
	return "missed"
}

// formatNS prints a duration in ns with a unit that suits it.
func formatNS(ns float64) string {
	switch {
	case ns >= 1e6:
		return fmt.Sprintf("%.2f ms", ns/1e6)
	case ns >= 1e4:
		return fmt.Sprintf("%.0f µs", ns/1e3)
	case ns >= 1e3:
		return fmt.Sprintf("%.2f µs", ns/1e3)
	}
	return fmt.Sprintf("%.0f ns", ns)
}

// goBenchTable runs the Go benchmarks count times each (benchtime per run)
// with dir as the module's root ("" for the working directory) and writes
// their table to w.
func goBenchTable(w io.Writer, dir string, count int, benchtime string) error {
	byPkg := map[string][]string{}
	var pkgs []string
	for _, c := range goBenchCases {
		if _, ok := byPkg[c.pkg]; !ok {
			pkgs = append(pkgs, c.pkg)
		}
		byPkg[c.pkg] = append(byPkg[c.pkg], c.bench)
	}
	var out strings.Builder
	for _, pkg := range pkgs {
		cmd := exec.Command("go", "test", "-run", "^$", "-bench", "^Benchmark("+strings.Join(byPkg[pkg], "|")+")$",
			"-benchmem", "-count", strconv.Itoa(count), "-benchtime", benchtime, pkg)
		cmd.Dir = dir
		cmd.Stderr = os.Stderr
		b, err := cmd.Output()
		if err != nil {
			return fmt.Errorf("go test -bench %s: %v\n%s", pkg, err, b)
		}
		out.Write(b)
	}
	rows, err := goBenchRows(parseGoBench(out.String()))
	if err != nil {
		return err
	}
	fmt.Fprintln(w)
	fmt.Fprintf(w, "## rewriter and relay, Go benchmarks (median of %d runs of %s each; time per op, per message for the relay)\n\n", count, benchtime)
	fmt.Fprintln(w, "| benchmark | time | allocs | target | |")
	fmt.Fprintln(w, "|---|---|---|---|---|")
	for _, r := range rows {
		fmt.Fprintf(w, "| %s (`Benchmark%s`) | %s%s | %.0f | %s | %s |\n", r.c.title, r.c.bench, formatNS(r.ns), r.note, r.allocs, r.c.target, r.verdict)
	}
	return nil
}
