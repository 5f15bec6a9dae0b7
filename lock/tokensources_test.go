package lock_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

// Claims of docs/tokens.md about token sources other than the locks of
// etcdlock and redislock, tested where this machine can (the claim about
// INCR after SET NX is tested in redislock).

// TestPostgresSequenceTokens runs the docs' PostgreSQL recipe (a lock
// row taken FOR UPDATE, the token from nextval in the same transaction)
// with concurrent contenders: in grant order the tokens increase, a
// rolled-back grant's value is never handed out again, and an advisory
// lock returns no number.
func TestPostgresSequenceTokens(t *testing.T) {
	t.Parallel()
	pg := startPG(t)
	ctx := testContext(t)
	if err := pg.Exec(ctx, `
		CREATE SCHEMA app;
		CREATE SEQUENCE app.lock_tokens;
		CREATE TABLE app.locks (name text PRIMARY KEY, holder text, expires timestamptz, token bigint);
		INSERT INTO app.locks (name) VALUES ('NAME');
		-- The grants in the order the row lock let them through.
		CREATE TABLE app.grants (seq bigserial PRIMARY KEY, holder text NOT NULL, token bigint NOT NULL);`); err != nil {
		t.Fatal(err)
	}
	grant := func(conn *pgx.Conn, holder string, commit bool) (int64, bool, error) {
		tx, err := conn.Begin(ctx)
		if err != nil {
			return 0, false, err
		}
		defer tx.Rollback(ctx) //nolint:errcheck
		var free bool
		if err := tx.QueryRow(ctx, "SELECT holder IS NULL OR expires < now() FROM app.locks WHERE name = 'NAME' FOR UPDATE").Scan(&free); err != nil {
			return 0, false, err
		}
		if !free {
			return 0, false, nil
		}
		var token int64
		if err := tx.QueryRow(ctx, `UPDATE app.locks SET holder = $1, expires = now() + interval '30 s',
			token = nextval('app.lock_tokens') WHERE name = 'NAME' RETURNING token`, holder).Scan(&token); err != nil {
			return 0, false, err
		}
		if _, err := tx.Exec(ctx, "INSERT INTO app.grants (holder, token) VALUES ($1, $2)", holder, token); err != nil {
			return 0, false, err
		}
		if !commit {
			return token, false, tx.Rollback(ctx)
		}
		return token, true, tx.Commit(ctx)
	}
	release := func(conn *pgx.Conn, holder string) error {
		_, err := conn.Exec(ctx, "UPDATE app.locks SET holder = NULL WHERE name = 'NAME' AND holder = $1", holder)
		return err
	}
	connect := func() *pgx.Conn {
		conn, err := pgx.Connect(ctx, pg.SuperuserDSN("postgres"))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { conn.Close(context.Background()) })
		return conn
	}

	// A rolled-back grant's value is skipped, not reused.
	conn := connect()
	rolledBack, _, err := grant(conn, "rb", false)
	if err != nil {
		t.Fatal(err)
	}
	next, ok, err := grant(conn, "after-rb", true)
	if err != nil || !ok || next <= rolledBack {
		t.Fatalf("after a rolled-back grant of %d: token %d, %v, %v", rolledBack, next, ok, err)
	}
	if err := release(conn, "after-rb"); err != nil {
		t.Fatal(err)
	}

	const contenders, rounds = 6, 15
	var wg sync.WaitGroup
	var mu sync.Mutex
	var errs []error
	for i := range contenders {
		c := connect()
		wg.Go(func() {
			holder := fmt.Sprintf("c%d", i)
			for n := 0; n < rounds; {
				_, ok, err := grant(c, holder, true)
				if err == nil && ok {
					n++
					time.Sleep(time.Millisecond) // the work
					err = release(c, holder)
				}
				if err != nil {
					mu.Lock()
					errs = append(errs, err)
					mu.Unlock()
					return
				}
			}
		})
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
	rows, err := conn.Query(ctx, "SELECT token FROM app.grants ORDER BY seq")
	if err != nil {
		t.Fatal(err)
	}
	tokens, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil {
		t.Fatal(err)
	}
	if len(tokens) != contenders*rounds+1 {
		t.Fatalf("%d grants recorded, want %d", len(tokens), contenders*rounds+1)
	}
	for i := 1; i < len(tokens); i++ {
		if tokens[i] <= tokens[i-1] {
			t.Fatalf("grant %d got token %d after %d: not increasing in grant order", i, tokens[i], tokens[i-1])
		}
	}

	var typ string
	if err := conn.QueryRow(ctx, "SELECT pg_typeof(pg_advisory_lock(1))::text").Scan(&typ); err != nil {
		t.Fatal(err)
	}
	if typ != "void" {
		t.Errorf("pg_advisory_lock returns %s, the docs say no number (void)", typ)
	}
}
