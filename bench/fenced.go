package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/fenceproxy/fenceproxy/internal/pgcluster"
)

// The fenced-write comparison: an UPDATE of a protected table through
// fenceproxy against the hand-written conditional UPDATE, sent directly
// and through relays; then, from the same runs, fencing against relaying
// alone.

// The columns of a fenced-writes row, in the order they are measured.
const (
	colDirect   = iota // the hand-written statement, direct
	colBouncer         // the hand-written statement through PgBouncer
	colRelay           // the hand-written statement of config_plain through fenceproxy
	colRow             // fenceproxy, row fencing
	colRow1            // fenceproxy GOMAXPROCS=1, row fencing
	colLock            // fenceproxy, lock fencing
	colAutoRow         // fenceproxy with auto_prepare, row fencing
	colAutoLock        // fenceproxy with auto_prepare, lock fencing
	fencedColumns
)

// fencedRow is one row of the fenced-writes table.
type fencedRow struct {
	commit, mode string
	clients      int
	res          []result // by column
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
	var rows []fencedRow
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
					if col := colRow + i; col == colLock || col == colAutoLock {
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
				if len(res) != fencedColumns {
					return fmt.Errorf("fenced writes: %d columns measured, want %d", len(res), fencedColumns)
				}
				rows = append(rows, fencedRow{commit, mode, c, res})
				d := res[colDirect]
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
	fencingOnRelayTable(rows)
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

// The fencing-on-relay targets: fencing's throughput against relaying
// the hand-written statement through the same proxy, at relayClients.
const (
	relayClients   = 8
	rowOnRelayMin  = 0.95
	lockOnRelayMin = 0.90
)

// fencingOnRelayTable prints, from the fenced-writes runs, row and lock
// fencing's throughput as a ratio of the relay-only column's: the
// hand-written conditional UPDATE of config_plain, a table the proxy does
// not protect, through the same fenceproxy. What relaying costs is then
// on both sides, and the ratio is what fencing adds.
func fencingOnRelayTable(rows []fencedRow) {
	fmt.Println()
	fmt.Println("## fencing on the relay: fenced UPDATE through fenceproxy / the hand-written conditional UPDATE of an unprotected table through the same fenceproxy (TPS, from the runs above)")
	fmt.Println()
	fmt.Printf("(target at -c %d: row ≥ %.2f, lock ≥ %.2f, in both protocols and both commit modes; other client counts for information)\n", relayClients, rowOnRelayMin, lockOnRelayMin)
	fmt.Println()
	fmt.Println("| sync | mode | -c | relay only: fenceproxy | row | row target | lock | lock target |")
	fmt.Println("|---|---|---|---|---|---|---|---|")
	checked := false
	for _, r := range rows {
		relay := r.res[colRelay].tps
		row, lock := r.res[colRow].tps/relay, r.res[colLock].tps/relay
		rowV, lockV := "(information)", "(information)"
		if r.clients == relayClients {
			checked = true
			rowV = fmt.Sprintf("≥ %.2f: %s", rowOnRelayMin, atLeast(row, rowOnRelayMin, 2, ""))
			lockV = fmt.Sprintf("≥ %.2f: %s", lockOnRelayMin, atLeast(lock, lockOnRelayMin, 2, ""))
		}
		fmt.Printf("| %s | %s | %d | %.0f tps | %.2f | %s | %.2f | %s |\n", r.commit, r.mode, r.clients, relay, row, rowV, lock, lockV)
	}
	if !checked {
		fmt.Printf("\n(no -c %d row: the target is not checked)\n", relayClients)
	}
}
