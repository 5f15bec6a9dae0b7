package main

import (
	"os"
	"os/exec"
	"regexp"
	"strings"
	"testing"
)

// TestBenchPrintsEveryTable runs the whole benchmark as bench/run.sh does,
// as briefly as it goes (eight clients, the count the fencing-on-relay
// target applies to; one mode; one run of a second per cell; 300
// statements per round of the server CPU table), and checks that it prints every table with its targets and a
// figure in every cell: PgBouncer and valgrind must be installed
// (scripts/install-deps.sh --bench), or cells say n/a and the test fails.
func TestBenchPrintsEveryTable(t *testing.T) {
	if testing.Short() {
		t.Skip("runs the whole benchmark (a few minutes)")
	}
	cmd := exec.Command("go", "run", "./bench", "-duration", "1s", "-clients", "8", "-modes", "simple",
		"-reps", "1", "-gobench-count", "1", "-gobench-time", "1x", "-cpu-statements", "300")
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
		"## select-only: the relay's targets",
		"(target: fenceproxy's ratio to direct ≥ pgbouncer (session)'s in every row, and its CPU per transaction no higher;",
		"## fenced writes",
		"target ≥ 0.85x",
		"## fencing on the relay",
		"(target at -c 8: row ≥ 0.95, lock ≥ 0.90,",
		"## server CPU per statement",
		"## instructions per statement",
		"prepared (PREPARE once, then EXECUTE",
		"## what the server executes: fencing against the hand-written statements",
		"(target: ≤ 1.10× for row fencing after setup and for lock fencing,",
		"| row (after setup) | first (simple Query, the token written in) |",
		"| lock | first (simple Query, the token written in) |",
		"row fencing, with the error raisers, reading the token (a text that sets the token itself)",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("no %q in the output:\n%s", want, out)
		}
	}
	if strings.Contains(out, "n/a") || strings.Contains(out, "not counted") {
		t.Errorf("a figure is missing (PgBouncer or valgrind not installed?):\n%s", out)
	}
	rows := func(re string) int { return len(regexp.MustCompile(re).FindAllString(out, -1)) }
	const verdict = `(holds|misses by [0-9.]+)`
	// Every select-only cell: TPS, ratio and CPU per transaction; and the
	// row's targets with their verdicts.
	if n := rows(`(?m)^\| simple +\|  8 \|[^\n]*( +[0-9]+ [0-9.]+x +[0-9.]+ µs/tx +\|){7}$`); n != 1 {
		t.Errorf("%d complete select-only rows, want 1:\n%s", n, out)
	}
	if n := rows(`(?m)^\| simple \| 8 \| [0-9.]+x \| [0-9.]+x \| ` + verdict + ` \| [0-9.]+ \| [0-9.]+ \| ` + verdict + `( µs)? \| [0-9.]+x \([0-9.]+x\) \| [0-9.]+ \([0-9.]+\) \| (holds|TPS [^|]+|CPU [^|]+) \|$`); n != 1 {
		t.Errorf("%d select-only target rows, want 1:\n%s", n, out)
	}
	// Fenced writes: synchronous_commit on and off, simple and prepared;
	// then row and lock fencing against the relay, with the target.
	if n := rows(`(?m)^\| (on |off) +\| (simple|prepared) +\|  8 \|[^\n]*( +[0-9]+ tps [0-9.]+x +[0-9.]+ µs/tx +\|){7}$`); n != 4 {
		t.Errorf("%d complete fenced-write rows, want 4:\n%s", n, out)
	}
	if n := rows(`(?m)^\| (on|off) \| (simple|prepared) \| 8 \| [0-9]+ tps \| [0-9.]+ \| ≥ 0.95: ` + verdict + ` \| [0-9.]+ \| ≥ 0.90: ` + verdict + ` \|$`); n != 4 {
		t.Errorf("%d fencing-on-relay rows, want 4:\n%s", n, out)
	}
	// Server cost: seven statements in CPU time (the token form and the
	// form reading the token), two more sent through fenceproxy, the
	// target on four; twelve statements in instructions, twelve prepared,
	// and the target's six comparisons.
	if n := rows(`(?m)^\| [^|]+ \| [0-9.]+ µs \| [0-9.]+ \| (≤ 1.10: ` + verdict + `)? \|$`); n != 9 {
		t.Errorf("%d server CPU rows, want 9:\n%s", n, out)
	}
	if n := strings.Count(out, "| ≤ 1.10: "); n != 10 {
		t.Errorf("the server cost target has %d verdicts, want 10", n)
	}
	// Nine statements, and four more for a watched database (the bench's
	// is): the hand-written statements with the catalog check in front, and
	// the relay's text before and with objects version 8, and with
	// rehold_at (version 9).
	if n := rows(`(?m)^\| [^|]+ \| [0-9]+ \| [0-9]+k \| [0-9]+k \| [0-9.]+ \|$`); n != 13 {
		t.Errorf("%d instruction rows, want 13:\n%s", n, out)
	}
	if n := rows(`(?m)^\| lock, in a watched database \(information\) \| first: [^|]+ \| [0-9]+k \| [0-9]+k \| [0-9.]+ \| \|$`); n != 3 {
		t.Errorf("%d watched-database rows, want 3:\n%s", n, out)
	}
	if n := rows(`(?m)^\| [^|]+ \| [0-9]+k \| [0-9]+k \| [0-9.]+ \| [0-9.]+ \|$`); n != 12 {
		t.Errorf("%d prepared instruction rows, want 12:\n%s", n, out)
	}
	if n := rows(`(?m)^\| (row \(after setup\)|lock) \| (first|repeated) [^|]+ \| [0-9]+k \| [0-9]+k \| [0-9.]+ \| ≤ 1.10: ` + verdict + ` \|$`); n != 6 {
		t.Errorf("%d server-cost target rows, want 6:\n%s", n, out)
	}
	if n := rows(`(?m)^\| [^|]+ \(\x60Benchmark\w+\x60\) \| [0-9.]+ (ns|µs|ms)[^|]* \| [0-9]+ \| [^|]* \| (holds|missed)? \|$`); n != len(goBenchCases) {
		t.Errorf("%d Go benchmark rows, want %d:\n%s", n, len(goBenchCases), out)
	}
}
