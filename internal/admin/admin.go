// Package admin serves fenceproxy's admin HTTP endpoints: Prometheus
// /metrics, /healthz (the process is up), /readyz (the upstream answers
// and the proxy is not draining), /sessions (the client sessions), /rules
// (the rules in force), a status page for people at / (docs/observability.md)
// and, when enabled, Go's profiler under /debug/pprof/.
package admin

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/pprof"
	"os"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/rules"
)

// ReadyFunc reports nil when the proxy can serve clients.
type ReadyFunc func(ctx context.Context) error

// Options say what the admin endpoints serve.
type Options struct {
	// Registry is served on /metrics.
	Registry *prometheus.Registry
	// Ready answers /readyz.
	Ready ReadyFunc
	// Sessions answers /sessions. nil: 404.
	Sessions func() []proxy.SessionSnapshot
	// Rules answers /rules. nil: 404.
	Rules func() Rules
	// Status makes the status page at /. nil: 404.
	Status StatusFunc
	// Pprof serves net/http/pprof under /debug/pprof/.
	Pprof bool
}

// Rules is the document /rules serves: the rules in force and the
// configuration file they came from.
type Rules struct {
	// ConfigFile is the path of the configuration file ("" when the
	// instance was started without one).
	ConfigFile string `json:"config_file"`
	// ConfigSHA256 is the hex SHA-256 of the file's bytes as last loaded.
	ConfigSHA256 string `json:"config_sha256"`
	// LoadedAt is when those rules were installed.
	LoadedAt     time.Time `json:"loaded_at"`
	TokenSetting string    `json:"token_setting"`
	Tables       []Table   `json:"tables"`
}

// Table is one entry of the rules, with the defaults filled in.
type Table struct {
	Table        string      `json:"table"`
	Column       string      `json:"column"`
	Mode         string      `json:"mode"`
	OnStale      string      `json:"on_stale"`
	Strict       bool        `json:"strict"`
	MissingToken string      `json:"missing_token"`
	Scope        rules.Scope `json:"scope"`
}

// Handler returns the admin mux.
func Handler(opts Options) http.Handler {
	mux := http.NewServeMux()
	reg := opts.Registry
	mux.Handle("GET /metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{Registry: reg}))
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		_, _ = io.WriteString(w, "ok\n")
	})
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, r *http.Request) {
		ctx, cancel := context.WithTimeout(r.Context(), 2*time.Second)
		defer cancel()
		if err := opts.Ready(ctx); err != nil {
			w.WriteHeader(http.StatusServiceUnavailable)
			_, _ = io.WriteString(w, "not ready: "+err.Error()+"\n")
			return
		}
		_, _ = io.WriteString(w, "ok\n")
	})
	if opts.Sessions != nil {
		mux.HandleFunc("GET /sessions", func(w http.ResponseWriter, _ *http.Request) {
			writeJSON(w, opts.Sessions())
		})
	}
	if opts.Rules != nil {
		mux.HandleFunc("GET /rules", func(w http.ResponseWriter, _ *http.Request) {
			writeJSON(w, opts.Rules())
		})
	}
	if opts.Status != nil {
		mux.HandleFunc("GET /{$}", statusHandler(opts.Status))
	}
	if opts.Pprof {
		mux.HandleFunc("GET /debug/pprof/", pprof.Index)
		mux.HandleFunc("GET /debug/pprof/cmdline", pprof.Cmdline)
		mux.HandleFunc("GET /debug/pprof/profile", pprof.Profile)
		mux.HandleFunc("GET /debug/pprof/symbol", pprof.Symbol)
		mux.HandleFunc("POST /debug/pprof/symbol", pprof.Symbol)
		mux.HandleFunc("GET /debug/pprof/trace", pprof.Trace)
	}
	return mux
}

func writeJSON(w http.ResponseWriter, v any) {
	w.Header().Set("Content-Type", "application/json")
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	_ = enc.Encode(v)
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
