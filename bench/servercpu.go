package main

import (
	"context"
	"fmt"
	"os"
	"slices"
	"sort"
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5"

	"github.com/fenceproxy/fenceproxy/bench/internal/pgcost"
	"github.com/fenceproxy/fenceproxy/internal/pgcluster"
	"github.com/fenceproxy/fenceproxy/internal/rules"
)

// Server CPU per statement: each statement runs many times on one
// connection straight to PostgreSQL (simple protocol), and the backend
// process's CPU time (utime+stime from /proc/<pid>/stat) before and after
// gives what the statement costs the server itself — independent of the
// network, the client and the proxy, and much less of other load than
// throughput is.

// cpuStatement is one statement measured, with session settings.
type cpuStatement struct {
	name, sql string
}

// serverCPU measures each statement n times per round, rounds
// interleaved, and returns the median µs per statement.
func serverCPU(ctx context.Context, dsn string, settings map[string]string, stmts []cpuStatement, n, rounds int) ([]float64, error) {
	cfg, err := pgx.ParseConfig(dsn)
	if err != nil {
		return nil, err
	}
	cfg.DefaultQueryExecMode = pgx.QueryExecModeSimpleProtocol
	for k, v := range settings {
		cfg.RuntimeParams[k] = v
	}
	conn, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		return nil, err
	}
	defer conn.Close(ctx)
	var pid int
	if err := conn.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&pid); err != nil {
		return nil, err
	}
	per := make([][]float64, len(stmts))
	for r := 0; r < rounds; r++ {
		for i, st := range stmts {
			for k := 0; k < n/10; k++ { // warm the caches
				if _, err := conn.Exec(ctx, st.sql); err != nil {
					return nil, fmt.Errorf("%s: %w", st.name, err)
				}
			}
			before, err := procCPU(pid)
			if err != nil {
				return nil, err
			}
			for k := 0; k < n; k++ {
				if _, err := conn.Exec(ctx, st.sql); err != nil {
					return nil, fmt.Errorf("%s: %w", st.name, err)
				}
			}
			after, err := procCPU(pid)
			if err != nil {
				return nil, err
			}
			per[i] = append(per[i], float64(after-before)/float64(n))
		}
	}
	out := make([]float64, len(stmts))
	for i := range per {
		sort.Float64s(per[i])
		out[i] = per[i][len(per[i])/2]
	}
	return out, nil
}

// procCPU returns a process's utime+stime in µs (USER_HZ is 100 on Linux).
func procCPU(pid int) (int64, error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return 0, fmt.Errorf("server CPU: %w", err)
	}
	s := string(b)
	f := strings.Fields(s[strings.LastIndexByte(s, ')')+2:])
	ut, err1 := strconv.ParseInt(f[11], 10, 64)
	st, err2 := strconv.ParseInt(f[12], 10, 64)
	if err1 != nil || err2 != nil {
		return 0, fmt.Errorf("malformed /proc/%d/stat", pid)
	}
	return (ut + st) * 10000, nil
}

// serverCPUTable prints the server's CPU per fenced statement against the
// hand-written conditional statement: the rewritten UPDATE as the proxy
// sends it (row fencing), and with the lock registration before it (lock
// fencing, as one simple Query).
func serverCPUTable(ctx context.Context, dsn, proxyDSN string) error {
	rs, err := rules.Compile(rules.Config{Tables: []rules.Table{{Table: "public.config"}}})
	if err != nil {
		return err
	}
	client := "UPDATE config SET counter = counter + 1 WHERE id = 7"
	d := rs.Decide(client)
	if d.Action != rules.Rewrite || d.Lock == nil {
		return fmt.Errorf("server CPU: unexpected decision %v", d.Action)
	}
	fd := rs.ServerFunctions().Decide(client)
	if fd.Action != rules.Rewrite || fd.Lock == nil {
		return fmt.Errorf("server CPU: unexpected decision %v", fd.Action)
	}
	pd, pi := rs.ServerFunctions().Prepared().Decide(client), rs.Prepared().Decide(client)
	if pd.Action != rules.Rewrite || pd.SQL == fd.SQL || pi.Action != rules.Rewrite || pi.SQL == d.SQL {
		return fmt.Errorf("server CPU: no prepared form (%v, %v)", pd.Action, pi.Action)
	}
	lastPreparedForms = []cpuStatement{
		{"row fencing, inline form, prepared form (a named prepared statement, no fenceproxy setup)", pi.SQL},
		{"row fencing, prepared form (a named prepared statement, after fenceproxy setup)", pd.SQL},
	}
	hand := "UPDATE config SET counter = counter + 1, last_fence = 42 WHERE id = 7 AND last_fence <= 42"
	stmts := []cpuStatement{
		{"hand-written conditional UPDATE", hand},
		{"row fencing, inline form (no fenceproxy setup)", d.SQL},
		{"row fencing, with the error raisers (after fenceproxy setup)", fd.SQL},
		{"lock fencing (registration + rewritten UPDATE)", fd.Lock.Query},
		{"hand-written registration + conditional UPDATE", "SELECT 1 FROM fenceproxy.locks WHERE name = 'bench' AND token <= 42 FOR SHARE; " + hand},
		// The raisers' statement with functions of the same signatures
		// that only return a constant (setupObjects): what the two calls
		// cost whatever the functions do.
		{"row fencing's statement calling no-op functions (the calls alone)", strings.ReplaceAll(fd.SQL, "fenceproxy.", noopSchema+".")},
	}
	lastServerStatements = stmts
	us, err := serverCPU(ctx, dsn, map[string]string{"fence.token": "42", "fence.lock": "bench", "synchronous_commit": "off"}, stmts, 5000, 3)
	if err != nil {
		return err
	}
	// The client's statement sent through fenceproxy, again and again in
	// one session, as pgbench -M simple does, through a proxy with
	// auto_prepare: from the second time on the proxy runs it as its own
	// prepared statement, so the server executes the prepared form without
	// analysing it.
	viaProxy := []struct {
		cpuStatement
		settings map[string]string
	}{
		{cpuStatement{"row fencing through fenceproxy with auto_prepare, the same simple Query again (the proxy's prepared statement)", client},
			map[string]string{"fence.token": "42", "synchronous_commit": "off"}},
		{cpuStatement{"lock fencing through fenceproxy with auto_prepare, the same simple Query again (registration + the proxy's prepared statement)", client},
			map[string]string{"fence.token": "42", "fence.lock": "bench", "synchronous_commit": "off"}},
	}
	for _, v := range viaProxy {
		u, err := serverCPU(ctx, proxyDSN, v.settings, []cpuStatement{v.cpuStatement}, 5000, 3)
		if err != nil {
			return err
		}
		stmts = append(stmts, v.cpuStatement)
		us = append(us, u[0])
	}
	fmt.Println()
	fmt.Println("## server CPU per statement (PostgreSQL backend utime+stime, simple protocol, synchronous_commit off, median of 3)")
	fmt.Println()
	fmt.Println("| statement | CPU per statement | vs hand-written | target |")
	fmt.Println("|---|---|---|---|")
	for i, st := range stmts {
		target := ""
		if i >= 1 && i <= 3 || i >= len(lastServerStatements) {
			target = "≤ 1.10"
		}
		fmt.Printf("| %s | %.1f µs | %.2f | %s |\n", st.name, us[i], us[i]/us[0], target)
	}
	return nil
}

