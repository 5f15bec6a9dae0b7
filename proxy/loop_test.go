package proxy_test

import (
	"testing"

	"github.com/fenceproxy/fenceproxy/proxy"
)

// TestSessionsOnEventLoops checks that authenticated sessions are relayed
// by the event loops, not by the goroutine relay kept for connections
// without a socket, and that sessions spread over several loops work side
// by side.
func TestSessionsOnEventLoops(t *testing.T) {
	t.Parallel()
	p := startProxy(t, proxy.Options{RelayLoops: 2})
	a := connect(t, superDSN(p))
	b := connect(t, superDSN(p))
	c := connect(t, superDSN(p))
	for range 50 {
		selectOne(t, a)
		selectOne(t, b)
		selectOne(t, c)
	}
	if n := proxy.LoopedSessions(p.Server); n != 3 {
		t.Fatalf("%d of 3 sessions on an event loop", n)
	}
}
