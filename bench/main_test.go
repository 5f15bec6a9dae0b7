package main

import (
	"os"
	"os/exec"
	"regexp"
	"strings"
	"testing"
)

// TestBenchPrintsEveryTable runs the whole benchmark as bench/run.sh does,
// as briefly as it goes (one client, one mode, one run of a second per
// cell), and checks that it prints every table with its targets and a
// figure in every cell: PgBouncer and valgrind must be installed
// (scripts/install-deps.sh --bench), or cells say n/a and the test fails.
func TestBenchPrintsEveryTable(t *testing.T) {
	if testing.Short() {
		t.Skip("runs the whole benchmark (a few minutes)")
	}
	cmd := exec.Command("go", "run", "./bench", "-duration", "1s", "-clients", "1", "-modes", "simple",
		"-reps", "1", "-gobench-count", "1", "-gobench-time", "1x")
	cmd.Dir = ".."
	cmd.Stderr = os.Stderr
	b, err := cmd.Output()
	out := string(b)
	if err != nil {
		t.Fatalf("bench: %v\n%s", err, out)
	}
	for _, want := range []string{
		"## rewriter and relay, Go benchmarks",
		"## select-only (pgbench -S)",
		"(target: fenceproxy's ratio ≥ pgbouncer (session)'s in every row, and its CPU per transaction no higher)",
		"## fenced writes",
		"target ≥ 0.85x",
		"## server CPU per statement",
		"## instructions per statement",
		"prepared (PREPARE once, then EXECUTE",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("no %q in the output:\n%s", want, out)
		}
	}
	if strings.Contains(out, "n/a") || strings.Contains(out, "not counted") {
		t.Errorf("a figure is missing (PgBouncer or valgrind not installed?):\n%s", out)
	}
	rows := func(re string) int { return len(regexp.MustCompile(re).FindAllString(out, -1)) }
	// Every select-only cell: TPS, ratio and CPU per transaction.
	if n := rows(`(?m)^\| simple +\|  1 \|[^\n]*( +[0-9]+ [0-9.]+x +[0-9.]+ µs/tx +\|){6}$`); n != 1 {
		t.Errorf("%d complete select-only rows, want 1:\n%s", n, out)
	}
	// Fenced writes: synchronous_commit on and off, simple and prepared.
	if n := rows(`(?m)^\| (on |off) +\| (simple|prepared) +\|  1 \|[^\n]*( +[0-9]+ tps [0-9.]+x +[0-9.]+ µs/tx +\|){7}$`); n != 4 {
		t.Errorf("%d complete fenced-write rows, want 4:\n%s", n, out)
	}
	// Server cost: six statements in CPU time and in instructions, with
	// the ≤ 1.10 target on three of each; in CPU time two more sent
	// through fenceproxy, with the target; six prepared forms, and the
	// target for the repeated simple Query above their table.
	if n := rows(`(?m)^\| [^|]+ \| [0-9.]+ µs \| [0-9.]+ \| (≤ 1.10)? \|$`); n != 8 {
		t.Errorf("%d server CPU rows, want 8:\n%s", n, out)
	}
	if n := rows(`(?m)^\| [^|]+ \| [0-9]+ \| [0-9]+k \| [0-9]+k \| [0-9.]+ \| (≤ 1.10)? \|$`); n != 6 {
		t.Errorf("%d instruction rows, want 6:\n%s", n, out)
	}
	if n := rows(`(?m)^\| [^|]+ \| [0-9]+k \| [0-9]+k \| [0-9.]+ \| [0-9.]+ \|$`); n != 6 {
		t.Errorf("%d prepared instruction rows, want 6:\n%s", n, out)
	}
	if n := strings.Count(out, "≤ 1.10"); n != 9 {
		t.Errorf("the server cost target appears %d times, want 9", n)
	}
	if n := rows(`(?m)^\| [^|]+ \(\x60Benchmark\w+\x60\) \| [0-9.]+ (ns|µs|ms)[^|]* \| [0-9]+ \| [^|]* \| (holds|missed)? \|$`); n != len(goBenchCases) {
		t.Errorf("%d Go benchmark rows, want %d:\n%s", n, len(goBenchCases), out)
	}
}
