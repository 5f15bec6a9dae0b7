package main

import (
	"context"
	"fmt"
	"os"
	"sort"
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5"

	"github.com/fenceproxy/fenceproxy/internal/rules"
)

// Server CPU per statement: each statement runs many times on one
// connection straight to PostgreSQL (simple protocol), and the backend
// process's CPU time (backendCPU) before and after
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
			before, err := backendCPU(pid)
			if err != nil {
				return nil, err
			}
			for k := 0; k < n; k++ {
				if _, err := conn.Exec(ctx, st.sql); err != nil {
					return nil, fmt.Errorf("%s: %w", st.name, err)
				}
			}
			after, err := backendCPU(pid)
			if err != nil {
				return nil, err
			}
			per[i] = append(per[i], (after-before)/float64(n))
		}
	}
	out := make([]float64, len(stmts))
	for i := range per {
		sort.Float64s(per[i])
		out[i] = per[i][len(per[i])/2]
	}
	return out, nil
}

// backendCPU returns a PostgreSQL backend's CPU time in µs: the
// scheduler's count of the time it ran (/proc/<pid>/schedstat, in
// nanoseconds) where the kernel keeps one, else procCPU, whose clock
// ticks are too coarse for a short round (at 300 statements a tick is
// 33 µs per statement, and a fast statement may cross none). schedstat
// counts one thread, which a backend is.
func backendCPU(pid int) (float64, error) {
	if b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/schedstat"); err == nil {
		if f := strings.Fields(string(b)); len(f) > 0 {
			if ns, err := strconv.ParseInt(f[0], 10, 64); err == nil && ns > 0 {
				return float64(ns) / 1000, nil
			}
		}
	}
	return procCPU(pid)
}

// procCPU returns a process's utime+stime, all its threads, in µs
// (USER_HZ is 100 on Linux).
func procCPU(pid int) (float64, error) {
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
	return float64(ut+st) * 10000, nil
}

// handCall is the registration written by hand: the call of
// fenceproxy.hold (internal/dbsetup/objects.sql; register's common case,
// cheaper, from objects version 6) that the proxy runs before a
// lock-fenced statement of public.config, with the session's lock name and
// token read from fence.lock and fence.token. A client registering by hand
// calls the cheapest procedure setup installs, so the comparison is like
// for like; handRegisterCall is the call of register, which proxies before
// version 6 sent, measured beside it.
const handCall = "CALL fenceproxy.hold('fence.lock', 'fence.token', false, false, '', 'public.config')"

// handRegisterCall is handCall calling fenceproxy.register.
const handRegisterCall = "CALL fenceproxy.register('fence.lock', 'fence.token', false, false, '', 'public.config')"

// handUpdate is the hand-written conditional UPDATE (token 42).
const handUpdate = "UPDATE config SET counter = counter + 1, last_fence = 42 WHERE id = 7 AND last_fence <= 42"

// handParam is handUpdate taking the token as its parameter, as a
// prepared statement written by hand does (pgbench -M prepared's own
// scripts bind every value).
const handParam = "UPDATE config SET counter = counter + 1, last_fence = $1 WHERE id = 7 AND last_fence <= $1"

// fencedForms are the statements whose cost to the server the bench
// compares: the client's UPDATE in the forms fenceproxy sends it, and the
// hand-written statements they are held against.
type fencedForms struct {
	client string
	// hand is handUpdate; handLock the registration and it in one simple
	// Query, which PostgreSQL runs as one transaction, as the proxy sends
	// lock.
	hand, handLock string
	// inline and raisers: row fencing without and after fenceproxy setup;
	// lock: the registration and raisers in one simple Query; lockCall the
	// registration alone, as the proxy sends it before a prepared
	// statement. raisers and lock are the token forms (token 42), which
	// the proxy sends for a simple Query in a session with a valid token;
	// raisersSetting and lockSetting the forms that read the token on the
	// server, which it sends when the text itself changes the token (and
	// which a PREPARE gets).
	inline, raisers, lock, lockCall string
	raisersSetting, lockSetting     string
	// The forms a named prepared statement gets: without fenceproxy
	// setup, rules.Prepared's; after it, param, the token form with the
	// token its parameter $1 (TokenForm.ParamText), which the proxy binds
	// at each Bind, and raisersPrepared, the form reading the setting
	// that SQL EXECUTE gets.
	inlinePrepared, raisersPrepared, param string
	// noop is raisersSetting calling functions of the same signatures that only
	// return a constant (setupObjects): what the two calls cost whatever
	// the functions do.
	noop string
}

