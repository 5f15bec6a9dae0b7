package fencing_test

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// TestDeepStatement sends the statement that used to kill the proxy with
// SIGSEGV inside libpg_query (a 120 KB, 30,000-term 1 + 1 + … chain) over
// the simple and the extended protocol, while another session keeps
// querying: on a protected table it is refused (FP003); on a table whose
// name MayTouch cannot tell from a protected one it is refused too (the
// proxy cannot parse it to tell); on an unrelated table it is forwarded and
// PostgreSQL answers. The proxy and the other session carry on.
func TestDeepStatement(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	e := startEnv(t)
	db := e.newDB(t)
	chain := " WHERE id = 1" + strings.Repeat(" + 1", 30000)

	// The other session: SELECT 1 in a loop until the deep statements are
	// done; none may fail or take long.
	other := e.connect(t, db)
	stop := make(chan struct{})
	var wg sync.WaitGroup
	var otherErr error
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			select {
			case <-stop:
				return
			default:
			}
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			var one int
			err := other.QueryRow(ctx, "SELECT 1 FROM acct WHERE id = 1").Scan(&one)
			cancel()
			if err != nil {
				otherErr = err
				return
			}
		}
	}()

	c := e.connect(t, db)
	for _, tc := range []struct {
		name, sql string
		refused   bool
	}{
		{"protected", "SELECT 1 FROM acct" + chain, true},
		{"protected-update", "UPDATE acct SET n = 0" + chain, true},
		{"look-alike", "SELECT 1 FROM config" + chain, true}, // "Config" is protected
		{"unprotected", "SELECT 1 FROM src" + chain, false},
	} {
		for _, proto := range []string{"simple", "extended"} {
			t.Run(tc.name+"/"+proto, func(t *testing.T) {
				ctx := ctxT(t)
				var err error
				if proto == "simple" {
					_, err = c.PgConn().Exec(ctx, tc.sql).ReadAll()
				} else {
					err = c.PgConn().ExecParams(ctx, tc.sql, nil, nil, nil, nil).Read().Err
				}
				switch {
				case tc.refused:
					wantCode(t, err, "FP003")
					var pgErr *pgconn.PgError
					if !errors.As(err, &pgErr) || !strings.Contains(pgErr.Message, "nests too deeply") || pgErr.Hint == "" {
						t.Errorf("refusal: %v", err)
					}
				case err != nil:
					// PostgreSQL itself may find it too deep.
					wantCode(t, err, "54001")
				}
				selectOne(t, c) // the session goes on
			})
		}
	}
	close(stop)
	wg.Wait()
	if otherErr != nil {
		t.Fatalf("other session: %v", otherErr)
	}
	// The proxy still accepts connections.
	selectOne(t, e.connect(t, db))
}
