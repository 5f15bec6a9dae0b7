package service_test

import (
	"encoding/json"
	"log/slog"
	"net/http"
	"os"
	"sort"
	"strings"
	"testing"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"github.com/prometheus/prometheus/model/rulefmt"
	"github.com/prometheus/prometheus/promql/parser"

	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

const (
	dashboardFile = "../../deploy/grafana/fenceproxy-dashboard.json"
	alertsFile    = "../../deploy/grafana/fenceproxy-alerts.yaml"
)

// grafanaVariables replaces the dashboard's template variables with
// values PromQL parses, as Grafana interpolates them.
var grafanaVariables = strings.NewReplacer(
	"$__rate_interval", "5m",
	"$__interval", "1m",
	"$__range", "1h",
	`"$job"`, `".*"`,
	`"$instance"`, `".*"`,
)

// dashboardExprs returns the PromQL expressions of the dashboard's panels
// and template variables' label_values queries (their metric), by panel.
func dashboardExprs(t *testing.T) map[string]string {
	t.Helper()
	data, err := os.ReadFile(dashboardFile)
	if err != nil {
		t.Fatal(err)
	}
	var d struct {
		Panels []struct {
			Title   string `json:"title"`
			Type    string `json:"type"`
			Targets []struct {
				RefID string `json:"refId"`
				Expr  string `json:"expr"`
			} `json:"targets"`
		} `json:"panels"`
		Templating struct {
			List []struct {
				Name       string `json:"name"`
				Definition string `json:"definition"`
			} `json:"list"`
		} `json:"templating"`
	}
	if err := json.Unmarshal(data, &d); err != nil {
		t.Fatalf("%s: %v", dashboardFile, err)
	}
	out := map[string]string{}
	for _, p := range d.Panels {
		if p.Type != "row" && len(p.Targets) == 0 {
			t.Errorf("panel %q has no query", p.Title)
		}
		for _, tg := range p.Targets {
			if tg.Expr == "" {
				t.Errorf("panel %q target %s has no expr", p.Title, tg.RefID)
			}
			out["panel "+p.Title+" "+tg.RefID] = grafanaVariables.Replace(tg.Expr)
		}
	}
	for _, v := range d.Templating.List {
		// label_values(METRIC_SELECTOR, LABEL): the selector is PromQL.
		if rest, ok := strings.CutPrefix(v.Definition, "label_values("); ok {
			sel := rest[:strings.LastIndex(rest, ",")]
			out["variable "+v.Name] = grafanaVariables.Replace(sel)
		}
	}
	if len(out) < 20 {
		t.Fatalf("%d expressions in the dashboard; the file is not what this test expects", len(out))
	}
	return out
}

// alertExprs parses the alerting rules with Prometheus's own rule parser
// (what promtool check rules runs) and returns their expressions.
func alertExprs(t *testing.T) map[string]string {
	t.Helper()
	data, err := os.ReadFile(alertsFile)
	if err != nil {
		t.Fatal(err)
	}
	groups, errs := rulefmt.Parse(data, false, model.UTF8Validation, parser.NewParser(parser.Options{}), slog.New(slog.DiscardHandler))
	for _, err := range errs {
		t.Errorf("%s: %v", alertsFile, err)
	}
	if len(errs) > 0 {
		t.FailNow()
	}
	out := map[string]string{}
	for _, g := range groups.Groups {
		for _, r := range g.Rules {
			if r.Alert == "" {
				t.Errorf("rule %q is not an alert", r.Record)
				continue
			}
			if r.Labels["severity"] == "" || r.Annotations["summary"] == "" {
				t.Errorf("alert %s: no severity label or summary annotation", r.Alert)
			}
			out["alert "+r.Alert] = r.Expr
		}
	}
	return out
}

// family returns the metric family a series name belongs to (a
// histogram's _bucket, _sum and _count are its own).
func family(fams map[string]*dto.MetricFamily, name string) *dto.MetricFamily {
	if f, ok := fams[name]; ok {
		return f
	}
	for _, suf := range []string{"_bucket", "_sum", "_count"} {
		if base, ok := strings.CutSuffix(name, suf); ok {
			if f, ok := fams[base]; ok && (f.GetType() == dto.MetricType_HISTOGRAM || f.GetType() == dto.MetricType_SUMMARY) {
				return f
			}
		}
	}
	return nil
}

// targetLabels are added by Prometheus when it scrapes, and le by
// histograms; they are not on the proxy's own samples.
var targetLabels = map[string]bool{"job": true, "instance": true, "le": true, "__name__": true}

// TestDashboardAndAlertsUseExportedMetrics: every metric the Grafana
// dashboard and the alerting rules select is one a running proxy exports
// (scraped from /metrics after traffic that moves each of them), with the
// labels they match on and group by; the rules load in Prometheus's rule
// parser, and every expression parses as PromQL.
func TestDashboardAndAlertsUseExportedMetrics(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	o := startObserved(t)
	o.traffic(t)
	body := get(t, "http://"+o.in.AdminAddr()+"/metrics", http.StatusOK)
	tp := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := tp.TextToMetricFamilies(strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	labelsOf := func(f *dto.MetricFamily) map[string]bool {
		ls := map[string]bool{}
		for _, m := range f.GetMetric() {
			for _, l := range m.GetLabel() {
				ls[l.GetName()] = true
			}
		}
		return ls
	}

	exprs := dashboardExprs(t)
	alerts := alertExprs(t)
	for k, v := range alerts {
		exprs[k] = v
	}
	used := map[string]bool{}
	p := parser.NewParser(parser.Options{})
	for where, e := range exprs {
		expr, err := p.ParseExpr(e)
		if err != nil {
			t.Errorf("%s: %v\n%s", where, err, e)
			continue
		}
		// The labels a selector's metric must carry: its matchers' and
		// those of the aggregations above it.
		parser.Inspect(expr, func(n parser.Node, path []parser.Node) error {
			vs, ok := n.(*parser.VectorSelector)
			if !ok {
				return nil
			}
			if !strings.HasPrefix(vs.Name, "fenceproxy_") {
				t.Errorf("%s: selects %q, not a fenceproxy metric", where, vs.Name)
				return nil
			}
			f := family(fams, vs.Name)
			if f == nil {
				t.Errorf("%s: metric %s is not exported by the running proxy", where, vs.Name)
				return nil
			}
			used[f.GetName()] = true
			have := labelsOf(f)
			need := map[string]bool{}
			for _, m := range vs.LabelMatchers {
				need[m.Name] = true
			}
			for _, a := range path {
				if ag, ok := a.(*parser.AggregateExpr); ok && !ag.Without {
					for _, g := range ag.Grouping {
						need[g] = true
					}
				}
			}
			for l := range need {
				if !targetLabels[l] && !have[l] {
					t.Errorf("%s: %s has no label %q (it has %v)", where, vs.Name, l, sortedKeys(have))
				}
			}
			return nil
		})
	}
	// What the dashboard leaves out, said here so that a new metric is a
	// decision: the Go and process collectors' series.
	var unused []string
	for name := range fams {
		if strings.HasPrefix(name, "fenceproxy_") && !used[name] {
			unused = append(unused, name)
		}
	}
	sort.Strings(unused)
	if len(unused) > 0 {
		t.Errorf("fenceproxy metrics neither the dashboard nor the alerts use: %v", unused)
	}
	t.Logf("%d expressions over %d fenceproxy metrics", len(exprs), len(used))
}

func sortedKeys(m map[string]bool) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}