// newFencedForms decides the client's UPDATE of public.config as the
// proxy does.
func newFencedForms() (fencedForms, error) {
	rs, err := rules.Compile(rules.Config{Tables: []rules.Table{{Table: "public.config"}}})
	if err != nil {
		return fencedForms{}, err
	}
	f := fencedForms{client: "UPDATE config SET counter = counter + 1 WHERE id = 7", hand: handUpdate}
	f.handLock = handCall + "; " + handUpdate
	d := rs.Decide(f.client)
	if d.Action != rules.Rewrite || d.Lock == nil {
		return f, fmt.Errorf("server cost: unexpected decision %v", d.Action)
	}
	// The set a session uses in a database with objects version 6: its
	// token form raises a stale row's error with fenceproxy.stale_at, its
	// registrations call fenceproxy.hold.
	fd := rs.ServerFunctions().StaleAt().Hold().Decide(f.client)
	if fd.Action != rules.Rewrite || fd.Lock == nil {
		return f, fmt.Errorf("server cost: unexpected decision %v", fd.Action)
	}
	pd, pi := rs.ServerFunctions().Prepared().Hold().Decide(f.client), rs.Prepared().Decide(f.client)
	if pd.Action != rules.Rewrite || pd.SQL == fd.SQL || pi.Action != rules.Rewrite || pi.SQL == d.SQL {
		return f, fmt.Errorf("server cost: no prepared form (%v, %v)", pd.Action, pi.Action)
	}
	if pd.Lock == nil || pd.Lock.Call == "" {
		return f, fmt.Errorf("server cost: no registration for the prepared form")
	}
	f.inline, f.raisersSetting, f.lockSetting, f.lockCall = d.SQL, fd.SQL, fd.Lock.Query, pd.Lock.Call
	var ok1, ok2 bool
	f.raisers, ok1 = fd.Tok.Fill(fd.SQL, "42")
	f.lock, ok2 = fd.Tok.Fill(fd.Lock.Query, "42")
	if !ok1 || !ok2 {
		return f, fmt.Errorf("server cost: no token form")
	}
	f.inlinePrepared, f.raisersPrepared = pi.SQL, pd.SQL
	// The set a Parse is decided in for its parameter form.
	td := rs.ServerFunctions().Decide(f.client)
	if td.Action != rules.Rewrite || td.Tok == nil {
		return f, fmt.Errorf("server cost: no token form to bind the token to")
	}
	var k int
	f.param, k, ok1 = td.Tok.ParamText(0)
	if !ok1 || k != 1 {
		return f, fmt.Errorf("server cost: no parameter form (%v, $%d)", ok1, k)
	}
	f.noop = strings.ReplaceAll(f.raisersSetting, "fenceproxy.", noopSchema+".")
	if f.lockCall != handCall {
		// Still measured: the hand-written baseline is what a client
		// writes, whatever the proxy's call has become.
		fmt.Printf("\n(the proxy's registration is now %s; the hand-written one is %s)\n", f.lockCall, handCall)
	}
	return f, nil
}

// serverTarget is the server-cost target: a fenced form against its
// hand-written statement.
const serverTarget = 1.10

// serverCPUTable prints the server's CPU per fenced statement against its
// hand-written statement: the rewritten UPDATE as the proxy sends it (row
// fencing) against the conditional UPDATE, and with the lock registration
// before it (lock fencing, as one simple Query) against the registration
// written by hand and the conditional UPDATE. Each row runs n statements
// in each of three rounds.
func serverCPUTable(ctx context.Context, dsn, proxyDSN string, f fencedForms, n int) error {
	type row struct {
		cpuStatement
		base   int  // the row compared with (itself for a baseline)
		target bool // whether serverTarget applies
	}
	rows := []row{
		{cpuStatement{"hand-written conditional UPDATE", f.hand}, 0, false},
		{cpuStatement{"hand-written registration + conditional UPDATE (one simple Query, one transaction)", f.handLock}, 1, false},
		{cpuStatement{"row fencing, inline form (no fenceproxy setup)", f.inline}, 0, false},
		{cpuStatement{"row fencing, with the error raisers (after fenceproxy setup), the token written in", f.raisers}, 0, true},
		{cpuStatement{"lock fencing (registration + rewritten UPDATE, the token written in)", f.lock}, 1, true},
		{cpuStatement{"row fencing's statement reading the token, calling no-op functions (the calls alone)", f.noop}, 0, false},
		{cpuStatement{"row fencing, with the error raisers, reading the token (a text that sets the token itself)", f.raisersSetting}, 0, false},
	}
	stmts := make([]cpuStatement, len(rows))
	for i, r := range rows {
		stmts[i] = r.cpuStatement
	}
	us, err := serverCPU(ctx, dsn, map[string]string{"fence.token": "42", "fence.lock": "bench", "synchronous_commit": "off"}, stmts, n, 3)
	if err != nil {
		return err
	}
	// The client's statement sent through fenceproxy, again and again in
	// one session, as pgbench -M simple does, through a proxy with
	// auto_prepare: from the second time on the proxy runs it as its own
	// prepared statement.
	viaProxy := []struct {
		row
		settings map[string]string
	}{
		{row{cpuStatement{"row fencing through fenceproxy with auto_prepare, the same simple Query again (the proxy's prepared statement)", f.client}, 0, true},
			map[string]string{"fence.token": "42", "synchronous_commit": "off"}},
		{row{cpuStatement{"lock fencing through fenceproxy with auto_prepare, the same simple Query again (registration + the proxy's prepared statement)", f.client}, 1, true},
			map[string]string{"fence.token": "42", "fence.lock": "bench", "synchronous_commit": "off"}},
	}
	for _, v := range viaProxy {
		u, err := serverCPU(ctx, proxyDSN, v.settings, []cpuStatement{v.cpuStatement}, n, 3)
		if err != nil {
			return err
		}
		rows = append(rows, v.row)
		us = append(us, u[0])
	}
	fmt.Println()
	fmt.Println("## server CPU per statement (PostgreSQL backend CPU time, simple protocol, synchronous_commit off, median of 3)")
	fmt.Println()
	fmt.Println("(each row against its hand-written statement: row fencing against the conditional UPDATE, lock fencing against the registration and the conditional UPDATE; CPU times move with the machine's load: the instruction counts below are the target's measure)")
	fmt.Println()
	fmt.Println("| statement | CPU per statement | vs hand-written | target |")
	fmt.Println("|---|---|---|---|")
	for i, r := range rows {
		target := ""
		if r.target {
			target = fmt.Sprintf("≤ %.2f: %s", serverTarget, atMost(us[i]/us[r.base], serverTarget, 2, ""))
		}
		fmt.Printf("| %s | %.1f µs | %.2f | %s |\n", r.name, us[i], us[i]/us[r.base], target)
	}
	return nil
}
