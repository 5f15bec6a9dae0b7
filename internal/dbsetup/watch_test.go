package dbsetup_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/fenceproxy/fenceproxy/internal/dbsetup"
	"github.com/fenceproxy/fenceproxy/internal/rules"
)

// TestWatch: setup as a superuser installs the catalog watch, once; check
// finds it; the commands that may open a path move the stamp and notify,
// the others (temporary tables, indexes, comments) do not.
func TestWatch(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	db := newDatabase(t)
	conn := connect(t, db)
	execSQL(t, conn, `CREATE TABLE acct (id int PRIMARY KEY, n int, last_fence bigint NOT NULL DEFAULT 0);
		CREATE TABLE other (id int PRIMARY KEY, n int)`)
	sp := specs(t, rules.Table{Table: "public.acct"})
	rep, err := dbsetup.Setup(ctx, conn, sp, dbsetup.SetupOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if !slices.ContainsFunc(rep.Actions, func(a string) bool { return strings.Contains(a, "catalog watch") }) {
		t.Fatalf("setup actions %q: no catalog watch", rep.Actions)
	}
	rep, err = dbsetup.Setup(ctx, conn, sp, dbsetup.SetupOptions{})
	if err != nil || len(rep.Actions) > 0 {
		t.Fatalf("second setup: %v, actions %q", err, rep.Actions)
	}
	rep, err = dbsetup.Check(ctx, conn, sp)
	if err != nil || !rep.Watched || !rep.OK() {
		t.Fatalf("check: %v, watched %v, problems %v", err, rep.Watched, rep.Problems)
	}

	listener := connect(t, db)
	execSQL(t, listener, "LISTEN "+dbsetup.CatalogChannel)
	stamp := func() int64 {
		t.Helper()
		s, err := dbsetup.ReadStamp(ctx, conn)
		if err != nil {
			t.Fatal(err)
		}
		return s
	}
	notified := func() bool {
		wctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
		defer cancel()
		_, err := listener.WaitForNotification(wctx)
		return err == nil
	}
	for _, c := range []struct {
		sql   string
		moves bool
	}{
		{"CREATE VIEW v AS SELECT * FROM acct", true},
		{"CREATE RULE r AS ON UPDATE TO other DO INSTEAD NOTHING", true},
		{"DROP RULE r ON other", true},
		{"ALTER TABLE acct ADD FOREIGN KEY (n) REFERENCES other (id) ON UPDATE CASCADE", true},
		{"CREATE TABLE parent (id int); ", true},
		{"BEGIN; ALTER TABLE acct INHERIT parent; ROLLBACK", false}, // counted only if committed
		{"CREATE TEMP TABLE scratch (id int)", false},
		// Another session can write through a temporary view, by its
		// schema's name: counted, with its rules and triggers.
		{"CREATE TEMP VIEW tv AS SELECT 1", true},
		{"CREATE RULE tr AS ON INSERT TO tv DO INSTEAD NOTHING", true},
		{"DROP VIEW tv", true},
		{"DROP TABLE scratch", false},
		// The session calls its temporary functions and procedures as
		// pg_temp's, and one may read a lock-fenced table: counted, so
		// that the proxy lists it among the readers.
		{"CREATE FUNCTION pg_temp.tf() RETURNS int LANGUAGE sql AS 'SELECT 1'", true},
		{"CREATE PROCEDURE pg_temp.tp() LANGUAGE sql AS 'SELECT 1'", true},
		{"CREATE INDEX other_n ON other (n)", false},
		{"ALTER INDEX other_n RENAME TO other_n2", false},
		{"COMMENT ON TABLE other IS 'x'", false},
		// ALTER INDEX renames views and tables too.
		{"ALTER INDEX v RENAME TO v2", true},
		{"ALTER INDEX v2 RENAME TO v", true},
		{"DROP VIEW v", true},
	} {
		before := stamp()
		execSQL(t, conn, c.sql)
		moved := stamp() != before
		if moved != c.moves {
			t.Errorf("%s: stamp moved %v, want %v", c.sql, moved, c.moves)
		}
		if n := notified(); n != c.moves {
			t.Errorf("%s: notified %v, want %v", c.sql, n, c.moves)
		}
	}
}

// TestCatalogCheckForms: the check the proxy calls (dbsetup.CatalogCheckProc,
// catalog_at) ends as catalog_is, which proxies of earlier versions call,
// does, with the same error, in each case: the stamp equal or not, under
// READ COMMITTED, REPEATABLE READ and SERIALIZABLE, the row replaced by a
// transaction committed after the snapshot, locked by one in progress or
// left with the xmax of one rolled back, the transaction's own catalog
// changes, no row, a hostile search_path, and outside a transaction
// block (a non-atomic CALL). A watch without catalog_at reads as missing,
// and setup installs it.
func TestCatalogCheckForms(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	db := newDatabase(t)
	conn := connect(t, db)
	execSQL(t, conn, `CREATE TABLE acct (id int PRIMARY KEY, n int, last_fence bigint NOT NULL DEFAULT 0)`)
	sp := specs(t, rules.Table{Table: "public.acct"})
	if _, err := dbsetup.Setup(ctx, conn, sp, dbsetup.SetupOptions{}); err != nil {
		t.Fatal(err)
	}
	if dbsetup.CatalogCheckProc != "fenceproxy.catalog_at" {
		t.Fatalf("CatalogCheckProc is %s", dbsetup.CatalogCheckProc)
	}
	other := connect(t, db)
	stamp := func() int64 {
		t.Helper()
		s, err := dbsetup.ReadStamp(ctx, other)
		if err != nil {
			t.Fatal(err)
		}
		return s
	}
	bump := func() { execSQL(t, other, "UPDATE fenceproxy.catalog SET stamp = stamp + 1") }

	// call runs proc(want) in tx, in a savepoint so that a failure leaves
	// tx usable; nil when it passed.
	call := func(tx pgx.Tx, proc string, want int64) *pgconn.PgError {
		t.Helper()
		if _, err := tx.Exec(ctx, "SAVEPOINT c"); err != nil {
			t.Fatal(err)
		}
		_, err := tx.Exec(ctx, fmt.Sprintf("CALL %s(%d)", proc, want))
		var pe *pgconn.PgError
		if err != nil && !errors.As(err, &pe) {
			t.Fatal(err)
		}
		if _, err := tx.Exec(ctx, "ROLLBACK TO SAVEPOINT c"); err != nil {
			t.Fatal(err)
		}
		return pe
	}
	// same reports a difference between the two procedures' outcomes.
	same := func(is, at *pgconn.PgError) string {
		switch {
		case is == nil && at == nil:
			return ""
		case is == nil || at == nil:
			return fmt.Sprintf("catalog_is: %v, catalog_at: %v", is, at)
		case is.Code != at.Code || is.Message != at.Message || is.Detail != at.Detail || is.Hint != at.Hint:
			return fmt.Sprintf("catalog_is: %s %q %q %q, catalog_at: %s %q %q %q",
				is.Code, is.Message, is.Detail, is.Hint, at.Code, at.Message, at.Detail, at.Hint)
		}
		return ""
	}
	// check calls both with want in tx and wants them to pass (refused
	// false) or to fail with the catalog check's FP003 whose detail ends
	// with now.
	check := func(t *testing.T, tx pgx.Tx, want int64, refused bool, now string) {
		t.Helper()
		is, at := call(tx, "fenceproxy.catalog_is", want), call(tx, dbsetup.CatalogCheckProc, want)
		if d := same(is, at); d != "" {
			t.Errorf("want %d: %s", want, d)
		}
		switch {
		case !refused && at != nil:
			t.Errorf("want %d: %v, want it to pass", want, at)
		case refused && at == nil:
			t.Errorf("want %d: passed, want FP003", want)
		case refused && (at.Code != "FP003" || !strings.HasPrefix(at.Message, "fenceproxy: the catalog of database "+db+" changed") ||
			!strings.HasSuffix(at.Detail, "the stamp is now "+now+".")):
			t.Errorf("want %d: %s %q %q, want FP003 ending %q", want, at.Code, at.Message, at.Detail, now)
		}
	}
	begin := func(t *testing.T, c *pgx.Conn, iso pgx.TxIsoLevel) pgx.Tx {
		t.Helper()
		tx, err := c.BeginTx(ctx, pgx.TxOptions{IsoLevel: iso})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
		// The snapshot of REPEATABLE READ and SERIALIZABLE is taken here.
		if _, err := tx.Exec(ctx, "SELECT 1"); err != nil {
			t.Fatal(err)
		}
		return tx
	}
	str := func(n int64) string { return fmt.Sprint(n) }
	isolations := []pgx.TxIsoLevel{pgx.ReadCommitted, pgx.RepeatableRead, pgx.Serializable}

	for _, iso := range isolations {
		t.Run(string(iso)+"/unchanged", func(t *testing.T) {
			s := stamp()
			tx := begin(t, conn, iso)
			check(t, tx, s, false, "")
			check(t, tx, s+1, true, str(s))
			check(t, tx, s-1, true, str(s))
		})
		t.Run(string(iso)+"/moved after the snapshot", func(t *testing.T) {
			s := stamp()
			tx := begin(t, conn, iso)
			bump()
			if iso == pgx.ReadCommitted {
				// Each statement reads the stamp of its snapshot.
				check(t, tx, s, true, str(s+1))
				check(t, tx, s+1, false, "")
				return
			}
			// The snapshot's stamp is s, the catalog's s+1.
			check(t, tx, s, true, "newer than this transaction's snapshot")
			check(t, tx, s+1, true, "newer than this transaction's snapshot")
		})
		t.Run(string(iso)+"/locked by a transaction in progress, then rolled back", func(t *testing.T) {
			s := stamp()
			locker := connect(t, db)
			execSQL(t, locker, "BEGIN; UPDATE fenceproxy.catalog SET stamp = stamp + 1")
			tx := begin(t, conn, iso)
			check(t, tx, s, false, "")
			check(t, tx, s+1, true, str(s))
			execSQL(t, locker, "ROLLBACK")
			// The row keeps the rolled-back transaction's xmax.
			check(t, tx, s, false, "")
			check(t, tx, s+1, true, str(s))
			if err := tx.Rollback(ctx); err != nil {
				t.Fatal(err)
			}
			tx = begin(t, conn, iso)
			check(t, tx, s, false, "")
			check(t, tx, s+1, true, str(s))
		})
		t.Run(string(iso)+"/own catalog changes", func(t *testing.T) {
			s := stamp()
			tx := begin(t, conn, iso)
			if _, err := tx.Exec(ctx, fmt.Sprintf("CREATE TABLE made_here_%d (id int)", len(iso))); err != nil {
				t.Fatal(err)
			}
			// The stamp the transaction sees is s+1, written by it: the
			// checks compare the stamp before its changes, s.
			check(t, tx, s, false, "")
			check(t, tx, s+1, true, str(s))
			if _, err := tx.Exec(ctx, fmt.Sprintf("CREATE VIEW made_here_v%d AS SELECT 1", len(iso))); err != nil {
				t.Fatal(err)
			}
			check(t, tx, s, false, "")
			check(t, tx, s+2, true, str(s))
		})
		t.Run(string(iso)+"/no row", func(t *testing.T) {
			s := stamp()
			tx := begin(t, conn, iso)
			if _, err := tx.Exec(ctx, "DELETE FROM fenceproxy.catalog"); err != nil {
				t.Fatal(err)
			}
			check(t, tx, s, true, "unknown")
		})
	}

	t.Run("hostile search_path", func(t *testing.T) {
		// An equality of bigints that is always true, found before
		// pg_catalog's: the check does not use it.
		execSQL(t, conn, `CREATE SCHEMA hostile;
			CREATE FUNCTION hostile.eq(bigint, bigint) RETURNS boolean LANGUAGE sql AS 'SELECT true';
			CREATE OPERATOR hostile.= (LEFTARG = bigint, RIGHTARG = bigint, FUNCTION = hostile.eq)`)
		s := stamp()
		c := connect(t, db)
		execSQL(t, c, "SET search_path = hostile, pg_catalog, public")
		for _, iso := range isolations {
			tx := begin(t, c, iso)
			check(t, tx, s, false, "")
			check(t, tx, s+1, true, str(s))
			if _, err := tx.Exec(ctx, "CREATE TABLE hostile.made_here (id int)"); err != nil {
				t.Fatal(err)
			}
			check(t, tx, s, false, "")
			check(t, tx, s+1, true, str(s))
			if err := tx.Rollback(ctx); err != nil {
				t.Fatal(err)
			}
		}
	})

	t.Run("outside a transaction block", func(t *testing.T) {
		// Bound in the extended protocol, as the proxy does before a
		// client's Bind: a non-atomic CALL.
		s := stamp()
		for _, proc := range []string{"fenceproxy.catalog_is", dbsetup.CatalogCheckProc} {
			if _, err := conn.Exec(ctx, "CALL "+proc+"($1)", s); err != nil {
				t.Errorf("%s(%d): %v", proc, s, err)
			}
			if _, err := conn.Exec(ctx, "CALL "+proc+"($1)", s+1); sqlState(err) != "FP003" {
				t.Errorf("%s(%d): %v, want FP003", proc, s+1, err)
			}
		}
	})

	t.Run("earlier watch", func(t *testing.T) {
		// A watch installed by an earlier version has no catalog_at: it
		// is still watched, with catalog_is as its check (so that
		// upgrading the proxy leaves no database unwatched), check notes
		// it, and setup upgrades it.
		execSQL(t, conn, "DROP PROCEDURE "+dbsetup.CatalogCheckProc+"(bigint)")
		rep, err := dbsetup.Check(ctx, conn, sp)
		if err != nil || !rep.Watched || rep.CheckProc != dbsetup.LegacyCatalogCheckProc ||
			!slices.ContainsFunc(rep.Notes, func(n dbsetup.Note) bool { return strings.Contains(n.Text, "earlier version") }) {
			t.Fatalf("check without catalog_at: %v, watched %v with %q, notes %v", err, rep.Watched, rep.CheckProc, rep.Notes)
		}
		rep, err = dbsetup.Setup(ctx, conn, sp, dbsetup.SetupOptions{})
		if err != nil || !slices.Contains(rep.Actions, "upgraded the catalog watch") {
			t.Fatalf("setup: %v, actions %q", err, rep.Actions)
		}
		if rep, err = dbsetup.Check(ctx, conn, sp); err != nil || !rep.Watched || rep.CheckProc != dbsetup.CatalogCheckProc {
			t.Fatalf("check after setup: %v, watched %v with %q", err, rep.Watched, rep.CheckProc)
		}
		// The triggers' function of the earlier version (it skipped
		// ALTER INDEX, which renames views too): still watched, noted,
		// and setup replaces it.
		v1, err := os.ReadFile("watch_v1.sql")
		if err != nil {
			t.Fatal(err)
		}
		execSQL(t, conn, string(v1))
		rep, err = dbsetup.Check(ctx, conn, sp)
		if err != nil || !rep.Watched || !slices.ContainsFunc(rep.Notes, func(n dbsetup.Note) bool { return strings.Contains(n.Text, "earlier version") }) {
			t.Fatalf("check with the earlier catalog_changed: %v, watched %v, notes %v", err, rep.Watched, rep.Notes)
		}
		rep, err = dbsetup.Setup(ctx, conn, sp, dbsetup.SetupOptions{})
		if err != nil || !slices.Contains(rep.Actions, "upgraded the catalog watch") {
			t.Fatalf("setup over the earlier catalog_changed: %v, actions %q", err, rep.Actions)
		}
		if rep, err = dbsetup.Check(ctx, conn, sp); err != nil || !rep.Watched || slices.ContainsFunc(rep.Notes, func(n dbsetup.Note) bool { return strings.Contains(n.Text, "earlier version") }) {
			t.Fatalf("check after setup: %v, watched %v, notes %v", err, rep.Watched, rep.Notes)
		}
		// The version before it counted temporary views: the same.
		v2, err := os.ReadFile("watch_v2.sql")
		if err != nil {
			t.Fatal(err)
		}
		execSQL(t, conn, string(v2))
		rep, err = dbsetup.Check(ctx, conn, sp)
		if err != nil || !rep.Watched || !slices.ContainsFunc(rep.Notes, func(n dbsetup.Note) bool { return strings.Contains(n.Text, "earlier version") }) {
			t.Fatalf("check with the v2 catalog_changed: %v, watched %v, notes %v", err, rep.Watched, rep.Notes)
		}
		if rep, err = dbsetup.Setup(ctx, conn, sp, dbsetup.SetupOptions{}); err != nil || !slices.Contains(rep.Actions, "upgraded the catalog watch") {
			t.Fatalf("setup over the v2 catalog_changed: %v, actions %q", err, rep.Actions)
		}
		// The check of the version before it set lock_timeout while a
		// change is under way: still watched with it, noted, upgraded.
		v3, err := os.ReadFile("watch_v3.sql")
		if err != nil {
			t.Fatal(err)
		}
		execSQL(t, conn, string(v3))
		rep, err = dbsetup.Check(ctx, conn, sp)
		if err != nil || !rep.Watched || rep.CheckProc != dbsetup.CatalogCheckProc ||
			!slices.ContainsFunc(rep.Notes, func(n dbsetup.Note) bool { return strings.Contains(n.Text, "earlier version") }) {
			t.Fatalf("check with the v3 catalog_at: %v, watched %v with %q, notes %v", err, rep.Watched, rep.CheckProc, rep.Notes)
		}
		if rep, err = dbsetup.Setup(ctx, conn, sp, dbsetup.SetupOptions{}); err != nil || !slices.Contains(rep.Actions, "upgraded the catalog watch") {
			t.Fatalf("setup over the v3 catalog_at: %v, actions %q", err, rep.Actions)
		}
		if rep, err = dbsetup.Check(ctx, conn, sp); err != nil || !rep.Watched || slices.ContainsFunc(rep.Notes, func(n dbsetup.Note) bool { return strings.Contains(n.Text, "earlier version") }) {
			t.Fatalf("check after setup over v3: %v, watched %v, notes %v", err, rep.Watched, rep.Notes)
		}
		// The triggers' function before it counted temporary functions
		// and procedures: the same.
		execSQL(t, conn, dbsetup.WatchSQLV3)
		rep, err = dbsetup.Check(ctx, conn, sp)
		if err != nil || !rep.Watched || !slices.ContainsFunc(rep.Notes, func(n dbsetup.Note) bool { return strings.Contains(n.Text, "earlier version") }) {
			t.Fatalf("check with the v3 catalog_changed: %v, watched %v, notes %v", err, rep.Watched, rep.Notes)
		}
		if rep, err = dbsetup.Setup(ctx, conn, sp, dbsetup.SetupOptions{}); err != nil || !slices.Contains(rep.Actions, "upgraded the catalog watch") {
			t.Fatalf("setup over the v3 catalog_changed: %v, actions %q", err, rep.Actions)
		}
		if rep, err = dbsetup.Check(ctx, conn, sp); err != nil || !rep.Watched || slices.ContainsFunc(rep.Notes, func(n dbsetup.Note) bool { return strings.Contains(n.Text, "earlier version") }) {
			t.Fatalf("check after setup over the v3 catalog_changed: %v, watched %v, notes %v", err, rep.Watched, rep.Notes)
		}
		// Neither check in place: not watched.
		execSQL(t, conn, "DROP PROCEDURE "+dbsetup.CatalogCheckProc+"(bigint); DROP PROCEDURE "+dbsetup.LegacyCatalogCheckProc+"(bigint)")
		if rep, err = dbsetup.Check(ctx, conn, sp); err != nil || rep.Watched {
			t.Fatalf("check without a check procedure: %v, watched %v", err, rep.Watched)
		}
	})
}
