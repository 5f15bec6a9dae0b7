package fencing_test

import (
	"context"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgproto3"

	"github.com/fenceproxy/fenceproxy/internal/rules"
	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// TestMemoryAfterReload: a write of an unprotected table, sent again and
// again (so the session remembers it as forwarded), is fenced at its next
// sending once a reload protects the table, in each of pgx's exec modes;
// the table is not written unfenced. (Without the rule set in the memory's
// key the next sending writes config unfenced.)
func TestMemoryAfterReload(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	for _, m := range []pgx.QueryExecMode{pgx.QueryExecModeSimpleProtocol, pgx.QueryExecModeExec, pgx.QueryExecModeCacheStatement} {
		t.Run(m.String(), func(t *testing.T) {
			e := startEnv(t)
			db := e.newDB(t)
			d := direct(t, db)
			c := e.connect(t, db, func(cc *pgx.ConnConfig) { cc.DefaultQueryExecMode = m })
			const w = "UPDATE config SET n = n + 1 WHERE id = 1"
			for range 3 {
				if _, err := c.Exec(ctxT(t), w); err != nil {
					t.Fatal(err)
				}
			}
			cfg := testRules
			cfg.Tables = append(append([]rules.Table(nil), cfg.Tables...), rules.Table{Table: "public.config"})
			rs, err := rules.Compile(cfg)
			if err != nil {
				t.Fatal(err)
			}
			e.pol.Swap(rs, false)
			before := tableText(t, d, "config")
			if _, err := c.Exec(ctxT(t), w); err == nil {
				t.Error("the write after the reload that protects its table: no error (the session has no token)")
			}
			if after := tableText(t, d, "config"); after != before {
				t.Errorf("config written unfenced after the reload: %s -> %s", before, after)
			}
		})
	}
}

// TestMemoryAcrossLexing: a text forwarded as a read while
// standard_conforming_strings is on, which with it off holds an UPDATE of
// a protected table, is decided again once the setting changes, also when
// the change is pipelined between two sendings of it. (The relay's own
// handling of such texts holds this too: the policy's unit tests check the
// lexing in the memory's key.)
func TestMemoryAcrossLexing(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	const smuggle = `SELECT 'a\' , $$'; UPDATE acct SET payload = 'pwned' WHERE id = 1; --$$`
	e := startEnv(t)
	db := e.newDB(t)
	d := direct(t, db)
	ctx := context.Background()
	c := e.connect(t, db)
	for range 3 {
		if _, err := c.PgConn().Exec(ctx, smuggle).ReadAll(); err != nil {
			t.Fatalf("with standard_conforming_strings on: %v", err)
		}
	}
	if _, err := c.PgConn().Exec(ctx, "SET standard_conforming_strings = off").ReadAll(); err != nil {
		t.Fatal(err)
	}
	if _, err := c.PgConn().Exec(ctx, smuggle).ReadAll(); err == nil {
		t.Error("after SET standard_conforming_strings = off: forwarded")
	}

	c2 := e.connect(t, db)
	for range 2 {
		if _, err := c2.PgConn().Exec(ctx, smuggle).ReadAll(); err != nil {
			t.Fatal(err)
		}
	}
	fe := c2.PgConn().Frontend()
	fe.Send(&pgproto3.Query{String: smuggle})
	fe.Send(&pgproto3.Query{String: "SELECT set_config('standard_conforming_strings', 'off', false)"})
	fe.Send(&pgproto3.Query{String: smuggle})
	if err := fe.Flush(); err != nil {
		t.Fatal(err)
	}
	errs := 0
	for ready := 0; ready < 3; {
		m, err := fe.Receive()
		if err != nil {
			t.Fatal(err)
		}
		switch m.(type) {
		case *pgproto3.ReadyForQuery:
			ready++
		case *pgproto3.ErrorResponse:
			errs++
		}
	}
	if errs == 0 {
		t.Error("pipelined after set_config: the third Query was not refused")
	}
	if got := tableText(t, d, "acct"); strings.Contains(got, "pwned") {
		t.Errorf("acct written unfenced: %s", got)
	}
}
