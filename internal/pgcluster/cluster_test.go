package pgcluster_test

import (
	"bytes"
	"context"
	"errors"
	"io/fs"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/fenceproxy/fenceproxy/internal/pgcluster"
	"github.com/fenceproxy/fenceproxy/internal/pgcluster/pgtest"
	"github.com/fenceproxy/fenceproxy/internal/testcerts"
	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// A password that needs quoting in SQL and escaping in a URL.
const password = `s3cr'et \ p@ss:w/rd?#%`

// TestPasswordAuth runs one cluster per password method. The scram-sha-256
// cluster also serves TLS, to spare a cluster start.
func TestPasswordAuth(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	certs, err := testcerts.Generate(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	otherCA, err := testcerts.Generate(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		method     string
		storedAs   string // prefix of pg_authid.rolpassword
		tls        bool
		encryption string // for CreateUserWith; empty means CreateUser
	}{
		{method: "password", storedAs: "SCRAM-SHA-256$"},
		{method: "md5", storedAs: "md5"},
		{method: "scram-sha-256", storedAs: "SCRAM-SHA-256$", tls: true},
	}
	for _, tc := range tests {
		t.Run(tc.method, func(t *testing.T) {
			t.Parallel()
			opts := pgcluster.Options{AuthMethod: tc.method}
			if tc.tls {
				opts.TLS = &pgcluster.TLSFiles{CertFile: certs.CertFile, KeyFile: certs.KeyFile, CAFile: certs.CAFile}
			}
			c := pgtest.Start(t, opts)
			ctx := t.Context()
			if got := c.AuthMethod(); got != tc.method {
				t.Errorf("AuthMethod() = %q, want %q", got, tc.method)
			}
			if err := c.CreateUser(ctx, "alice", password); err != nil {
				t.Fatal(err)
			}
			if got := queryOne(t, c.SuperuserDSN("postgres"), "SELECT rolpassword FROM pg_authid WHERE rolname = 'alice'"); !strings.HasPrefix(got, tc.storedAs) {
				t.Errorf("stored password %.16q…, want prefix %q", got, tc.storedAs)
			}
			if got := queryOne(t, c.DSN("alice", password, "postgres"), "SELECT current_user"); got != "alice" {
				t.Errorf("current_user = %q, want alice", got)
			}
			wantAuthFailure(t, c.DSN("alice", password+"x", "postgres"))
			wantAuthFailure(t, c.DSN("alice", "", "postgres"))

			if tc.method == "md5" {
				// A SCRAM verifier under an md5 rule still authenticates:
				// the server upgrades to SCRAM.
				if err := c.CreateUserWith(ctx, "carol", password, "scram-sha-256"); err != nil {
					t.Fatal(err)
				}
				queryOne(t, c.DSN("carol", password, "postgres"), "SELECT 1")
				wantAuthFailure(t, c.DSN("carol", "wrong", "postgres"))
			}

			if !tc.tls {
				return
			}
			verifyFull := func(caFile string) string {
				u := c.URL("alice", password, "postgres")
				u.RawQuery = url.Values{"sslmode": {"verify-full"}, "sslrootcert": {caFile}}.Encode()
				return u.String()
			}
			const sslQuery = "SELECT ssl::text FROM pg_stat_ssl WHERE pid = pg_backend_pid()"
			if got := queryOne(t, verifyFull(certs.CAFile), sslQuery); got != "true" {
				t.Errorf("verify-full connection: ssl = %s, want true", got)
			}
			if got := queryOne(t, c.DSN("alice", password, "postgres"), sslQuery); got != "false" {
				t.Errorf("sslmode=disable connection: ssl = %s, want false", got)
			}
			conn, err := pgconn.Connect(ctx, verifyFull(otherCA.CAFile))
			if err == nil {
				conn.Close(ctx)
				t.Fatal("verify-full with a foreign CA connected")
			}
			if !strings.Contains(err.Error(), "certificate") {
				t.Errorf("verify-full with a foreign CA: %v, want a certificate error", err)
			}
		})
	}
}

// TestLifecycle covers trust auth, settings, restart with the data kept and
// Stop leaving nothing behind.
func TestLifecycle(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	ctx := t.Context()
	c, err := pgcluster.Start(ctx, pgcluster.Options{
		Settings: map[string]string{"work_mem": "8MB", "application_name": `it's \ quoted`},
		Logf:     t.Logf,
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Stop() })

	if c.Host() != "127.0.0.1" || c.Port() == 0 || c.Addr() != c.Host()+":"+strconv.Itoa(c.Port()) {
		t.Errorf("Host, Port, Addr = %q, %d, %q", c.Host(), c.Port(), c.Addr())
	}
	if _, err := os.Stat(filepath.Join(c.BinDir(), "initdb")); err != nil {
		t.Errorf("BinDir: %v", err)
	}
	su := c.SuperuserDSN("postgres")
	for setting, want := range map[string]string{
		"max_connections":  "200",
		"work_mem":         "8MB",
		"fsync":            "off",
		"application_name": `it's \ quoted`,
		"listen_addresses": "127.0.0.1",
	} {
		if got := queryOne(t, su, "SELECT current_setting('"+setting+"')"); got != want {
			t.Errorf("%s = %q, want %q", setting, got, want)
		}
	}

	// trust: any password, or none, is accepted.
	if err := c.CreateUser(ctx, "bob", ""); err != nil {
		t.Fatal(err)
	}
	queryOne(t, c.DSN("bob", "", "postgres"), "SELECT 1")
	queryOne(t, c.DSN("bob", "anything", "postgres"), "SELECT 1")

	const db = `fence "db"`
	if err := c.CreateDatabase(ctx, db); err != nil {
		t.Fatal(err)
	}
	if err := c.ExecDB(ctx, db, "CREATE TABLE kept (v text); INSERT INTO kept VALUES ('before restart')"); err != nil {
		t.Fatal(err)
	}
	err = c.Exec(ctx, "SELECT * FROM no_such_table")
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Code != "42P01" {
		t.Errorf("Exec of a bad query: %v, want SQLSTATE 42P01", err)
	}

	t.Run("dsn", func(t *testing.T) { testDSN(t, c) })

	t.Run("restart", func(t *testing.T) {
		pid, port := c.PID(), c.Port()
		procs := serverProcesses(t, pid)
		if err := c.StopServer(); err != nil {
			t.Fatal(err)
		}
		if c.PID() != 0 {
			t.Errorf("PID() = %d after StopServer", c.PID())
		}
		if left := alive(procs); len(left) > 0 {
			t.Errorf("processes %v alive after StopServer", left)
		}
		if conn, err := pgconn.Connect(ctx, su); err == nil {
			conn.Close(ctx)
			t.Error("connected to a stopped server")
		}
		if err := c.StopServer(); err != nil {
			t.Errorf("second StopServer: %v", err)
		}
		// Someone else on the port: StartServer retries, then reports it.
		l, err := net.Listen("tcp", c.Addr())
		if err != nil {
			t.Fatal(err)
		}
		err = c.StartServer(ctx)
		l.Close()
		if err == nil || !strings.Contains(err.Error(), "port already in use") {
			t.Fatalf("StartServer with the port taken: %v, want port already in use", err)
		}
		if err := c.StartServer(ctx); err != nil {
			t.Fatal(err)
		}
		if err := c.StartServer(ctx); err != nil {
			t.Errorf("StartServer while running: %v", err)
		}
		if c.Port() != port || c.PID() == 0 || c.PID() == pid {
			t.Errorf("after StartServer: port %d (was %d), pid %d (was %d)", c.Port(), port, c.PID(), pid)
		}
		if got := queryOne(t, c.SuperuserDSN(db), "SELECT v FROM kept"); got != "before restart" {
			t.Errorf("after restart: %q", got)
		}
	})

	t.Run("stop", func(t *testing.T) {
		root := filepath.Dir(c.DataDir())
		// A client session gives the postmaster a backend to take down too.
		conn, err := pgconn.Connect(ctx, su)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close(context.Background())
		procs := serverProcesses(t, c.PID())
		if err := c.Stop(); err != nil {
			t.Fatal(err)
		}
		if left := alive(procs); len(left) > 0 {
			t.Errorf("processes %v alive after Stop", left)
		}
		if _, err := os.Stat(root); !errors.Is(err, fs.ErrNotExist) {
			t.Errorf("%s after Stop: %v", root, err)
		}
		if err := c.Stop(); err != nil {
			t.Errorf("second Stop: %v", err)
		}
		if err := c.StartServer(ctx); !errors.Is(err, pgcluster.ErrStopped) {
			t.Errorf("StartServer after Stop: %v, want ErrStopped", err)
		}
	})
}

func TestStartErrors(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name string
		opts pgcluster.Options
		want string
	}{
		{"missing binaries", pgcluster.Options{BinDir: "/nonexistent"}, "PostgreSQL server binaries (initdb, postgres) not found in /nonexistent"},
		{"auth method", pgcluster.Options{AuthMethod: "ident"}, `unsupported AuthMethod "ident"`},
		{"managed setting", pgcluster.Options{Settings: map[string]string{"port": "5432"}}, `setting "port" is managed`},
		{"setting name", pgcluster.Options{Settings: map[string]string{"a = 1\nb": "2"}}, "invalid setting name"},
		{"TLS without key", pgcluster.Options{TLS: &pgcluster.TLSFiles{CertFile: "x"}}, "needs CertFile and KeyFile"},
		{"TLS file missing", pgcluster.Options{TLS: &pgcluster.TLSFiles{CertFile: "/nonexistent.crt", KeyFile: "/nonexistent.key"}}, "/nonexistent.crt"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			c, err := pgcluster.Start(t.Context(), tc.opts)
			if err == nil {
				c.Stop()
				t.Fatal("Start succeeded")
			}
			t.Log(err)
			if !strings.Contains(err.Error(), tc.want) {
				t.Errorf("Start: %v\nwant it to contain %q", err, tc.want)
			}
		})
	}
	_, err := pgcluster.Start(t.Context(), pgcluster.Options{BinDir: t.TempDir()})
	if !errors.Is(err, pgcluster.ErrBinariesNotFound) {
		t.Errorf("Start with an empty BinDir: %v, want ErrBinariesNotFound", err)
	}
}