// lastServerStatements are the statements serverCPUTable measured, which
// serverInstructionsTable counts; lastPreparedForms are row fencing's
// statement in the forms a named prepared statement gets (rules.Prepared),
// which preparedInstructions counts too.
var lastServerStatements, lastPreparedForms []cpuStatement

// serverInstructionsTable counts, with callgrind, the instructions the
// statements of serverCPUTable cost PostgreSQL (see package pgcost), which
// the machine's load does not change. The server is stopped meanwhile.
func serverInstructionsTable(ctx context.Context, cl *pgcluster.Cluster) error {
	valgrind, err := pgcost.Valgrind()
	if err != nil {
		fmt.Printf("\n(instructions per statement not counted: %v)\n", err)
		return nil
	}
	if err := cl.StopServer(); err != nil {
		return err
	}
	defer func() { _ = cl.StartServer(ctx) }()
	c := pgcost.Counter{Valgrind: valgrind, BinDir: cl.BinDir(), DataDir: cl.DataDir()}
	perByte, err := c.ReadCost()
	if err != nil {
		return err
	}
	setup := []string{"SET fence.token = '42';", "SET fence.lock = 'bench';"}
	fmt.Println()
	fmt.Println("## instructions per statement (callgrind, single-user postgres, simple query and commit)")
	fmt.Println()
	fmt.Printf("(single-user mode reads its input at %.0f instructions per byte, which a server reading a message does not spend: taken out below as \"net\")\n\n", perByte)
	fmt.Println("| statement | bytes | instructions | net | net vs hand-written | target |")
	fmt.Println("|---|---|---|---|---|---|")
	var ref float64
	for i, st := range lastServerStatements {
		n, err := c.PerStatement(setup, func(int) string { return st.sql })
		if err != nil {
			return fmt.Errorf("%s: %w", st.name, err)
		}
		net := n - perByte*float64(len(st.sql))
		if i == 0 {
			ref = net
		}
		target := ""
		if i >= 1 && i <= 3 {
			target = "≤ 1.10"
		}
		fmt.Printf("| %s | %d | %.0fk | %.0fk | %.2f | %s |\n", st.name, len(st.sql), n/1000, net/1000, net/ref, target)
	}
	return preparedInstructions(c, setup, perByte, ref)
}

// preparedInstructions counts what executing the row fencing statements of
// serverCPUTable costs once they are prepared (PREPARE in the session,
// then EXECUTE, as an extended-protocol client's prepared statement runs):
// the analysis and planning that the simple protocol repeats are paid once,
// and what remains is the execution of the checks. simpleRef is the
// hand-written statement's net count as a simple Query.
func preparedInstructions(c pgcost.Counter, setup []string, perByte, simpleRef float64) error {
	const exec = "EXECUTE p"
	fmt.Println()
	fmt.Println("prepared (PREPARE once, then EXECUTE; the statement's analysis and planning are not repeated):")
	fmt.Println()
	fmt.Println("(last column: against the hand-written statement sent as a simple Query, above; with auto_prepare, a simple Query that fenceproxy has seen before in the session runs as the prepared form's EXECUTE — target ≤ 1.10)")
	fmt.Println()
	fmt.Println("| statement | instructions per EXECUTE | net | net vs hand-written | net vs hand-written simple Query |")
	fmt.Println("|---|---|---|---|---|")
	var ref float64
	stmts := slices.Concat(lastServerStatements[:2], lastPreparedForms[:1], lastServerStatements[2:3],
		lastPreparedForms[1:], lastServerStatements[5:])
	for i, st := range stmts {
		n, err := c.PerStatement(append(append([]string(nil), setup...), "PREPARE p AS "+st.sql+";"), func(int) string { return exec })
		if err != nil {
			return fmt.Errorf("%s, prepared: %w", st.name, err)
		}
		net := n - perByte*float64(len(exec))
		if i == 0 {
			ref = net
		}
		fmt.Printf("| %s | %.0fk | %.0fk | %.2f | %.2f |\n", st.name, n/1000, net/1000, net/ref, net/simpleRef)
	}
	return nil
}
