package proxy_test

import (
	"bytes"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/lib/pq"

	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/proxytest"
	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// openPQ opens a lib/pq database/sql handle and closes it when the test
// ends.
func openPQ(t testing.TB, dsn string) *sql.DB {
	t.Helper()
	db, err := sql.Open("postgres", dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = db.Close() })
	return db
}

// pqCode returns the SQLSTATE of a lib/pq error, or "".
func pqCode(err error) string {
	var pqErr *pq.Error
	if errors.As(err, &pqErr) {
		return string(pqErr.Code)
	}
	return ""
}

// TestLibPQ runs lib/pq through database/sql: parameterised queries (lib/pq
// uses the unnamed statement of the extended protocol), errors, and
// transactions that commit and roll back.
func TestLibPQ(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	p := startProxy(t, proxy.Options{})
	db := openPQ(t, superDSN(p))
	db.SetMaxOpenConns(3)
	ctx := ctxT(t)
	table := newTable(t, "id int PRIMARY KEY, name text")

	if err := db.PingContext(ctx); err != nil {
		t.Fatal(err)
	}
	for i := range 10 {
		if _, err := db.ExecContext(ctx, "INSERT INTO "+table+" VALUES ($1, $2)", i, fmt.Sprintf("name %d", i)); err != nil {
			t.Fatal(err)
		}
	}
	rows, err := db.QueryContext(ctx, "SELECT id, name FROM "+table+" WHERE id >= $1 ORDER BY id", 5)
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for rows.Next() {
		var (
			id   int
			name string
		)
		if err := rows.Scan(&id, &name); err != nil {
			t.Fatal(err)
		}
		got = append(got, fmt.Sprintf("%d=%s", id, name))
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	if want := "5=name 5,6=name 6,7=name 7,8=name 8,9=name 9"; strings.Join(got, ",") != want {
		t.Errorf("got %v, want %s", got, want)
	}

	// A prepared statement (named, in lib/pq) used several times.
	stmt, err := db.PrepareContext(ctx, "SELECT name FROM "+table+" WHERE id = $1")
	if err != nil {
		t.Fatal(err)
	}
	for i := range 3 {
		var name string
		if err := stmt.QueryRowContext(ctx, i).Scan(&name); err != nil || name != fmt.Sprintf("name %d", i) {
			t.Fatalf("prepared select %d = %q, %v", i, name, err)
		}
	}
	if err := stmt.Close(); err != nil {
		t.Fatal(err)
	}

	_, err = db.ExecContext(ctx, "INSERT INTO "+table+" VALUES ($1, 'dup')", 1)
	if code := pqCode(err); code != "23505" {
		t.Fatalf("duplicate insert: %v (SQLSTATE %q), want 23505", err, code)
	}

	count := func() int {
		var n int
		if err := db.QueryRowContext(ctx, "SELECT count(*) FROM "+table).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.ExecContext(ctx, "INSERT INTO "+table+" VALUES ($1, 'rolled back')", 100); err != nil {
		t.Fatal(err)
	}
	if err := tx.Rollback(); err != nil {
		t.Fatal(err)
	}
	if n := count(); n != 10 {
		t.Fatalf("%d rows after rollback, want 10", n)
	}
	tx, err = db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.ExecContext(ctx, "INSERT INTO "+table+" VALUES ($1, 'committed')", 101); err != nil {
		t.Fatal(err)
	}
	var inTx int
	if err := tx.QueryRowContext(ctx, "SELECT count(*) FROM "+table).Scan(&inTx); err != nil || inTx != 11 {
		t.Fatalf("count inside transaction = %d, %v", inTx, err)
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	if n := count(); n != 11 {
		t.Fatalf("%d rows after commit, want 11", n)
	}
}

// clientBinary finds a PostgreSQL client program: in the cluster's BinDir,
// then on PATH. It fails the test, never skips, when there is none.
func clientBinary(t testing.TB, name string) string {
	t.Helper()
	path := filepath.Join(cluster.BinDir(), name)
	if _, err := os.Stat(path); err == nil {
		return path
	}
	path, err := exec.LookPath(name)
	if err != nil {
		t.Fatalf("%s not found in %s or on PATH: install the PostgreSQL client programs (e.g. apt-get install postgresql-client)", name, cluster.BinDir())
	}
	return path
}

// runClient runs a client program with a timeout and the libpq environment
// pointing at the proxy (plus env, which may override it), and returns its
// combined output.
func runClient(t testing.TB, p *proxytest.Proxy, env []string, dir, bin string, args ...string) (string, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 90*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, bin, args...)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(),
		"PGHOST="+p.Host(),
		"PGPORT="+strconv.Itoa(p.Port()),
		"PGUSER=postgres",
		"PGSSLMODE=disable",
		"PGCONNECT_TIMEOUT=10",
		"PGAPPNAME=fenceproxy-test",
		"PGOPTIONS=",
		"PSQLRC=/dev/null",
	)
	cmd.Env = append(cmd.Env, env...)
	var out bytes.Buffer
	cmd.Stdout = &out
	cmd.Stderr = &out
	err := cmd.Run()
	return out.String(), err
}

// TestPsql runs a psql script through the proxy: DDL, DML, queries, and
// \copy in both directions (COPY FROM STDIN / TO STDOUT).
func TestPsql(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	psql := clientBinary(t, "psql")
	p := startProxy(t, proxy.Options{})
	dir := t.TempDir()
	var in strings.Builder
	for i := 3; i <= 1002; i++ {
		fmt.Fprintf(&in, "%d,\"row, %d\"\n", i, i)
	}
	if err := os.WriteFile(filepath.Join(dir, "in.csv"), []byte(in.String()), 0o644); err != nil {
		t.Fatal(err)
	}
	table := fmt.Sprintf("psql_items_%d", tableSeq.Add(1))
	script := strings.ReplaceAll(`
CREATE TABLE psql_items (id int PRIMARY KEY, name text);
INSERT INTO psql_items VALUES (1, 'one'), (2, 'two');
SELECT 'first:' || name FROM psql_items ORDER BY id LIMIT 1;
\copy psql_items FROM 'in.csv' WITH (FORMAT csv)
SELECT 'count:' || count(*) FROM psql_items;
\copy (SELECT * FROM psql_items ORDER BY id) TO 'out.csv' WITH (FORMAT csv)
BEGIN;
DELETE FROM psql_items;
ROLLBACK;
SELECT 'after-rollback:' || count(*) FROM psql_items;
SELECT 'multi:1' \; SELECT 'multi:2';
DROP TABLE psql_items;
`, "psql_items", table)
	if err := os.WriteFile(filepath.Join(dir, "script.sql"), []byte(script), 0o644); err != nil {
		t.Fatal(err)
	}
	out, err := runClient(t, p, nil, dir, psql, "-X", "-q", "-A", "-t", "-v", "ON_ERROR_STOP=1",
		"-d", "postgres", "-f", "script.sql")
	if err != nil {
		t.Fatalf("psql: %v\n%s", err, out)
	}
	want := "first:one\ncount:1002\nafter-rollback:1002\nmulti:1\nmulti:2\n"
	if out != want {
		t.Errorf("psql printed\n%s\nwant\n%s", out, want)
	}
	got, err := os.ReadFile(filepath.Join(dir, "out.csv"))
	if err != nil {
		t.Fatal(err)
	}
	wantCSV := "1,one\n2,two\n" + in.String()
	if string(got) != wantCSV {
		t.Errorf("\\copy out wrote %d bytes, want %d:\n%.200s", len(got), len(wantCSV), got)
	}

	// ON_ERROR_STOP: an error ends psql with status 3 and the server's
	// message.
	out, err = runClient(t, p, nil, dir, psql, "-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", "postgres",
		"-c", "SELECT 1/0")
	var ee *exec.ExitError
	if !errors.As(err, &ee) || ee.ExitCode() != 1 && ee.ExitCode() != 3 {
		t.Errorf("psql with a failing command: %v, want exit status 1 or 3\n%s", err, out)
	}
	if !strings.Contains(out, "division by zero") {
		t.Errorf("psql output lacks the server error:\n%s", out)
	}
}

var (
	failedTxRE = regexp.MustCompile(`number of failed transactions: (\d+)`)
	tpsRE      = regexp.MustCompile(`(?m)^tps = ([0-9.]+)`)
)

// TestPgbench initialises a pgbench database through the proxy (which
// loads it with COPY) and runs the TPC-B-like script in each query mode.
func TestPgbench(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	pgbench := clientBinary(t, "pgbench")
	p := startProxy(t, proxy.Options{})
	db := fmt.Sprintf("pgbench_%d", tableSeq.Add(1))
	if err := cluster.CreateDatabase(ctxT(t), db); err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	out, err := runClient(t, p, nil, dir, pgbench, "-i", "-s", "1", "-q", db)
	if err != nil {
		t.Fatalf("pgbench -i: %v\n%s", err, out)
	}
	var accounts int
	if err := connect(t, p.DSN("postgres", "", db)).QueryRow(ctxT(t), "SELECT count(*) FROM pgbench_accounts").Scan(&accounts); err != nil || accounts != 100000 {
		t.Fatalf("pgbench_accounts has %d rows, %v; want 100000", accounts, err)
	}

	duration := "3"
	if testing.Short() {
		duration = "1"
	}
	for _, mode := range []string{"simple", "extended", "prepared"} {
		t.Run(mode, func(t *testing.T) {
			out, err := runClient(t, p, nil, dir, pgbench, "-M", mode, "-c", "4", "-j", "2", "-T", duration, db)
			if err != nil {
				t.Fatalf("pgbench -M %s: %v\n%s", mode, err, out)
			}
			if m := failedTxRE.FindStringSubmatch(out); m == nil || m[1] != "0" {
				t.Errorf("pgbench -M %s: want 0 failed transactions in\n%s", mode, out)
			}
			for line := range strings.Lines(out) {
				if strings.Contains(strings.ToLower(line), "error") {
					t.Errorf("pgbench -M %s reported: %s", mode, line)
				}
			}
			m := tpsRE.FindStringSubmatch(out)
			if m == nil {
				t.Fatalf("pgbench -M %s: no tps line in\n%s", mode, out)
			}
			if tps, err := strconv.ParseFloat(m[1], 64); err != nil || tps <= 0 {
				t.Errorf("pgbench -M %s: tps = %s", mode, m[1])
			}
			t.Logf("pgbench -M %s: tps = %s", mode, m[1])
		})
	}
	waitFor(t, "pgbench sessions to end", func() bool { return p.Server.ActiveSessions() <= 1 })
}
