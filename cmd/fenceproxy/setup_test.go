package main

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/fenceproxy/fenceproxy/internal/pgcluster"
	"github.com/fenceproxy/fenceproxy/internal/pgcluster/pgtest"
)

// runCommand runs `fenceproxy ARGS` in-process.
func runCommand(t *testing.T, args ...string) (code int, stdout, stderr string) {
	t.Helper()
	var out, errOut strings.Builder
	code = runMain(args, strings.NewReader(""), &out, &errOut)
	t.Logf("fenceproxy %s: exit %d\n%s%s", strings.Join(args, " "), code, out.String(), errOut.String())
	return code, out.String(), errOut.String()
}

func writeConfig(t *testing.T, name, text string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), name)
	if err := os.WriteFile(path, []byte(text), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

// TestSetupAndCheckCommands walks a database from nothing to ready with
// fenceproxy setup, checking with fenceproxy check (and its exit status)
// at each step.
func TestSetupAndCheckCommands(t *testing.T) {
	pg := pgtest.Start(t, pgcluster.Options{})
	ctx := t.Context()
	if err := pg.CreateDatabase(ctx, "app"); err != nil {
		t.Fatal(err)
	}
	if err := pg.ExecDB(ctx, "app", "CREATE TABLE config (id int PRIMARY KEY, payload text)"); err != nil {
		t.Fatal(err)
	}
	// Connected to like the audit connection: user postgres at
	// upstream.address.
	cfg := writeConfig(t, "fenceproxy.yaml", fmt.Sprintf(`
upstream:
  address: %s
tables:
  - table: public.config
    scope:
      databases: [app]
`, pg.Addr()))

	type step struct {
		name     string
		args     []string
		sql      string // run in app before the command
		wantCode int
		want     []string // in stdout, in this order
	}
	for _, s := range []step{
		{
			name: "check before setup", args: []string{"check", "-c", cfg}, wantCode: 1,
			want: []string{
				"database app: 2 problems",
				"(database): the fenceproxy schema is missing",
				"fix: fenceproxy setup -c " + cfg + "\n",
				"public.config: fence column last_fence is missing",
				"fix: fenceproxy setup -c " + cfg + " --add-columns (or in SQL: ALTER TABLE public.config ADD COLUMN last_fence bigint NOT NULL DEFAULT 0;)",
				"  error raisers: not usable (missing, changed, not callable by all, or changeable by other roles): fenceproxy setup installs them",
			},
		},
		{
			name: "setup without columns", args: []string{"setup", "-c", cfg}, wantCode: 0,
			want: []string{
				"database app:\n  created the fenceproxy schema and objects (version 10)\n",
				"note: public.config: fence column last_fence is missing: setup adds it with --add-columns",
			},
		},
		{
			name: "check: the column is missing", args: []string{"check", "-c", cfg}, wantCode: 1,
			want: []string{"database app: 1 problem\n", "public.config: fence column last_fence is missing"},
		},
		{
			name: "setup --add-columns", args: []string{"setup", "-c", cfg, "--add-columns"}, wantCode: 0,
			want: []string{"database app:\n  added column last_fence bigint NOT NULL DEFAULT 0 to public.config\n"},
		},
		{
			name: "setup again", args: []string{"setup", "-c", cfg, "--add-columns"}, wantCode: 0,
			want: []string{"database app: nothing to do\n"},
		},
		{
			name: "check passes", args: []string{"check", "-c", cfg}, wantCode: 0,
			want: []string{"database app: ok\n", "  error raisers: in place"},
		},
		{
			name: "check: a role lacks the register procedure",
			sql: `CREATE ROLE worker LOGIN; GRANT SELECT, UPDATE ON config TO worker;
				REVOKE EXECUTE ON PROCEDURE fenceproxy.register(text, text, boolean, boolean, text, text) FROM PUBLIC`,
			args: []string{"check", "-c", cfg}, wantCode: 1,
			want: []string{
				"public.config: login role worker may SELECT, UPDATE the table but lacks EXECUTE on procedure fenceproxy.register",
				"fix: GRANT EXECUTE ON PROCEDURE fenceproxy.register(text, text, boolean, boolean, text, text) TO worker;",
			},
		},
		{
			name: "check with --dsn and --database",
			sql:  "GRANT EXECUTE ON PROCEDURE fenceproxy.register(text, text, boolean, boolean, text, text) TO worker",
			args: []string{"check", "-c", cfg, "--dsn", pg.SuperuserDSN("postgres"), "--database", "app"}, wantCode: 0,
			want: []string{"database app: ok\n"},
		},
	} {
		if s.sql != "" {
			if err := pg.ExecDB(ctx, "app", s.sql); err != nil {
				t.Fatal(err)
			}
		}
		runStep(t, s.name, s.args, s.wantCode, s.want)
	}
}

// TestCheckCommandErrors: what keeps check from running exits 3 with a
// message, and never prints the DSN.
func TestCheckCommandErrors(t *testing.T) {
	unreachable := writeConfig(t, "unreachable.yaml", `
upstream:
  address: 127.0.0.1:1
tables:
  - table: public.config
    scope:
      databases: [app]
`)
	rulesOnly := writeConfig(t, "rules.yaml", `
tables:
  - table: public.config
`)
	for _, tc := range []struct {
		name string
		args []string
		want string // in stderr
	}{
		{"connection refused", []string{"check", "-c", unreachable}, `fenceproxy check: database "app": cannot connect: `},
		// Without upstream.address, audit.dsn or --dsn: the PG*
		// environment (set in the test below).
		{"no upstream", []string{"check", "-c", rulesOnly}, `fenceproxy check: database "app": cannot connect: `},
		// libpq's default database: the user name.
		{"no database", []string{"check", "-c", rulesOnly, "--dsn", "postgres://u:secret@127.0.0.1:1/?sslmode=disable"}, `fenceproxy check: database "u": cannot connect: `},
		{"bad dsn", []string{"check", "-c", rulesOnly, "--dsn", "postgres://u:secret@127.0.0.1:x/"}, "--dsn: not a valid connection string"},
		{"no config", []string{"check", "-c", filepath.Join(t.TempDir(), "absent.yaml")}, "no such file"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Setenv("PGHOST", "127.0.0.1")
			t.Setenv("PGPORT", "1")
			t.Setenv("PGPASSWORD", "secret")
			if tc.name == "no upstream" {
				t.Setenv("PGDATABASE", "app")
			}
			code, _, stderr := runCommand(t, tc.args...)
			if code != exitNotChecked || !strings.Contains(stderr, tc.want) {
				t.Errorf("exit %d, stderr %q; want %d and %q", code, stderr, exitNotChecked, tc.want)
			}
			if strings.Contains(stderr, "secret") {
				t.Errorf("stderr shows the password: %s", stderr)
			}
		})
	}
	if code, _, stderr := runCommand(t, "setup", "-c", unreachable); code != exitFailed || !strings.Contains(stderr, "cannot connect") {
		t.Errorf("setup with the server unreachable: exit %d, %q", code, stderr)
	}
}

