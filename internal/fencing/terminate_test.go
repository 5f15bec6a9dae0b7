package fencing_test

import (
	"context"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/fenceproxy/fenceproxy/internal/policy"
	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/proxytest"
	"github.com/fenceproxy/fenceproxy/internal/rules"
	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// TestCleanTerminateIsNotAFailure: a client that ends its session with
// Terminate ends it normally, so the proxy must not log "session failed".
// It has its own proxy (same rules) only to capture the proxy's log.
//
// Found while writing the suite: on Terminate, copyClientToUpstream writes
// 'X' upstream and returns errSessionDone, but the server may close its end
// first and copyUpstreamToClient then records io.ErrUnexpectedEOF as the
// session's cause (the first close wins), logged at WARN as
// "session failed: upstream: unexpected EOF" for a few percent of clean
// disconnects.
func TestCleanTerminateIsNotAFailure(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	rs, err := rules.Compile(testRules)
	if err != nil {
		t.Fatal(err)
	}
	core, logs := observer.New(zapcore.InfoLevel)
	p := proxytest.Start(t, cluster.Addr(), proxy.Options{
		Policy: policy.New(rs, false, policy.Options{}),
		Logger: zap.New(core),
	})
	const sessions = 300
	for range sessions {
		c := connectDSN(t, p.DSN("postgres", "", "postgres"))
		selectOne(t, c)
		if err := c.Close(ctxT(t)); err != nil {
			t.Fatal(err)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := p.Server.Shutdown(ctx); err != nil {
		t.Fatal(err)
	}
	failed := logs.FilterMessage("session failed").All()
	for _, e := range failed {
		t.Errorf("clean Terminate logged %q at %v: %v", e.Message, e.Level, e.ContextMap())
	}
	if n := logs.FilterMessage("session closed").Len(); n+len(failed) != sessions {
		t.Errorf("%d session ends logged (%d failed), want %d", n+len(failed), len(failed), sessions)
	}
}