// testDSN checks that DSNs parse back, with pgconn, into what was asked.
func testDSN(t *testing.T, c *pgcluster.Cluster) {
	tests := []struct {
		user, password, database string
		wantUserinfo             string
	}{
		{"alice", "pw", "postgres", "alice:pw@"},
		{"alice", "", "postgres", "alice@"},
		{"alice", password, `fence "db"/x`, ""},
	}
	for _, tc := range tests {
		dsn := c.DSN(tc.user, tc.password, tc.database)
		if !strings.Contains(dsn, "sslmode=disable") || (tc.wantUserinfo != "" && !strings.Contains(dsn, "//"+tc.wantUserinfo)) {
			t.Errorf("DSN = %q", dsn)
		}
		cfg, err := pgconn.ParseConfig(dsn)
		if err != nil {
			t.Fatalf("ParseConfig(%q): %v", dsn, err)
		}
		if cfg.User != tc.user || cfg.Password != tc.password || cfg.Database != tc.database || cfg.Host != "127.0.0.1" || int(cfg.Port) != c.Port() || cfg.TLSConfig != nil {
			t.Errorf("DSN %q parses as user %q password %q database %q host %q tls %v", dsn, cfg.User, cfg.Password, cfg.Database, cfg.Host, cfg.TLSConfig != nil)
		}
	}
}

