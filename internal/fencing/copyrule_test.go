package fencing_test

import (
	"strings"
	"testing"

	"github.com/fenceproxy/fenceproxy/internal/policy"
	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// TestCopyIntoRulePath: inbox's ON INSERT rule writes acct (protected),
// created on a direct connection while the proxy runs. An INSERT into
// inbox through the proxy is refused naming the path; COPY inbox FROM
// STDIN, which fires no rules, goes through, and PostgreSQL shows its row
// in inbox and acct as it was. A relation that reaches acct by a step
// other than a rule (a partitioned parent of acct's copy, here a view
// with an INSTEAD OF INSERT trigger, which COPY fires) keeps COPY refused.
func TestCopyIntoRulePath(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	checker, specs := startChecker(t, testRules)
	e := startPolicyEnv(t, policy.Options{Checks: checker}, specs)
	db := e.newDB(t)
	d := direct(t, db)
	c := e.connect(t, db)
	ctx := ctxT(t)
	setToken(t, c, "5")
	execDirect(t, d, `CREATE TABLE inbox (id bigint, payload text);
		CREATE RULE inbox_to_acct AS ON INSERT TO inbox DO ALSO
			INSERT INTO acct (id, payload) VALUES (NEW.id, 'via-rule');
		CREATE VIEW acct_feed AS SELECT id, payload FROM inbox;
		CREATE FUNCTION acct_feed_ins() RETURNS trigger LANGUAGE plpgsql AS
			$$BEGIN INSERT INTO acct (id, payload) VALUES (NEW.id, 'via-trigger'); RETURN NEW; END$$;
		CREATE TRIGGER acct_feed_ins INSTEAD OF INSERT ON acct_feed FOR EACH ROW EXECUTE FUNCTION acct_feed_ins()`)
	before := tableText(t, d, "acct")

	err := retryCatalogCheck(t, func() error {
		_, err := c.Exec(ctx, "INSERT INTO inbox VALUES (41, 'x')")
		return err
	})
	wantCode(t, err, "FP003")
	if !strings.Contains(err.Error(), "without naming it") {
		t.Errorf("INSERT into inbox: %v, want the path's refusal", err)
	}

	tag, err := c.PgConn().CopyFrom(ctx, strings.NewReader("42\tcopied\n"), "COPY inbox FROM STDIN")
	if err != nil {
		t.Fatalf("COPY inbox FROM STDIN (fires no rules): %v", err)
	}
	if tag.RowsAffected() != 1 {
		t.Errorf("COPY inbox: %d rows, want 1", tag.RowsAffected())
	}
	if got := tableText(t, d, "inbox"); !strings.Contains(got, `"id": 42`) || strings.Contains(got, `"id": 41`) {
		t.Errorf("inbox after the COPY: %s, want row 42 only", got)
	}

	_, err = c.PgConn().CopyFrom(ctx, strings.NewReader("43\tcopied\n"), "COPY acct_feed FROM STDIN")
	wantCode(t, err, "FP003")
	if after := tableText(t, d, "acct"); after != before {
		t.Errorf("acct changed:\n before %s\n after  %s", before, after)
	}
}
