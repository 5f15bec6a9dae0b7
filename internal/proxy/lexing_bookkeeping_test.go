package proxy_test

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgproto3"

	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/rules"
	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

type lexRec struct {
	proxy.BasePolicy
	mu  sync.Mutex
	got map[string]proxy.Lexing
}

func (r *lexRec) Decide(_ *proxy.SessionInfo, lex proxy.Lexing, sql string) rules.Decision {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.got == nil {
		r.got = map[string]proxy.Lexing{}
	}
	r.got[sql] = lex
	return rules.Decision{}
}
func (r *lexRec) TranslateError(*proxy.SessionInfo, *pgproto3.ErrorResponse) bool { return false }
func (r *lexRec) get(sql string) (proxy.Lexing, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	l, ok := r.got[sql]
	return l, ok
}

func until(t *testing.T, fe *pgproto3.Frontend, stop func(pgproto3.BackendMessage) bool) []pgproto3.BackendMessage {
	t.Helper()
	var out []pgproto3.BackendMessage
	for {
		m, err := fe.Receive()
		if err != nil {
			t.Fatalf("receive: %v (so far %d msgs)", err, len(out))
		}
		t.Logf("<- %T %+v", m, m)
		out = append(out, m)
		if stop(m) {
			return out
		}
	}
}
func isRFQ(m pgproto3.BackendMessage) bool { _, ok := m.(*pgproto3.ReadyForQuery); return ok }

// Settings from the startup packet (and role defaults) reach the policy.
func TestLexingFromStartupSettings(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	rec := &lexRec{}
	p := startProxy(t, proxy.Options{Policy: rec})
	_, fe := rawSession(t, p.Addr(), map[string]string{"client_encoding": "SJIS", "options": "-c standard_conforming_strings=off"})
	q := `SELECT 'a\' , ' ; SELECT 1; -- '`
	fe.Send(&pgproto3.Query{String: q})
	_ = fe.Flush()
	until(t, fe, isRFQ)
	l, _ := rec.get(q)
	t.Logf("lexing given to policy: %+v", l)
	if l.ClientEncoding != "SJIS" || l.StandardConformingStrings {
		t.Errorf("policy told %+v; server has SJIS / scs=off", l)
	}
}

// A Query discarded by the server in skip-until-Sync mode is never
// answered: the wait before deciding on a sensitive statement is bounded,
// and the statement is then decided as Uncertain.
func TestLexingWaitAfterDiscardedQueryIsBounded(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	rec := &lexRec{}
	p := startProxy(t, proxy.Options{Policy: rec})
	c, fe := rawSession(t, p.Addr(), nil)
	fe.Send(&pgproto3.Parse{Query: "SELEC bogus"})
	fe.Send(&pgproto3.Query{String: "SELECT 1"})
	fe.Send(&pgproto3.Sync{})
	_ = fe.Flush()
	until(t, fe, isRFQ)
	fe.Send(&pgproto3.Query{String: "SELECT 'é'"})
	_ = fe.Flush()
	_ = c.SetReadDeadline(time.Now().Add(8 * time.Second))
	m, err := fe.Receive()
	if err != nil {
		t.Errorf("session hung: %v", err)
	} else {
		t.Logf("got %T", m)
	}
}

// CopyDone pipelined before the CopyInResponse, with more statements
// behind the COPY: the proxy cannot tell which Syncs the server ignored, so
// a later backslash statement is decided as Uncertain (fail closed), never
// with a stale standard_conforming_strings.
func TestLexingPipelinedCopyFailsClosed(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	table := newTable(t, "id int")
	rec := &lexRec{}
	p := startProxy(t, proxy.Options{Policy: rec})
	_, fe := rawSession(t, p.Addr(), nil)
	fe.Send(&pgproto3.Parse{Query: "COPY " + table + " FROM STDIN"})
	fe.Send(&pgproto3.Bind{})
	fe.Send(&pgproto3.Execute{})
	fe.Send(&pgproto3.CopyData{Data: []byte("1\n")})
	fe.Send(&pgproto3.CopyDone{})
	fe.Send(&pgproto3.Sync{})
	fe.Send(&pgproto3.Parse{Query: "SELECT pg_sleep(1)"})
	fe.Send(&pgproto3.Bind{})
	fe.Send(&pgproto3.Execute{})
	fe.Send(&pgproto3.Parse{Query: "SET standard_conforming_strings = off"})
	fe.Send(&pgproto3.Bind{})
	fe.Send(&pgproto3.Execute{})
	fe.Send(&pgproto3.Sync{})
	q := `SELECT 'a\' , ' ; SELECT ''unfenced'' AS attack; -- '`
	fe.Send(&pgproto3.Query{String: q})
	_ = fe.Flush()
	out := until(t, fe, func(m pgproto3.BackendMessage) bool { return false && isRFQ(m) || isLastRFQ(m) })
	_ = out
	l, _ := rec.get(q)
	t.Logf("lexing given to policy: %+v", l)
	if l.StandardConformingStrings && !l.Uncertain {
		t.Errorf("policy decided with scs=on, certain; server ran it with scs=off")
	}
}