// TestSetupGuardCommand: setup --guard installs the database guard with
// the exempt roles of guard.exempt_roles, check reports it guarded and,
// once the configuration changes, outdated with the command that fixes
// it; setup without --guard leaves it; --remove-guard removes it.
func TestSetupGuardCommand(t *testing.T) {
	pg := pgtest.Start(t, pgcluster.Options{})
	ctx := t.Context()
	if err := pg.CreateDatabase(ctx, "app"); err != nil {
		t.Fatal(err)
	}
	if err := pg.ExecDB(ctx, "app", `CREATE TABLE config (id int PRIMARY KEY, last_fence bigint NOT NULL DEFAULT 0);
		CREATE ROLE migrations NOLOGIN`); err != nil {
		t.Fatal(err)
	}
	config := func(onStale string) string {
		return fmt.Sprintf(`
upstream:
  address: %s
token_setting: app.token
tables:
  - table: public.config
    on_stale: %s
    scope:
      databases: [app]
guard:
  exempt_roles: [migrations]
`, pg.Addr(), onStale)
	}
	cfg := writeConfig(t, "fenceproxy.yaml", config("error"))
	changed := writeConfig(t, "changed.yaml", config("skip"))

	for _, s := range []struct {
		name     string
		args     []string
		wantCode int
		want     []string // in stdout, in this order
	}{
		{
			name: "setup --guard", args: []string{"setup", "-c", cfg, "--guard"},
			want: []string{
				"database app:\n  created the fenceproxy schema and objects (version 10)\n",
				"  installed the database guard (its functions and table fenceproxy.guard_exempt)\n",
				"  set the roles the guard exempts to migrations\n",
				"  installed the guard on public.config\n",
			},
		},
		{name: "setup --guard again", args: []string{"setup", "-c", cfg, "--guard"}, want: []string{"database app: nothing to do\n"}},
		{name: "check", args: []string{"check", "-c", cfg}, want: []string{"database app: ok\n", "  guarded: public.config\n"}},
		{
			name: "check after on_stale changed", args: []string{"check", "-c", changed}, wantCode: 1,
			want: []string{
				"database app: 1 problem\n",
				`public.config: the database guard on this table is not as the configuration needs: function fenceproxy."guard_public.config" was made for an earlier configuration (guard of "public.config": column "last_fence", lock optional, on_stale error, strict false, missing_token reject, token_setting "app.token", lock_setting "fence.lock"); it now needs guard of "public.config": column "last_fence", lock optional, on_stale skip, `,
				"fix: fenceproxy setup -c " + changed + " --guard\n",
			},
		},
		{
			name: "setup without --guard", args: []string{"setup", "-c", changed},
			want: []string{"database app: nothing to do\n", "  note: the database guard is installed on public.config and was left as it is"},
		},
		{name: "setup --guard after the change", args: []string{"setup", "-c", changed, "--guard"}, want: []string{"database app:\n  updated the guard on public.config\n"}},
		{name: "both flags", args: []string{"setup", "-c", changed, "--guard", "--remove-guard"}, wantCode: exitUsage},
		{
			name: "setup --remove-guard", args: []string{"setup", "-c", changed, "--remove-guard"},
			want: []string{"database app:\n  removed the guard's event triggers (fenceproxy_guard_ddl, fenceproxy_guard_rewrite)\n  removed the guard from public.config\n  removed the database guard's functions and its table of exempt roles\n"},
		},
		{name: "check after removal", args: []string{"check", "-c", changed}, want: []string{"database app: ok\n"}},
	} {
		runStep(t, s.name, s.args, s.wantCode, s.want)
	}
}

