package fencing_test

import (
	"context"
	"errors"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"

	"github.com/fenceproxy/fenceproxy/internal/rules"
	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// TestLexingCannotSmuggleWrites: the server must not read a statement on a
// protected table differently from the proxy's parser. With
// standard_conforming_strings off, or in a client encoding whose
// multibyte characters may end in a backslash, text that looks like one
// harmless SELECT to a UTF-8, standard-strings parser hides an UPDATE.
// Such statements are refused; ordinary ones still work.
func TestLexingCannotSmuggleWrites(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	e := startEnv(t)
	db := e.newDB(t)
	d := direct(t, db)
	ctx := context.Background()
	untouched := func(t *testing.T) {
		t.Helper()
		var payload string
		var fence int64
		if err := d.QueryRow(ctx, "SELECT payload, last_fence FROM acct WHERE id = 1").Scan(&payload, &fence); err != nil {
			t.Fatal(err)
		}
		if payload != "a" || fence != 0 {
			t.Fatalf("row changed to (%q, %d): a write got through unfenced", payload, fence)
		}
	}
	simple := func(c *pgx.Conn, sql string) error {
		_, err := c.PgConn().Exec(ctx, sql).ReadAll()
		return err
	}

	t.Run("standard_conforming_strings off", func(t *testing.T) {
		c := e.connect(t, db)
		if err := simple(c, "SET standard_conforming_strings = off"); err != nil {
			t.Fatal(err)
		}
		err := simple(c, `SELECT '\''; UPDATE acct SET payload = $$pwned$$ WHERE id = 1; --'`)
		wantCode(t, err, rules.CodeRefused)
		untouched(t)
		// Pipelined in one write: the SET's ParameterStatus arrives only
		// with its ReadyForQuery, after the proxy has read the second
		// Query; the proxy must wait for it before deciding.
		c2 := e.connect(t, db)
		fe := c2.PgConn().Frontend()
		fe.Send(&pgproto3.Query{String: "SET standard_conforming_strings = off"})
		fe.Send(&pgproto3.Query{String: `SELECT '\''; UPDATE acct SET payload = $$pwned$$ WHERE id = 1; --'`})
		if err := fe.Flush(); err != nil {
			t.Fatal(err)
		}
		var codes []string
		for ready := 0; ready < 2; {
			msg, err := fe.Receive()
			if err != nil {
				t.Fatal(err)
			}
			switch m := msg.(type) {
			case *pgproto3.ErrorResponse:
				codes = append(codes, m.Code)
			case *pgproto3.ReadyForQuery:
				ready++
			}
		}
		if len(codes) != 1 || codes[0] != rules.CodeRefused {
			t.Fatalf("pipelined smuggling: errors %v, want [%s]", codes, rules.CodeRefused)
		}
		untouched(t)
		// Without backslashes the reading is the same: fenced as usual.
		setToken(t, c, "5")
		if err := simple(c, "UPDATE acct SET payload = 'a' WHERE id = 2"); err != nil {
			t.Fatalf("plain write with standard_conforming_strings off: %v", err)
		}
	})

	t.Run("client_encoding SJIS", func(t *testing.T) {
		c := e.connect(t, db)
		if err := simple(c, "SET client_encoding = 'SJIS'"); err != nil {
			t.Fatal(err)
		}
		// \x81\x5c is one SJIS character whose second byte is a backslash.
		err := simple(c, "SELECT E'\x81\\'; UPDATE acct SET payload = $$pwned$$ WHERE id = 1; --'")
		wantCode(t, err, rules.CodeRefused)
		untouched(t)
	})

	t.Run("refusal translated in other languages", func(t *testing.T) {
		c := e.connect(t, db)
		for _, lang := range []string{"de_DE.UTF-8", "fr_FR.UTF-8", "C"} {
			// lc_messages needs the locale installed; the marker must be
			// found whatever quotes surround it.
			if err := simple(c, "SET lc_messages = '"+lang+"'"); err != nil {
				continue
			}
			wantCode(t, simple(c, "TRUNCATE acct"), rules.CodeRefused)
		}
	})
}

// TestErrorPositionOfRewrittenStatement: a server error in a rewritten
// statement carries no position (it would point into the proxy's SQL);
// errors of statements forwarded as sent keep theirs.
func TestErrorPositionOfRewrittenStatement(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	e := startEnv(t)
	db := e.newDB(t)
	c := e.connect(t, db)
	ctx := context.Background()
	setToken(t, c, "5")
	_, err := c.PgConn().Exec(ctx, "UPDATE acct SET nocol = 1 WHERE id = 1").ReadAll()
	var pe *pgconn.PgError
	if !errors.As(err, &pe) || pe.Code != "42703" {
		t.Fatalf("rewritten statement: %v, want 42703", err)
	}
	if pe.Position != 0 {
		t.Errorf("rewritten statement's error has position %d, want none", pe.Position)
	}
	_, err = c.PgConn().Exec(ctx, "SELECT nocol FROM src").ReadAll()
	if !errors.As(err, &pe) || pe.Code != "42703" || pe.Position == 0 {
		t.Errorf("forwarded statement: %v (position %d), want 42703 with its position", err, pe.Position)
	}
}
