package fencing_test

import (
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/fenceproxy/fenceproxy/internal/audit"
	"github.com/fenceproxy/fenceproxy/internal/policy"
	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/rules"
	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// TestDecideQuick checks the policy's quick path, which sessions on an
// event loop take on the loop's thread: it gives exactly Decide's answer
// when that costs no parse and no wait, and declines otherwise — a
// first-seen statement on a protected table, a database whose check
// results are not at hand, a database whose audit listener is not
// connected yet.
func TestDecideQuick(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	checker, specs := startChecker(t, testRules)
	db := (&env{specs: specs}).newDB(t)
	cfg := testRules
	cfg.CacheSize = rules.DefaultCacheSize // as the service compiles them
	rs, err := rules.Compile(cfg)
	if err != nil {
		t.Fatal(err)
	}
	pol := policy.New(rs, false, policy.Options{Checks: checker})
	info := &proxy.SessionInfo{Database: db, User: "postgres"}
	var lex proxy.Lexing

	if _, ok := pol.DecideQuick(info, lex, "SELECT 1"); ok {
		t.Fatal("answered quickly before the database's check results were at hand")
	}
	if d := pol.Decide(info, lex, "SELECT 1"); d.Action != proxy.Forward {
		t.Fatalf("SELECT 1: %v", d.Action)
	}
	if d, ok := pol.DecideQuick(info, lex, "SELECT 1"); !ok || d.Action != proxy.Forward {
		t.Fatalf("SELECT 1 once the check is known: %v, %v", d.Action, ok)
	}
	// The results are read again a second after they were read: until
	// then, the quick path declines.
	deadline := time.Now().Add(10 * time.Second)
	for {
		if _, ok := pol.DecideQuick(info, lex, "SELECT 1"); !ok {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the database's check results never expired")
		}
		time.Sleep(50 * time.Millisecond)
	}
	pol.Decide(info, lex, "SELECT 1")
	if _, ok := pol.DecideQuick(info, lex, "SELECT 1"); !ok {
		t.Fatal("not answered quickly once the results were read again")
	}

	upd := "UPDATE " + tError + " SET n = n + 1 WHERE id = 1"
	if _, ok := pol.DecideQuick(info, lex, upd); ok {
		t.Fatal("a first-seen UPDATE of a protected table was answered quickly")
	}
	full := pol.Decide(info, lex, upd)
	if full.Action != proxy.Rewrite || !strings.Contains(full.SQL, "fenceproxy.advance(") {
		t.Fatalf("the database has the error raisers: want a rewrite calling them, got %v %q", full.Action, full.SQL)
	}
	d, ok := pol.DecideQuick(info, lex, upd)
	if !ok {
		// In a database with the catalog watch, a write waits for a read of
		// the catalog stamp (stamp.go): never on the loop. The refusal
		// below is answered from the cache all the same.
		d, ok = full, true
	}
	if !ok || d.Action != full.Action || d.SQL != full.SQL || strings.Join(d.Tables, ",") != strings.Join(full.Tables, ",") {
		t.Fatalf("cached UPDATE: quick %v %q %v (%v), Decide %v %q %v", d.Action, d.SQL, d.Tables, ok, full.Action, full.SQL, full.Tables)
	}

	// A refusal is cached as well, and the quick answer is the same.
	trunc := "TRUNCATE " + tError
	if _, ok := pol.DecideQuick(info, lex, trunc); ok {
		t.Fatal("a first-seen TRUNCATE of a protected table was answered quickly")
	}
	full = pol.Decide(info, lex, trunc)
	if d, ok := pol.DecideQuick(info, lex, trunc); !ok || d.Action != proxy.Refuse || full.Action != proxy.Refuse || d.Err.Message != full.Err.Message {
		t.Fatalf("TRUNCATE: quick %v (%v), Decide %v", d.Action, ok, full.Action)
	}
}

// TestDecideQuickAuditListener checks that a rewrite that reports to the
// audit listener is answered quickly only where the listener is connected:
// connecting it is a wait.
func TestDecideQuickAuditListener(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	rs, err := rules.Compile(rules.Config{CacheSize: rules.DefaultCacheSize, Tables: []rules.Table{{Table: "public." + tError, Mode: "audit"}}})
	if err != nil {
		t.Fatal(err)
	}
	aud := audit.New(audit.Options{ConnConfig: func(db string) (*pgconn.Config, error) {
		return pgconn.ParseConfig(cluster.SuperuserDSN(db))
	}})
	t.Cleanup(aud.Close)
	pol := policy.New(rs, true, policy.Options{Auditor: aud})
	e := &env{}
	a := &proxy.SessionInfo{Database: e.newDB(t), User: "postgres"}
	b := &proxy.SessionInfo{Database: e.newDB(t), User: "postgres"}
	var lex proxy.Lexing

	upd := "UPDATE " + tError + " SET n = n + 1 WHERE id = 1"
	if d := pol.Decide(a, lex, upd); d.Action != proxy.Rewrite {
		t.Fatalf("audit mode: want a rewrite, got %v", d.Action)
	}
	if d, ok := pol.DecideQuick(a, lex, upd); !ok || d.Action != proxy.Rewrite {
		t.Fatalf("database a, listener connected: %v, %v", d.Action, ok)
	}
	// The decision is cached, but b has no listener yet.
	if _, ok := pol.DecideQuick(b, lex, upd); ok {
		t.Fatal("answered quickly in a database whose audit listener is not connected")
	}
	pol.Decide(b, lex, upd)
	if _, ok := pol.DecideQuick(b, lex, upd); !ok {
		t.Fatal("database b, listener connected: not answered quickly")
	}
}
