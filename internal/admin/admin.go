// Package admin serves fenceproxy's admin HTTP endpoints: Prometheus
// /metrics, /healthz (the process is up) and /readyz (the upstream answers
// and the proxy is not draining).
package admin

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// ReadyFunc reports nil when the proxy can serve clients.
type ReadyFunc func(ctx context.Context) error

// Handler returns the admin mux.
func Handler(reg *prometheus.Registry, ready ReadyFunc) http.Handler {
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{Registry: reg}))
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		_, _ = io.WriteString(w, "ok\n")
	})
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, r *http.Request) {
		ctx, cancel := context.WithTimeout(r.Context(), 2*time.Second)
		defer cancel()
		if err := ready(ctx); err != nil {
			w.WriteHeader(http.StatusServiceUnavailable)
			_, _ = io.WriteString(w, "not ready: "+err.Error()+"\n")
			return
		}
		_, _ = io.WriteString(w, "ok\n")
	})
	return mux
}

// ProbeUpstream checks that PostgreSQL answers at addr on network ("tcp",
// or "unix" with the socket file's path): it sends an SSLRequest and
// waits, until ctx is done, for the one-byte answer ('S' or 'N'), then
// closes the connection. A successful TCP connect alone proves
// little: a stopped postmaster's listen backlog still completes
// handshakes. PostgreSQL logs nothing for a connection closed after a
// refused SSLRequest; a server with TLS enabled may log the unfinished
// handshake.
func ProbeUpstream(ctx context.Context, network, addr string) error {
	var d net.Dialer
	c, err := d.DialContext(ctx, network, addr)
	if err != nil {
		return err
	}
	defer c.Close()
	if dl, ok := ctx.Deadline(); ok {
		_ = c.SetDeadline(dl)
	}
	stop := context.AfterFunc(ctx, func() { _ = c.SetDeadline(time.Now()) })
	defer stop()
	var req [8]byte
	binary.BigEndian.PutUint32(req[0:4], 8)
	binary.BigEndian.PutUint32(req[4:8], sslRequestCode)
	if _, err := c.Write(req[:]); err != nil {
		return fmt.Errorf("send SSLRequest: %w", err)
	}
	var answer [1]byte
	if _, err := io.ReadFull(c, answer[:]); err != nil {
		if ctx.Err() != nil || errors.Is(err, os.ErrDeadlineExceeded) {
			return errors.New("connected, but no answer to an SSLRequest in time")
		}
		return fmt.Errorf("read SSLRequest answer: %w", err)
	}
	return nil
}

// sslRequestCode is the SSLRequest code of the PostgreSQL protocol.
const sslRequestCode = 80877103

// Serve runs the admin server on l until ctx is done.
func Serve(ctx context.Context, l net.Listener, h http.Handler) error {
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 5 * time.Second}
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(l) }()
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
		sctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		_ = srv.Shutdown(sctx)
		if err := <-errc; !errors.Is(err, http.ErrServerClosed) {
			return err
		}
		return nil
	}
}
