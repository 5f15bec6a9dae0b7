package proxy_test

import (
	"crypto/tls"
	"testing"

	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// TestDirectTLSNegotiatesALPN: a client that opens with a TLS handshake
// (PostgreSQL 17's sslnegotiation=direct) and asks for the "postgresql"
// ALPN protocol gets it; libpq refuses a direct TLS connection without it.
func TestDirectTLSNegotiatesALPN(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	p := startProxy(t, proxy.Options{ClientTLS: certs.ServerTLSConfig()})
	cfg := certs.ClientTLSConfig("localhost")
	cfg.NextProtos = []string{"postgresql"}
	c, err := tls.Dial("tcp", p.Addr(), cfg)
	if err != nil {
		t.Fatalf("direct TLS handshake: %v", err)
	}
	defer c.Close()
	if got := c.ConnectionState().NegotiatedProtocol; got != "postgresql" {
		t.Fatalf("negotiated ALPN protocol %q, want \"postgresql\"", got)
	}
}