var rfqCount int

func isLastRFQ(m pgproto3.BackendMessage) bool {
	if d, ok := m.(*pgproto3.DataRow); ok && strings.Contains(string(d.Values[0]), "unfenced") {
		return false
	}
	if isRFQ(m) {
		rfqCount++
		return rfqCount == 3
	}
	return false
}

// An error in the middle of an extended-protocol COPY ends copy-in mode;
// the client's Sync (without CopyDone, as the protocol allows) is answered,
// and the session is idle and certain again afterwards.
func TestCopyErrorLeavesSessionIdle(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	table := newTable(t, "id int")
	rec := &lexRec{}
	p := startProxy(t, proxy.Options{Policy: rec})
	_, fe := rawSession(t, p.Addr(), nil)
	fe.Send(&pgproto3.Parse{Query: "COPY " + table + " FROM STDIN"})
	fe.Send(&pgproto3.Bind{})
	fe.Send(&pgproto3.Execute{})
	fe.Send(&pgproto3.Sync{})
	_ = fe.Flush()
	until(t, fe, func(m pgproto3.BackendMessage) bool { _, ok := m.(*pgproto3.CopyInResponse); return ok })
	fe.Send(&pgproto3.CopyData{Data: []byte("notanint\n")})
	fe.Send(&pgproto3.CopyData{Data: []byte("1\n")})
	_ = fe.Flush()
	until(t, fe, func(m pgproto3.BackendMessage) bool { _, ok := m.(*pgproto3.ErrorResponse); return ok })
	fe.Send(&pgproto3.Sync{})
	_ = fe.Flush()
	until(t, fe, isRFQ)
	// an ordinary extended round trip, then a sensitive statement
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	defer func() {
		if err := p.Server.Shutdown(ctx); err != nil || ctx.Err() != nil {
			t.Errorf("idle session not drained: %v", err)
		}
	}()
	fe.Send(&pgproto3.Parse{Query: "SELECT 1"})
	fe.Send(&pgproto3.Bind{})
	fe.Send(&pgproto3.Execute{})
	fe.Send(&pgproto3.Sync{})
	_ = fe.Flush()
	until(t, fe, isRFQ)
	q := `SELECT 'é'`
	fe.Send(&pgproto3.Query{String: q})
	_ = fe.Flush()
	until(t, fe, isRFQ)
	l, _ := rec.get(q)
	t.Logf("lexing: %+v", l)
	if l.Uncertain {
		t.Errorf("idle session but Uncertain (copy-in bookkeeping stuck)")
	}
}

// PostgreSQL reports client_encoding by its canonical name whatever alias
// the client used, which is what the policy compares with "UTF8".
func TestLexingEncodingNames(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	p := startProxy(t, proxy.Options{})
	_, fe := rawSession(t, p.Addr(), nil)
	for _, e := range []string{"latin1", "utf-8", "latin1", "unicode", "sql_ascii", "Utf8"} {
		fe.Send(&pgproto3.Query{String: "SET client_encoding = '" + e + "'"})
		_ = fe.Flush()
		for _, m := range until(t, fe, isRFQ) {
			if ps, ok := m.(*pgproto3.ParameterStatus); ok {
				t.Logf("%s -> %s=%s", e, ps.Name, ps.Value)
			}
		}
	}
}
