package main

import (
	"context"
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5"

	"github.com/fenceproxy/fenceproxy/bench/internal/pgcost"
	"github.com/fenceproxy/fenceproxy/internal/pgcluster"
)

// What the server executes, in instructions: callgrind counts what the
// statements of fencedForms cost PostgreSQL (see package pgcost), which
// the machine's load does not change.

// countedStatement is one row of an instruction table: a line sent to
// single-user postgres after the lines of setup.
type countedStatement struct {
	name  string
	setup []string // after the session's fence settings
	sql   string
	base  int // the row compared with (itself for a baseline)
}

// counted is a row's net instructions (the reading of its line taken out).
type counted struct {
	countedStatement
	total, net float64
}

// countAll counts each statement of stmts.
func countAll(c pgcost.Counter, settings []string, perByte float64, stmts []countedStatement) ([]counted, error) {
	out := make([]counted, len(stmts))
	for i, st := range stmts {
		n, err := c.PerStatement(append(append([]string(nil), settings...), st.setup...), func(int) string { return st.sql })
		if err != nil {
			return nil, fmt.Errorf("%s: %w", st.name, err)
		}
		out[i] = counted{st, n, n - perByte*float64(len(st.sql))}
	}
	return out, nil
}

// serverInstructionsTable prints the instructions of f's statements, sent
// once as simple Queries and executed as prepared statements, and then
// the server-cost target: row fencing after setup and lock fencing
// against their hand-written statements, for a first sending and for a
// repeated one. The server is stopped meanwhile.
func serverInstructionsTable(ctx context.Context, cl *pgcluster.Cluster, f fencedForms) error {
	valgrind, err := pgcost.Valgrind()
	if err != nil {
		fmt.Printf("\n(instructions per statement not counted: %v)\n", err)
		return nil
	}
	// The catalog stamp, for the statements a watched database adds (the
	// catalog check) to be counted as they pass.
	var stamp int64
	watched := false
	if conn, err := pgx.Connect(ctx, cl.SuperuserDSN("postgres")); err == nil {
		watched = conn.QueryRow(ctx, "SELECT stamp FROM fenceproxy.catalog").Scan(&stamp) == nil
		_ = conn.Close(ctx)
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
	settings := []string{"SET fence.token = '42';", "SET fence.lock = 'bench';"}

	simple, err := countAll(c, settings, perByte, []countedStatement{
		{"hand-written conditional UPDATE", nil, f.hand, 0},
		{"hand-written registration + conditional UPDATE (one simple Query, one transaction)", nil, f.handLock, 1},
		{"row fencing, inline form (no fenceproxy setup)", nil, f.inline, 0},
		{"row fencing, with the error raisers (after fenceproxy setup), the token written in (what a session with a valid token sends)", nil, f.raisers, 0},
		{"lock fencing (registration + rewritten UPDATE, the token written in)", nil, f.lock, 1},
		{"row fencing's statement reading the token, calling no-op functions (the calls alone)", nil, f.noop, 0},
		{"row fencing, with the error raisers, reading the token (a text that sets the token itself)", nil, f.raisersSetting, 0},
		{"lock fencing, reading the token (registration + rewritten UPDATE)", nil, f.lockSetting, 1},
		{"hand-written registration + conditional UPDATE, the registration calling fenceproxy.register (what proxies sent before objects version 6)", nil, handRegisterCall + "; " + handUpdate, 1},
	})
	if err != nil {
		return err
	}
	if watched {
		// What the relay sends for a lock-fenced simple Query in a
		// database with the catalog watch: the check in front.
		check := fmt.Sprintf("CALL fenceproxy.catalog_at(%d);", stamp)
		more, err := countAll(c, settings, perByte, []countedStatement{
			{"the catalog check + hand-written registration + conditional UPDATE (a watched database's check in front of the hand-written statements)", nil, check + f.handLock, 1},
			{"lock fencing as the relay sends it in a watched database with objects before version 8 (two SET LOCALs, the catalog check, the registration, the rewritten UPDATE)", nil,
				"SET LOCAL fence.token = '42';SET LOCAL fence.lock = 'bench';" + check + f.lock, 1},
			{"lock fencing as the relay sends it in a watched database with objects version 8 (one call of fenceproxy.hold_at: the check and the registration by value; the rewritten UPDATE)", nil,
				holdAtCall(stamp) + f.raisers, 1},
			{"lock fencing as the relay sends it in a watched database with objects version 9 for a session whose registration of the same lock and token committed before (one call of fenceproxy.rehold_at: the check, the lock taken shared, one read of the watermark; the rewritten UPDATE)", nil,
				reholdAtCall(stamp) + f.raisers, 1},
		})
		if err != nil {
			return err
		}
		simple = append(simple, more...)
	}
	fmt.Println()
	fmt.Println("## instructions per statement (callgrind, single-user postgres, simple query and commit)")
	fmt.Println()
	fmt.Printf("(single-user mode reads its input at %.0f instructions per byte, which a server reading a message does not spend: taken out below as \"net\"; each row against its hand-written statement)\n\n", perByte)
	fmt.Println("| statement | bytes | instructions | net | net vs hand-written |")
	fmt.Println("|---|---|---|---|---|")
	for _, r := range simple {
		fmt.Printf("| %s | %d | %.0fk | %.0fk | %.2f |\n", r.name, len(r.sql), r.total/1000, r.net/1000, r.net/simple[r.base].net)
	}

	// Prepared: PREPARE once, then EXECUTE, as an extended-protocol
	// client's prepared statement runs: the analysis and planning that the
	// simple protocol repeats are paid once. Lock fencing registers before
	// each EXECUTE, as the proxy does before a prepared statement's Bind.
	// The parameter form's rows EXECUTE with the token as the parameter,
	// which is what the proxy's Bind carries; they are held against the
	// hand-written statement taking the token as a parameter too (rows 8
	// and 9), which costs the server more than one with it written in.
	const exec, execTok = "EXECUTE p", "EXECUTE p(42)"
	prep := func(sql string) []string { return []string{"PREPARE p AS " + sql + ";"} }
	prepTok := func(sql string) []string { return []string{"PREPARE p(bigint) AS " + sql + ";"} }
	prepared, err := countAll(c, settings, perByte, []countedStatement{
		{"hand-written conditional UPDATE", prep(f.hand), exec, 0},
		{"hand-written registration + conditional UPDATE", prep(f.hand), handCall + "; " + exec, 1},
		{"row fencing, inline form (no fenceproxy setup)", prep(f.inline), exec, 0},
		{"row fencing, inline form, prepared form (a named prepared statement, no fenceproxy setup)", prep(f.inlinePrepared), exec, 0},
		{"row fencing, with the error raisers (after fenceproxy setup)", prep(f.raisersSetting), exec, 0},
		{"row fencing, the form reading the setting (what SQL EXECUTE of a prepared statement gets, after fenceproxy setup)", prep(f.raisersPrepared), exec, 0},
		{"lock fencing, the form reading the setting (registration + EXECUTE)", prep(f.raisersPrepared), f.lockCall + "; " + exec, 1},
		{"row fencing's statement reading the token, calling no-op functions (the calls alone)", prep(f.noop), exec, 0},
		{"hand-written conditional UPDATE, the token a parameter", prepTok(handParam), execTok, 8},
		{"hand-written registration + conditional UPDATE, the token a parameter", prepTok(handParam), handCall + "; " + execTok, 9},
		{"row fencing, parameter form (a client's prepared statement, after fenceproxy setup: the token bound at each Bind)", prepTok(f.param), execTok, 8},
		{"lock fencing, parameter form (registration + EXECUTE)", prepTok(f.param), f.lockCall + "; " + execTok, 9},
	})
	if err != nil {
		return err
	}
	fmt.Println()
	fmt.Println("prepared (PREPARE once, then EXECUTE; the statement's analysis and planning are not repeated):")
	fmt.Println()
	fmt.Println("(last column: against the hand-written statement sent as a simple Query, above, which a simple-protocol client's repeated statement costs)")
	fmt.Println()
	fmt.Println("| statement | instructions per EXECUTE | net | net vs hand-written | net vs hand-written simple Query |")
	fmt.Println("|---|---|---|---|---|")
	for _, r := range prepared {
		sb := r.base % 8 // rows 8 and 9 take the token as a parameter; simple's are 0 and 1
		fmt.Printf("| %s | %.0fk | %.0fk | %.2f | %.2f |\n", r.name, r.total/1000, r.net/1000, r.net/prepared[r.base].net, r.net/simple[sb].net)
	}

	fmt.Println()
	fmt.Println("## what the server executes: fencing against the hand-written statements (net instructions, from the tables above)")
	fmt.Println()
	fmt.Printf("(target: ≤ %.2f× for row fencing after setup and for lock fencing, each against its hand-written statement; first sending: a simple Query; repeated: a prepared statement's EXECUTE, both sides prepared — fenceproxy parses its own prepared statement (auto_prepare) and the registration again at every use, which this does not count: the CPU table's rows through fenceproxy do)\n\n", serverTarget)
	fmt.Println("| fencing | sending | fenceproxy | hand-written | ratio | target |")
	fmt.Println("|---|---|---|---|---|---|")
	for _, t := range []struct {
		fencing, sending string
		fenced, hand     counted
	}{
		{"row (after setup)", "first (simple Query, the token written in)", simple[3], simple[0]},
		{"row (after setup)", "repeated (EXECUTE of the parameter form, against the hand-written statement taking the token as a parameter)", prepared[10], prepared[8]},
		{"row (after setup)", "repeated (the same, against the hand-written statement with the token written in)", prepared[10], prepared[0]},
		{"lock", "first (simple Query, the token written in)", simple[4], simple[1]},
		{"lock", "repeated (registration + EXECUTE of the parameter form, against the hand-written ones taking the token as a parameter)", prepared[11], prepared[9]},
		{"lock", "repeated (the same, against the hand-written ones with the token written in)", prepared[11], prepared[1]},
	} {
		ratio := t.fenced.net / t.hand.net
		fmt.Printf("| %s | %s | %.0fk | %.0fk | %.2f | ≤ %.2f: %s |\n", t.fencing, t.sending, t.fenced.net/1000, t.hand.net/1000,
			ratio, serverTarget, atMost(ratio, serverTarget, 2, ""))
	}
	if watched {
		// For information: the whole of what the relay sends in a watched
		// database, against the hand-written statements with the same
		// check in front.
		w := simple[len(simple)-4:]
		for _, r := range w[1:] {
			fmt.Printf("| lock, in a watched database (information) | first: %s | %.0fk | %.0fk | %.2f | |\n", r.name, r.net/1000, w[0].net/1000, r.net/w[0].net)
		}
	}
	return nil
}

// holdAtCall is the call of fenceproxy.hold_at that the relay puts in
// front of a lock-fenced simple Query of public.config in a watched
// database with objects version 8 (internal/proxy, holdAtQuery), for
// lock bench and token 42, the audit tag empty as in handCall (the
// relay builds its own text: a change of its form is made here too).
func holdAtCall(stamp int64) string {
	// E'…\n…': single-user postgres ends a statement at a line break,
	// which the relay's plain literal carries as it is.
	return fmt.Sprintf(`CALL fenceproxy.hold_at(%d, 'bench', '42', E'fence.token\nfence.lock\nf\nf\n\npublic.config');`, stamp)
}

// reholdAtCall is holdAtCall calling fenceproxy.rehold_at, which the
// relay calls in its place once the session's registration of the same
// lock and token committed (objects version 9).
func reholdAtCall(stamp int64) string {
	return strings.Replace(holdAtCall(stamp), "fenceproxy.hold_at(", "fenceproxy.rehold_at(", 1)
}
