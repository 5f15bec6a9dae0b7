// Package metrics defines fenceproxy's Prometheus metrics and implements
// proxy.Hooks with them.
//
// Label values come from the configuration (table names, reasons and
// results from a fixed set) or from the build. The exceptions are
// fenceproxy_audit_listener_up{database} and
// fenceproxy_check_problems{database}: database names come from
// authenticated clients, and packages audit and dbsetup bound how many
// databases they serve.
package metrics

import (
	"runtime/debug"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/rules"
)

// Metrics holds every fenceproxy metric, registered in its own registry.
type Metrics struct {
	Registry *prometheus.Registry

	ConnectionsCurrent    prometheus.Gauge
	ConnectionsTotal      prometheus.Counter
	UpstreamConnectErrors prometheus.Counter
	AcceptErrors          prometheus.Counter
	BuildInfo             *prometheus.GaugeVec // version, revision, goversion
	ConfigLastReload      prometheus.Gauge
	Statements            *prometheus.CounterVec // action (forwarded|rewritten|refused)
	DecisionSeconds       prometheus.Histogram
	UpstreamConnectSecs   prometheus.Histogram
	SessionSeconds        prometheus.Histogram
	AuditListenerUp       *prometheus.GaugeVec   // database
	StaleRejections       *prometheus.CounterVec // table
	MissingTokens         *prometheus.CounterVec // table, outcome (rejected|allowed)
	AuditWouldReject      *prometheus.CounterVec // table, reason (stale|missing_token)
	LockRejections        *prometheus.CounterVec // lock, reason (stale|missing_lock|missing_token)
	ConfigReloads         *prometheus.CounterVec // result (ok|failed)
	CheckProblems         *prometheus.GaugeVec   // database
	// TableStatements counts the rewritten and refused statements by the
	// protected table they concern (a statement on two counts for both).
	TableStatements *prometheus.CounterVec // table, action (rewritten|refused)
	// tableCounters caches TableStatements' children by action and table:
	// Statement runs for every Query and Parse.
	tableCounters sync.Map // tableKey -> prometheus.Counter

	logDropped atomic.Pointer[func() uint64]                 // CountDroppedLogLines
	offLoop    atomic.Pointer[func() (running, waiting int)] // CountOffLoopTasks
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
		BuildInfo: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "fenceproxy_build_info", Help: "Always 1; the labels say which build is running.",
		}, []string{"version", "revision", "goversion"}),
		ConfigLastReload: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "fenceproxy_config_last_reload_success_timestamp_seconds",
			Help: "Unix time of the last successful load of the configuration (at start or by a reload).",
		}),
		Statements: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "fenceproxy_statements_total",
			Help: "Query and Parse messages decided on, by action: forwarded unchanged, rewritten (fenced) or refused without being executed.",
		}, []string{"action"}),
		DecisionSeconds: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "fenceproxy_statement_decision_duration_seconds",
			Help:    "Time taken to decide on (and rewrite) one Query or Parse message, waits included (for the server's lexing settings, for a decision made off the relay's event loop); on the loop it is read from the loop's clock, so a decision made within one wake-up counts as 0.",
			Buckets: []float64{1e-6, 5e-6, 2e-5, 1e-4, 5e-4, 2e-3, 1e-2, 5e-2},
		}),
		UpstreamConnectSecs: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "fenceproxy_upstream_connect_duration_seconds",
			Help:    "Time taken by successful connections to the upstream server (dial and TLS negotiation).",
			Buckets: []float64{5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1, 2.5, 5},
		}),
		SessionSeconds: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "fenceproxy_session_duration_seconds",
			Help:    "Lifetime of client sessions, from accept to close.",
			Buckets: []float64{0.01, 0.1, 1, 10, 60, 300, 1800, 3600, 4 * 3600, 24 * 3600},
		}),
		AuditListenerUp: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "fenceproxy_audit_listener_up",
			Help: "1 while the audit listener of a database has its LISTEN in force, 0 while audit events there are lost.",
		}, []string{"database"}),
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
		CheckProblems: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "fenceproxy_check_problems",
			Help: "Problems the last check of a database found (as fenceproxy check reports them: fence columns, fenceproxy objects, privileges); -1 when the last check could not run.",
		}, []string{"database"}),
		TableStatements: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "fenceproxy_table_statements_total",
			Help: "Query and Parse messages on protected tables that were rewritten (fenced) or refused, by table (as the configuration names it); a statement on several tables counts for each.",
		}, []string{"table", "action"}),
		LockRejections: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "fenceproxy_lock_rejections_total",
			Help: "Statements on lock-fenced tables refused by the lock registration: a token older than the lock's watermark (stale), or no lock name or token where one is required. The lock label holds the first 100 lock names seen, then \"other\".",
		}, []string{"lock", "reason"}),
	}
	logDropped := prometheus.NewCounterFunc(prometheus.CounterOpts{
		Name: "fenceproxy_log_lines_dropped_total",
		Help: "Log lines dropped because the log output (standard error) did not keep up; the proxy never waits for it.",
	}, func() float64 {
		if f := m.logDropped.Load(); f != nil {
			return float64((*f)())
		}
		return 0
	})
	offLoop := func(state string, pick func(running, waiting int) int) prometheus.GaugeFunc {
		return prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name:        "fenceproxy_off_loop_tasks",
			Help:        "Work that runs off the relay's event loops (a first-seen statement's parse, a decision waiting for a database's check): running, holding one of a bounded number of slots, or waiting for one, its session waiting meanwhile.",
			ConstLabels: prometheus.Labels{"state": state},
		}, func() float64 {
			if f := m.offLoop.Load(); f != nil {
				return float64(pick((*f)()))
			}
			return 0
		})
	}
	m.Registry.MustRegister(
		logDropped,
		offLoop("running", func(r, _ int) int { return r }),
		offLoop("waiting", func(_, w int) int { return w }),
		collectors.NewGoCollector(),
		collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}),
		m.ConnectionsCurrent, m.ConnectionsTotal, m.UpstreamConnectErrors, m.AcceptErrors,
		m.BuildInfo, m.ConfigLastReload, m.Statements, m.DecisionSeconds,
		m.UpstreamConnectSecs, m.SessionSeconds, m.AuditListenerUp,
		m.StaleRejections, m.MissingTokens, m.AuditWouldReject, m.ConfigReloads,
		m.CheckProblems,
		m.LockRejections,
		m.TableStatements,
	)
	m.BuildInfo.WithLabelValues(buildInfo()).Set(1)
	for _, a := range []string{"forwarded", "rewritten", "refused"} {
		m.Statements.WithLabelValues(a)
	}
	// Make the reload series visible before the first reload.
	m.ConfigReloads.WithLabelValues("ok")
	m.ConfigReloads.WithLabelValues("failed")
	return m
}

