// Package pgcost starts the benchmarks' throwaway server (StartDurable)
// and counts what statements cost PostgreSQL itself, in
// instructions: valgrind's callgrind runs a single-user postgres (the
// server stopped) that reads its statements from standard input. Counts
// do not depend on the machine's load, unlike CPU times.
//
// Single-user mode reads its input a character at a time, which costs about
// a hundred instructions per byte that a server reading a protocol message
// does not spend; ReadCost measures it so that callers can take it out of
// long statements' counts.
package pgcost

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"

	"github.com/fenceproxy/fenceproxy/internal/pgcluster"
)

// StartDurable starts a throwaway PostgreSQL server with PostgreSQL's
// default durability (the test harness turns it off for speed): commits
// reach the disk, as they do in production. synchronous_commit may be set
// per session.
func StartDurable(ctx context.Context) (*pgcluster.Cluster, error) {
	return pgcluster.Start(ctx, pgcluster.Options{Settings: map[string]string{
		"max_connections": "100", "fsync": "on", "synchronous_commit": "on", "full_page_writes": "on",
	}})
}

// Valgrind returns the valgrind binary, or an error saying how to install
// it.
func Valgrind() (string, error) {
	v, err := exec.LookPath("valgrind")
	if err != nil {
		return "", fmt.Errorf("%w (apt-get install valgrind)", err)
	}
	return v, nil
}

// Counter runs single-user postgres instances on one stopped data
// directory.
type Counter struct {
	Valgrind, BinDir, DataDir string
	// Settings are the server settings (-c) of each run, besides
	// synchronous_commit=off.
	Settings []string
}

// Instructions runs lines (one statement per line, as single-user mode
// reads them) in a single-user postgres under callgrind and returns the
// instructions it executed. Any ERROR fails the count.
func (c Counter) Instructions(lines []string) (float64, error) {
	work, err := os.MkdirTemp("", "fenceproxy-callgrind-")
	if err != nil {
		return 0, err
	}
	defer os.RemoveAll(work)
	out := filepath.Join(work, "callgrind.out")
	args := []string{"--tool=callgrind", "--callgrind-out-file=" + out,
		filepath.Join(c.BinDir, "postgres"), "--single", "-D", c.DataDir, "-c", "synchronous_commit=off"}
	for _, s := range c.Settings {
		args = append(args, "-c", s)
	}
	cmd := exec.Command(c.Valgrind, append(args, "postgres")...)
	cmd.Stdin = strings.NewReader(strings.Join(lines, "\n") + "\n")
	var stderr strings.Builder
	cmd.Stderr = &stderr
	if err := asDataOwner(cmd, c.DataDir, work); err != nil {
		return 0, err
	}
	if err := cmd.Run(); err != nil {
		return 0, fmt.Errorf("%v\n%s", err, stderr.String())
	}
	if i := strings.Index(stderr.String(), "ERROR:"); i >= 0 {
		return 0, fmt.Errorf("single-user postgres: %s", stderr.String()[i:])
	}
	b, err := os.ReadFile(out)
	if err != nil {
		return 0, err
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "summary: "); ok {
			return strconv.ParseFloat(strings.TrimSpace(v), 64)
		}
	}
	return 0, fmt.Errorf("no summary in %s", out)
}

// PerStatement returns the instructions of one run of the statement that
// stmt(i) gives for its i-th run, after the lines of setup: the count for
// 200 runs taken from the count for 1,200, divided by 1,000, so that
// starting and stopping the server cancel out.
func (c Counter) PerStatement(setup []string, stmt func(i int) string) (float64, error) {
	var total [2]float64
	for k, n := range []int{200, 1200} {
		lines := append([]string(nil), setup...)
		for i := range n {
			lines = append(lines, stmt(i))
		}
		v, err := c.Instructions(lines)
		if err != nil {
			return 0, err
		}
		total[k] = v
	}
	return (total[1] - total[0]) / 1000, nil
}

// ReadCost returns the instructions single-user mode spends per byte of a
// statement's text beyond what the statement itself costs: "SELECT 1" with
// and without a 2,000-byte comment.
func (c Counter) ReadCost() (float64, error) {
	short, err := c.PerStatement(nil, func(int) string { return "SELECT 1" })
	if err != nil {
		return 0, err
	}
	pad := " /*" + strings.Repeat("x", 1995) + "*/"
	long, err := c.PerStatement(nil, func(int) string { return "SELECT 1" + pad })
	if err != nil {
		return 0, err
	}
	return (long - short) / float64(len(pad)), nil
}

// asDataOwner runs cmd as the owner of dataDir (PostgreSQL refuses to run
// as root) and gives it dir.
func asDataOwner(cmd *exec.Cmd, dataDir, dir string) error {
	var st syscall.Stat_t
	if err := syscall.Stat(dataDir, &st); err != nil {
		return err
	}
	if int(st.Uid) == os.Geteuid() {
		return nil
	}
	if err := os.Chown(dir, int(st.Uid), int(st.Gid)); err != nil {
		return err
	}
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: st.Uid, Gid: st.Gid}}
	return nil
}