// runStep runs the fenceproxy command args and checks its exit code and
// that its standard output holds want, in this order.
func runStep(t *testing.T, name string, args []string, wantCode int, want []string) {
	t.Helper()
	code, stdout, _ := runCommand(t, args...)
	if code != wantCode {
		t.Errorf("%s: exit %d, want %d", name, code, wantCode)
	}
	rest := stdout
	for _, w := range want {
		i := strings.Index(rest, w)
		if i < 0 {
			t.Errorf("%s: output lacks %q (in order):\n%s", name, w, stdout)
			return
		}
		rest = rest[i+len(w):]
	}
}

// TestSetupExampleConfig: setup and check work with config.example.yaml as
// it is (one table, no scope.databases), in the database libpq would use:
// the user's (postgres), or $PGDATABASE; as $PGUSER; and say so. Entries
// with scope.databases still name theirs.
func TestSetupExampleConfig(t *testing.T) {
	pg := pgtest.Start(t, pgcluster.Options{})
	ctx := t.Context()
	example, err := os.ReadFile("../../config.example.yaml")
	if err != nil {
		t.Fatal(err)
	}
	text := strings.Replace(string(example), "  address: 127.0.0.1:5432\n", "  address: "+pg.Addr()+"\n", 1)
	if text == string(example) {
		t.Fatal("config.example.yaml: no upstream address to replace")
	}
	cfg := writeConfig(t, "fenceproxy.yaml", text)
	for _, db := range []string{"postgres", "app"} {
		if db != "postgres" {
			if err := pg.CreateDatabase(ctx, db); err != nil {
				t.Fatal(err)
			}
		}
		if err := pg.ExecDB(ctx, db, "CREATE TABLE config (id int PRIMARY KEY, payload text)"); err != nil {
			t.Fatal(err)
		}
	}
	if err := pg.ExecDB(ctx, "postgres", "CREATE ROLE admin LOGIN SUPERUSER"); err != nil {
		t.Fatal(err)
	}
	if err := pg.CreateDatabase(ctx, "admin"); err != nil {
		t.Fatal(err)
	}
	if err := pg.ExecDB(ctx, "admin", "CREATE TABLE config (id int PRIMARY KEY)"); err != nil {
		t.Fatal(err)
	}
	const why = "tables without scope.databases (public.config): database "
	runStep(t, "check before setup", []string{"check", "-c", cfg}, 1,
		[]string{why + "postgres, the user name (libpq's default database); name others with --database\n", "database postgres: 2 problems"})
	runStep(t, "setup", []string{"setup", "-c", cfg, "--add-columns"}, 0,
		[]string{why + "postgres", "database postgres:\n  created the fenceproxy schema", "  added column last_fence bigint NOT NULL DEFAULT 0 to public.config\n"})
	runStep(t, "check", []string{"check", "-c", cfg}, 0, []string{why + "postgres", "database postgres: ok\n"})

	t.Run("PGDATABASE", func(t *testing.T) {
		t.Setenv("PGDATABASE", "app")
		runStep(t, "setup", []string{"setup", "-c", cfg, "--add-columns"}, 0,
			[]string{why + "app, from $PGDATABASE;", "database app:\n  created the fenceproxy schema"})
	})
	t.Run("PGUSER", func(t *testing.T) {
		// The database is named like the user, as libpq does.
		t.Setenv("PGUSER", "admin")
		runStep(t, "setup", []string{"setup", "-c", cfg, "--add-columns"}, 0,
			[]string{why + "admin, the user name", "database admin:\n  created the fenceproxy schema"})
	})
	t.Run("dsn", func(t *testing.T) {
		runStep(t, "check", []string{"check", "-c", cfg, "--dsn", pg.SuperuserDSN("app")}, 0,
			[]string{why + "app, the database of --dsn", "database app: ok\n"})
	})
	t.Run("named databases", func(t *testing.T) {
		runStep(t, "check", []string{"check", "-c", cfg, "--database", "app", "--database", "postgres"}, 0,
			[]string{"database app: ok\n", "database postgres: ok\n"})
		scoped := writeConfig(t, "scoped.yaml", strings.Replace(text, "      databases: []\n", "      databases: [app, admin]\n", 1))
		code, stdout, _ := runCommand(t, "check", "-c", scoped)
		if code != 0 || strings.Contains(stdout, why) || !strings.Contains(stdout, "database admin: ok\n") || !strings.Contains(stdout, "database app: ok\n") || strings.Contains(stdout, "database postgres") {
			t.Errorf("check of the scoped file: exit %d\n%s", code, stdout)
		}
	})
}
