// Package metrics defines fenceproxy's Prometheus metrics and implements
// proxy.Hooks with them.
//
// Label values come only from the configuration (table names, reasons and
// results from a fixed set), never from client input, so the number of
// series is bounded by the config.
package metrics

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	"github.com/fenceproxy/fenceproxy/proxy"
)

// Metrics holds every fenceproxy metric, registered in its own registry.
type Metrics struct {
	Registry *prometheus.Registry

	ConnectionsCurrent    prometheus.Gauge
	ConnectionsTotal      prometheus.Counter
	UpstreamConnectErrors prometheus.Counter
	AcceptErrors          prometheus.Counter
	StatementsInspected   prometheus.Counter
	StatementsRewritten   prometheus.Counter
	StatementsRefused     prometheus.Counter
	RewriteSeconds        prometheus.Histogram
	StaleRejections       *prometheus.CounterVec // table
	MissingTokens         *prometheus.CounterVec // table, outcome (rejected|allowed)
	AuditWouldReject      *prometheus.CounterVec // table, reason (stale|missing_token)
	ConfigReloads         *prometheus.CounterVec // result (ok|failed)
}

// New creates the metrics in a fresh registry that also carries the Go and
// process collectors.
func New() *Metrics {
	m := &Metrics{
		Registry: prometheus.NewRegistry(),
		ConnectionsCurrent: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "fenceproxy_connections_current", Help: "Client sessions being served.",
		}),
		ConnectionsTotal: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "fenceproxy_connections_total", Help: "Client sessions accepted since start.",
		}),
		UpstreamConnectErrors: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "fenceproxy_upstream_connect_errors_total", Help: "Failed attempts to connect to the upstream PostgreSQL server.",
		}),
		AcceptErrors: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "fenceproxy_accept_errors_total", Help: "Failed accepts of client connections that were retried (e.g. out of file descriptors).",
		}),
		StatementsInspected: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "fenceproxy_statements_inspected_total", Help: "Query and Parse messages given to the rewriter.",
		}),
		StatementsRewritten: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "fenceproxy_statements_rewritten_total", Help: "Statements forwarded in fenced (rewritten) form.",
		}),
		StatementsRefused: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "fenceproxy_statements_refused_total", Help: "Statements refused by the proxy without being executed.",
		}),
		RewriteSeconds: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "fenceproxy_rewrite_duration_seconds",
			Help:    "Time taken to decide (and rewrite) one Query or Parse message.",
			Buckets: []float64{1e-6, 5e-6, 2e-5, 1e-4, 5e-4, 2e-3, 1e-2, 5e-2},
		}),
		StaleRejections: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "fenceproxy_stale_rejections_total", Help: "Writes rejected because their fencing token was older than the row's watermark.",
		}, []string{"table"}),
		MissingTokens: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "fenceproxy_missing_tokens_total", Help: "Writes to protected tables without a valid fencing token.",
		}, []string{"table", "outcome"}),
		AuditWouldReject: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "fenceproxy_audit_would_reject_total", Help: "Writes in audit mode that enforce mode would have rejected.",
		}, []string{"table", "reason"}),
		ConfigReloads: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "fenceproxy_config_reloads_total", Help: "Configuration reloads by result.",
		}, []string{"result"}),
	}
	m.Registry.MustRegister(
		collectors.NewGoCollector(),
		collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}),
		m.ConnectionsCurrent, m.ConnectionsTotal, m.UpstreamConnectErrors, m.AcceptErrors,
		m.StatementsInspected, m.StatementsRewritten, m.StatementsRefused, m.RewriteSeconds,
		m.StaleRejections, m.MissingTokens, m.AuditWouldReject, m.ConfigReloads,
	)
	// Make the reload series visible before the first reload.
	m.ConfigReloads.WithLabelValues("ok")
	m.ConfigReloads.WithLabelValues("failed")
	return m
}

// Hooks returns the proxy.Hooks that feed these metrics.
func (m *Metrics) Hooks() proxy.Hooks { return hooks{m} }

type hooks struct{ m *Metrics }

func (h hooks) SessionOpened() {
	h.m.ConnectionsCurrent.Inc()
	h.m.ConnectionsTotal.Inc()
}

func (h hooks) SessionClosed() { h.m.ConnectionsCurrent.Dec() }

func (h hooks) UpstreamConnectFailed() { h.m.UpstreamConnectErrors.Inc() }

func (h hooks) AcceptFailed(error) { h.m.AcceptErrors.Inc() }

func (h hooks) Statement(_ *proxy.SessionInfo, d *proxy.Decision, took time.Duration) {
	h.m.StatementsInspected.Inc()
	h.m.RewriteSeconds.Observe(took.Seconds())
	switch d.Action {
	case proxy.Rewrite:
		h.m.StatementsRewritten.Inc()
	case proxy.Refuse:
		h.m.StatementsRefused.Inc()
	}
}