// CountDroppedLogLines makes fenceproxy_log_lines_dropped_total report
// what dropped returns (the log output's count).
func (m *Metrics) CountDroppedLogLines(dropped func() uint64) { m.logDropped.Store(&dropped) }

// CountOffLoopTasks makes fenceproxy_off_loop_tasks report what tasks
// returns (proxy.Server.OffLoopTasks).
func (m *Metrics) CountOffLoopTasks(tasks func() (running, waiting int)) { m.offLoop.Store(&tasks) }

// Hooks returns the proxy.Hooks that feed these metrics.
func (m *Metrics) Hooks() proxy.Hooks {
	return hooks{m: m, forwarded: m.Statements.WithLabelValues("forwarded"),
		rewritten: m.Statements.WithLabelValues("rewritten"), refused: m.Statements.WithLabelValues("refused")}
}

// hooks holds the statement counters resolved once: Statement runs for
// every Query and Parse, and resolving labels allocates.
type hooks struct {
	m                             *Metrics
	forwarded, rewritten, refused prometheus.Counter
}

var _ proxy.Hooks = hooks{}

func (h hooks) SessionOpened() {
	h.m.ConnectionsCurrent.Inc()
	h.m.ConnectionsTotal.Inc()
}

func (h hooks) SessionClosed() { h.m.ConnectionsCurrent.Dec() }

func (h hooks) UpstreamConnectFailed() { h.m.UpstreamConnectErrors.Inc() }

func (h hooks) AcceptFailed(error) { h.m.AcceptErrors.Inc() }

func (h hooks) UpstreamConnected(took time.Duration) { h.m.UpstreamConnectSecs.Observe(took.Seconds()) }

func (h hooks) SessionEnded(lasted time.Duration) { h.m.SessionSeconds.Observe(lasted.Seconds()) }

func (h hooks) Statement(_ *proxy.SessionInfo, d rules.Decision, took time.Duration) {
	h.m.DecisionSeconds.Observe(took.Seconds())
	switch d.Action {
	case proxy.Rewrite:
		h.rewritten.Inc()
		h.m.countTables("rewritten", d.Tables)
	case proxy.Refuse:
		h.refused.Inc()
		h.m.countTables("refused", d.Tables)
	default:
		h.forwarded.Inc()
	}
}

type tableKey struct{ action, table string }

// countTables counts a statement of action for each of tables. The
// tables are protected tables in display form, from the configuration,
// so the label values are bounded by it.
func (m *Metrics) countTables(action string, tables []string) {
	for _, t := range tables {
		k := tableKey{action, t}
		c, ok := m.tableCounters.Load(k)
		if !ok {
			c, _ = m.tableCounters.LoadOrStore(k, m.TableStatements.WithLabelValues(t, action))
		}
		c.(prometheus.Counter).Inc()
	}
}

// CheckResult records the outcome of a database check: the number of
// problems found, or -1 when the check could not run (known false). It
// implements dbsetup.CheckMetrics.
func (m *Metrics) CheckResult(database string, problems int, known bool) {
	v := float64(problems)
	if !known {
		v = -1
	}
	m.CheckProblems.WithLabelValues(database).Set(v)
}

// buildInfo returns the module version, VCS revision and Go version the
// binary was built with (go build records them), "unknown" for what is
// missing.
func buildInfo() (version, revision, goversion string) {
	version, revision, goversion = "unknown", "unknown", "unknown"
	bi, ok := debug.ReadBuildInfo()
	if !ok {
		return
	}
	if bi.Main.Version != "" {
		version = bi.Main.Version
	}
	if bi.GoVersion != "" {
		goversion = bi.GoVersion
	}
	for _, s := range bi.Settings {
		if s.Key == "vcs.revision" && s.Value != "" {
			revision = s.Value
		}
	}
	return
}
