package metrics_test

import (
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil/promlint"
	dto "github.com/prometheus/client_model/go"

	"github.com/fenceproxy/fenceproxy/internal/dbsetup"
	"github.com/fenceproxy/fenceproxy/internal/metrics"
	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/rules"
)

// TestHooksMoveMetrics: each hook moves the metric named for it.
func TestHooksMoveMetrics(t *testing.T) {
	m := metrics.New()
	h := m.Hooks()
	for _, a := range []proxy.Action{proxy.Forward, proxy.Forward, proxy.Rewrite, proxy.Refuse} {
		h.Statement(&proxy.SessionInfo{}, rules.Decision{Action: a}, time.Microsecond)
	}
	h.Statement(&proxy.SessionInfo{}, rules.Decision{Action: proxy.Rewrite, Tables: []string{"public.a", "public.b"}}, 0)
	h.Statement(&proxy.SessionInfo{}, rules.Decision{Action: proxy.Refuse, Tables: []string{"public.a"}}, 0)
	h.Statement(&proxy.SessionInfo{}, rules.Decision{Action: proxy.Refuse, Tables: []string{"public.a"}}, 0)
	for k, want := range map[[2]string]float64{{"public.a", "rewritten"}: 1, {"public.b", "rewritten"}: 1, {"public.a", "refused"}: 2, {"public.b", "refused"}: 0} {
		if got := value(t, m.TableStatements.WithLabelValues(k[0], k[1])); got != want {
			t.Errorf("fenceproxy_table_statements_total{table=%q,action=%q} = %v, want %v", k[0], k[1], got, want)
		}
	}
	th := h
	th.UpstreamConnected(3 * time.Millisecond)
	th.SessionEnded(2 * time.Second)
	h.AcceptFailed(nil)

	for action, want := range map[string]float64{"forwarded": 2, "rewritten": 2, "refused": 3} {
		if got := value(t, m.Statements.WithLabelValues(action)); got != want {
			t.Errorf("fenceproxy_statements_total{action=%q} = %v, want %v", action, got, want)
		}
	}
	for name, want := range map[string]int{
		"fenceproxy_statement_decision_duration_seconds": 7,
		"fenceproxy_upstream_connect_duration_seconds":   1,
		"fenceproxy_session_duration_seconds":            1,
	} {
		if got := sampleCount(t, m, name); got != want {
			t.Errorf("%s_count = %d, want %d", name, got, want)
		}
	}
	if got := value(t, m.AcceptErrors); got != 1 {
		t.Errorf("fenceproxy_accept_errors_total = %v, want 1", got)
	}
	if got := series(t, m, "fenceproxy_build_info"); len(got) != 1 || got[0].GetGauge().GetValue() != 1 {
		t.Errorf("fenceproxy_build_info = %v, want one series of 1", got)
	}
	m.AuditListenerUp.WithLabelValues("app").Set(1)
	if got := value(t, m.AuditListenerUp.WithLabelValues("app")); got != 1 {
		t.Errorf("fenceproxy_audit_listener_up = %v, want 1", got)
	}
}

// TestMetricNamesLint: the metrics follow Prometheus' naming conventions.
func TestMetricNamesLint(t *testing.T) {
	m := metrics.New()
	mfs, err := m.Registry.Gather()
	if err != nil {
		t.Fatal(err)
	}
	problems, err := promlint.NewWithMetricFamilies(mfs).Lint()
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range problems {
		if strings.HasPrefix(p.Metric, "fenceproxy_") {
			t.Errorf("%s: %s", p.Metric, p.Text)
		}
	}
}

// TestCheckResult: a check's outcome sets fenceproxy_check_problems of its
// database, -1 when the check could not run.
func TestCheckResult(t *testing.T) {
	m := metrics.New()
	var cm dbsetup.CheckMetrics = m
	cm.CheckResult("app", 3, true)
	cm.CheckResult("other", 0, false)
	for db, want := range map[string]float64{"app": 3, "other": -1} {
		if got := value(t, m.CheckProblems.WithLabelValues(db)); got != want {
			t.Errorf("fenceproxy_check_problems{database=%q} = %v, want %v", db, got, want)
		}
	}
	cm.CheckResult("app", 0, true)
	if got := value(t, m.CheckProblems.WithLabelValues("app")); got != 0 {
		t.Errorf("fenceproxy_check_problems{database=\"app\"} = %v after a clean check, want 0", got)
	}
}

func sampleCount(t *testing.T, m *metrics.Metrics, name string) int {
	t.Helper()
	ss := series(t, m, name)
	if len(ss) != 1 {
		t.Fatalf("%s: %d series, want 1", name, len(ss))
	}
	return int(ss[0].GetHistogram().GetSampleCount())
}

func series(t *testing.T, m *metrics.Metrics, name string) []*dto.Metric {
	t.Helper()
	mfs, err := m.Registry.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == name {
			return mf.GetMetric()
		}
	}
	t.Fatalf("%s not gathered", name)
	return nil
}

// value reads one counter or gauge.
func value(t *testing.T, c prometheus.Metric) float64 {
	t.Helper()
	var d dto.Metric
	if err := c.Write(&d); err != nil {
		t.Fatal(err)
	}
	if d.Counter != nil {
		return d.Counter.GetValue()
	}
	return d.Gauge.GetValue()
}

// TestOffLoopTasks: the off-loop gauges are 0 until a source is set, then
// read it at every scrape.
func TestOffLoopTasks(t *testing.T) {
	m := metrics.New()
	read := func() (running, waiting float64) {
		t.Helper()
		for _, s := range series(t, m, "fenceproxy_off_loop_tasks") {
			for _, l := range s.GetLabel() {
				switch {
				case l.GetName() == "state" && l.GetValue() == "running":
					running = s.GetGauge().GetValue()
				case l.GetName() == "state" && l.GetValue() == "waiting":
					waiting = s.GetGauge().GetValue()
				}
			}
		}
		return running, waiting
	}
	if r, w := read(); r != 0 || w != 0 {
		t.Errorf("before a source: running %v, waiting %v", r, w)
	}
	n := 3
	m.CountOffLoopTasks(func() (int, int) { return n, 2 * n })
	if r, w := read(); r != 3 || w != 6 {
		t.Errorf("running %v, waiting %v; want 3 and 6", r, w)
	}
	n = 1
	if r, w := read(); r != 1 || w != 2 {
		t.Errorf("after a change: running %v, waiting %v; want 1 and 2", r, w)
	}
}
