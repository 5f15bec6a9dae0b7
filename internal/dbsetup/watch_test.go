package dbsetup_test

import (
	"context"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/fenceproxy/fenceproxy/internal/dbsetup"
	"github.com/fenceproxy/fenceproxy/internal/rules"
)

// TestWatch: setup as a superuser installs the catalog watch, once; check
// finds it; the commands that may open a path move the stamp and notify,
// the others (temporary objects, indexes, comments) do not.
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
		{"CREATE TEMP VIEW tv AS SELECT 1", false},
		{"DROP TABLE scratch", false},
		{"CREATE INDEX ON other (n)", false},
		{"COMMENT ON TABLE other IS 'x'", false},
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