// queryOne connects to dsn and returns the first column of the first row.
func queryOne(t *testing.T, dsn, sql string) string {
	t.Helper()
	ctx := t.Context()
	conn, err := pgconn.Connect(ctx, dsn)
	if err != nil {
		t.Fatalf("connect: %v", err)
	}
	defer conn.Close(context.Background())
	results, err := conn.Exec(ctx, sql).ReadAll()
	if err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
	if len(results) == 0 || len(results[0].Rows) == 0 {
		t.Fatalf("%s: no rows", sql)
	}
	return string(results[0].Rows[0][0])
}

// wantAuthFailure checks that dsn is refused with invalid_password.
func wantAuthFailure(t *testing.T, dsn string) {
	t.Helper()
	conn, err := pgconn.Connect(t.Context(), dsn)
	if err == nil {
		conn.Close(context.Background())
		t.Error("connected with a wrong password")
		return
	}
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Code != "28P01" {
		t.Errorf("connect with a wrong password: %v, want SQLSTATE 28P01", err)
	}
}

// serverProcesses returns the postmaster pid and its children's, read from
// /proc: the children call setsid, so the postmaster's process group does
// not hold them.
func serverProcesses(t *testing.T, postmaster int) []int {
	t.Helper()
	entries, err := os.ReadDir("/proc")
	if err != nil {
		t.Fatal(err)
	}
	pids := []int{postmaster}
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		stat, err := os.ReadFile(filepath.Join("/proc", e.Name(), "stat"))
		if err != nil {
			continue // exited meanwhile
		}
		// "pid (comm) state ppid …", where comm may hold spaces and parens.
		fields := strings.Fields(string(stat[bytes.LastIndexByte(stat, ')')+1:]))
		if len(fields) > 1 && fields[1] == strconv.Itoa(postmaster) {
			pids = append(pids, pid)
		}
	}
	// checkpointer, background writer, walwriter… and a client backend.
	if len(pids) < 4 {
		t.Fatalf("postmaster %d has processes %v, expected its children too", postmaster, pids)
	}
	return pids
}

// alive returns the pids that still exist.
func alive(pids []int) []int {
	var left []int
	for _, pid := range pids {
		if !errors.Is(syscall.Kill(pid, 0), syscall.ESRCH) {
			left = append(left, pid)
		}
	}
	return left
}
