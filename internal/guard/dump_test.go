package guard_test

import (
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"testing"

	"github.com/fenceproxy/fenceproxy/internal/rules"
)

// TestGuardSurvivesDumpRestore: a database with the guard, dumped with
// pg_dump and restored into a new database with psql, keeps a guard that
// works there: the record of its triggers names the restored relations
// (no stale OIDs), so DDL on other tables runs, a drop of the guarded
// table is still refused, and check finds the guard current.
func TestGuardSurvivesDumpRestore(t *testing.T) {
	tables := []rules.Table{{Table: "public.config"}}
	db, admin := guardDB(t, configTable+"; INSERT INTO config (id) VALUES (1)", tables)
	// Shift the OIDs the restore hands out away from the original ones.
	execSQL(t, admin, "CREATE TABLE spacer (id int); DROP TABLE spacer")
	c := shared.Cluster
	dump := filepath.Join(t.TempDir(), "dump.sql")
	conn := []string{"-h", c.Host(), "-p", strconv.Itoa(c.Port()), "-U", "postgres"}
	run := func(name string, args ...string) {
		t.Helper()
		out, err := exec.CommandContext(t.Context(), filepath.Join(c.BinDir(), name), append(append([]string(nil), conn...), args...)...).CombinedOutput()
		if err != nil {
			t.Fatalf("%s %q: %v\n%s", name, args, err, out)
		}
	}
	run("pg_dump", "-d", db, "-f", dump)
	if err := os.Chmod(dump, 0o644); err != nil {
		t.Fatal(err)
	}
	restored := newDatabase(t)
	run("psql", "-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", restored, "-f", dump)

	admin2 := connect(t, restored)
	if rep := guardCheck(t, admin2, tables); !rep.OK() || len(rep.Guarded) != 1 {
		t.Fatalf("check of the restored database: %+v", rep)
	}
	dba := connect(t, restored, superRole(t, admin2, "guard_dba"))
	wantState(t, dba, "CREATE TABLE unrelated (id int)", "")
	wantState(t, dba, "DROP TABLE unrelated", "")
	wantState(t, dba, "DROP TABLE config", "FP003")
	if got := fences(t, admin2, "config"); got != "1=0" {
		t.Errorf("restored config: %s", got)
	}
}
