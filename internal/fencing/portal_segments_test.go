package fencing_test

import (
	"strconv"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgproto3"

	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// TestPortalRebindAcrossSegments: a portal bound with the session's token
// as a parameter is closed by the proxy when the client binds another
// portal before executing it, and bound again at its Execute. When the
// pipeline's earlier segment (its own Sync) is still unanswered, that
// segment's ReadyForQuery ends the earlier segment's transaction, not
// the later portal's: the portal must be bound again and run its own
// statement with its own values. (Before, the earlier segment's
// ReadyForQuery marked it dead, and its Execute failed with 34000.) An
// earlier segment that commits an explicit transaction is checked too
// (the relay waits for its BEGIN's answer, so it is answered first).
func TestPortalRebindAcrossSegments(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	pol, _ := raPolicy(t, lockRules)
	p := startProxy(t, pol)
	db, d := bindDB(t, "")
	c := runPid(t, readerSession(t, p, db, "L", "7", pgx.QueryExecModeCacheStatement))
	rbPrepare(t, c, "s", "UPDATE acct SET payload = $1 WHERE id = $2")
	rbPrepare(t, c, "s2", "UPDATE acct SET payload = $1 || '-s2' WHERE id = $2")
	bind := func(portal, stmt, payload string, id int) *pgproto3.Bind {
		return &pgproto3.Bind{DestinationPortal: portal, PreparedStatement: stmt, Parameters: [][]byte{[]byte(payload), []byte(strconv.Itoa(id))}}
	}
	exec := func(portal string) *pgproto3.Execute { return &pgproto3.Execute{Portal: portal} }
	rows := func() string {
		return strings.Join(testutil.QueryStrings(t, d, "SELECT id || ':' || payload || '@' || last_fence FROM acct ORDER BY id"), " ")
	}
	reset := func() {
		execDirect(t, d, "UPDATE acct SET payload = CASE id WHEN 1 THEN 'a' WHEN 2 THEN 'b' ELSE 'c' END, last_fence = 0")
	}
	for _, k := range []struct {
		name  string
		first []pgproto3.FrontendMessage // the earlier segment, Sync included
		syncs int
	}{
		{"an earlier segment", []pgproto3.FrontendMessage{bind("p", "s", "first", 1), exec("p"), &pgproto3.Sync{}}, 1},
		{"two earlier segments", []pgproto3.FrontendMessage{bind("p", "s", "first", 1), exec("p"), &pgproto3.Sync{}, &pgproto3.Sync{}}, 2},
		{"an earlier segment that commits", []pgproto3.FrontendMessage{&pgproto3.Query{String: "BEGIN"},
			bind("p", "s", "first", 1), exec("p"), &pgproto3.Parse{Query: "COMMIT"}, &pgproto3.Bind{}, exec(""), &pgproto3.Sync{}}, 2},
	} {
		t.Run(k.name, func(t *testing.T) {
			reset()
			msgs := append(append([]pgproto3.FrontendMessage(nil), k.first...),
				bind("p", "s2", "second", 2), bind("q", "s", "third", 3), exec("q"), exec("p"), &pgproto3.Sync{})
			if errs := raPipeline(t, c, k.syncs+1, msgs...); len(errs) > 0 {
				t.Errorf("errors %v", errs)
			}
			if got, want := rows(), "1:first@7 2:second-s2@7 3:third@7"; got != want {
				t.Errorf("rows %s, want %s", got, want)
			}
		})
	}
	// The portal's own segment ends its transaction: an Execute of it
	// after its Sync fails as it would without the proxy.
	reset()
	errs := raPipeline(t, c, 2, bind("p", "s", "one", 1), bind("q", "s", "two", 2), exec("q"), &pgproto3.Sync{}, exec("p"), &pgproto3.Sync{})
	if len(errs) != 1 || !strings.HasPrefix(errs[0], "34000") {
		t.Errorf("Execute of a portal after its segment's Sync: %v, want one 34000", errs)
	}
	if got, want := rows(), "1:a@0 2:two@7 3:c@0"; got != want {
		t.Errorf("rows %s, want %s", got, want)
	}
}
