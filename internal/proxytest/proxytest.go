// Package proxytest runs a proxy.Server in-process for tests: on
// 127.0.0.1, on a port the kernel picks, in front of a given upstream, shut
// down when the test ends.
//
// The caller passes the proxy.Options it wants to exercise (TLS, limits, a
// real Policy); Start fills in only UpstreamAddr and, when it is nil, a
// Logger that writes to the test log. The returned Proxy builds connection
// strings that point at the proxy, like pgcluster.Cluster does for the
// server behind it.
package proxytest

import (
	"context"
	"errors"
	"net"
	"net/url"
	"strconv"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"

	"github.com/fenceproxy/fenceproxy/internal/proxy"
)

// ShutdownTimeout bounds the graceful shutdown done at cleanup; sessions
// still open when it expires are closed with an admin-shutdown error.
const ShutdownTimeout = 5 * time.Second

// Proxy is a running proxy.Server.
type Proxy struct {
	// Server is the running server, e.g. for ActiveSessions or to call
	// Shutdown from the test (Shutdown at cleanup is then a no-op).
	Server *proxy.Server
	// Options are the options the server was built with (UpstreamAddr
	// and Logger filled in).
	Options proxy.Options

	addr  *net.TCPAddr
	serve chan error // receives Serve's result, once
}

// Start starts a proxy in front of upstream (host:port) with opts and
// registers a cleanup that shuts it down, waits for its sessions to end and
// fails the test if Serve ended with anything but proxy.ErrServerClosed.
// A nil opts.Logger is replaced by a logger writing Info and above to t's
// log; opts.UpstreamAddr is set to upstream.
func Start(t testing.TB, upstream string, opts proxy.Options) *Proxy {
	t.Helper()
	opts.UpstreamAddr = upstream
	if opts.Logger == nil {
		opts.Logger = zaptest.NewLogger(t, zaptest.Level(zap.InfoLevel)).Named("proxy")
	}
	srv, err := proxy.NewServer(opts)
	if err != nil {
		t.Fatalf("proxytest: %v", err)
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("proxytest: listen: %v", err)
	}
	p := &Proxy{
		Server:  srv,
		Options: opts,
		addr:    l.Addr().(*net.TCPAddr),
		serve:   make(chan error, 1),
	}
	go func() { p.serve <- srv.Serve(l) }()
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), ShutdownTimeout)
		defer cancel()
		if err := srv.Shutdown(ctx); err != nil {
			t.Errorf("proxytest: shutdown: %v", err)
		}
		// Serve returns once its listener is closed; wait for it so that
		// nothing logs after the test has ended.
		if err := <-p.serve; !errors.Is(err, proxy.ErrServerClosed) {
			t.Errorf("proxytest: Serve returned %v, want %v", err, proxy.ErrServerClosed)
		}
	})
	return p
}

// Addr is the proxy's listening address, host:port.
func (p *Proxy) Addr() string { return p.addr.String() }

// Host is the proxy's listening IP address, "127.0.0.1".
func (p *Proxy) Host() string { return p.addr.IP.String() }

// Port is the proxy's listening port.
func (p *Proxy) Port() int { return p.addr.Port }

// URL returns a connection URL through the proxy with sslmode=disable;
// callers may change its query (e.g. sslmode=verify-full) before use. An
// empty user or password is left out.
func (p *Proxy) URL(user, password, database string) *url.URL {
	u := &url.URL{
		Scheme:   "postgres",
		Host:     net.JoinHostPort(p.Host(), strconv.Itoa(p.Port())),
		Path:     "/" + database,
		RawQuery: url.Values{"sslmode": {"disable"}}.Encode(),
	}
	switch {
	case user != "" && password != "":
		u.User = url.UserPassword(user, password)
	case user != "":
		u.User = url.User(user)
	}
	return u
}

// DSN returns URL(user, password, database) as a string. It contains the
// password: do not log it.
func (p *Proxy) DSN(user, password, database string) string {
	return p.URL(user, password, database).String()
}
