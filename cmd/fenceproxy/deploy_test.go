package main

import (
	"bytes"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"gopkg.in/yaml.v3"
	"helm.sh/helm/v3/pkg/chart/loader"
	"helm.sh/helm/v3/pkg/chartutil"
	"helm.sh/helm/v3/pkg/engine"
	"helm.sh/helm/v3/pkg/lint"
	"helm.sh/helm/v3/pkg/lint/support"
	appsv1 "k8s.io/api/apps/v1"
	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	k8syaml "sigs.k8s.io/yaml"

	"github.com/fenceproxy/fenceproxy/internal/config"
	"github.com/fenceproxy/fenceproxy/internal/pgcluster"
	"github.com/fenceproxy/fenceproxy/internal/pgcluster/pgtest"
	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// The deployment files of issue 31 part 3, checked against this binary:
// deploy/kubernetes (plain manifests and the sidecar variant) and the
// Helm chart deploy/helm/fenceproxy, linted and rendered with Helm's own
// packages.

const (
	chartDir      = "../../deploy/helm/fenceproxy"
	manifestsDir  = "../../deploy/kubernetes"
	binaryInImage = "/usr/local/bin/fenceproxy"
)

// manifests is a set of parsed Kubernetes objects.
type manifests struct {
	name        string
	configMaps  map[string]*corev1.ConfigMap
	deployments []*appsv1.Deployment
	jobs        []*batchv1.Job
	services    []*corev1.Service
	pdbs        []*policyv1.PodDisruptionBudget
	other       []string // kinds checked only for parsing
}

// parseManifests decodes each YAML document of text strictly (an unknown
// field is an error) into the Kubernetes type of its kind.
func parseManifests(t *testing.T, m *manifests, source, text string) {
	t.Helper()
	if m.configMaps == nil {
		m.configMaps = map[string]*corev1.ConfigMap{}
	}
	dec := yaml.NewDecoder(strings.NewReader(text))
	for i := 0; ; i++ {
		var doc map[string]any
		err := dec.Decode(&doc)
		if err == io.EOF {
			return
		}
		if err != nil {
			t.Fatalf("%s: document %d: %v", source, i, err)
		}
		if doc == nil {
			continue
		}
		raw, err := yaml.Marshal(doc)
		if err != nil {
			t.Fatal(err)
		}
		kind, _ := doc["kind"].(string)
		strict := func(v any) {
			t.Helper()
			if err := k8syaml.UnmarshalStrict(raw, v); err != nil {
				t.Fatalf("%s: %s: %v\n%s", source, kind, err, raw)
			}
		}
		switch kind {
		case "ConfigMap":
			var cm corev1.ConfigMap
			strict(&cm)
			m.configMaps[cm.Name] = &cm
		case "Deployment":
			var d appsv1.Deployment
			strict(&d)
			m.deployments = append(m.deployments, &d)
		case "Job":
			var j batchv1.Job
			strict(&j)
			m.jobs = append(m.jobs, &j)
		case "Service":
			var s corev1.Service
			strict(&s)
			m.services = append(m.services, &s)
		case "PodDisruptionBudget":
			var p policyv1.PodDisruptionBudget
			strict(&p)
			m.pdbs = append(m.pdbs, &p)
		case "ServiceAccount":
			var sa corev1.ServiceAccount
			strict(&sa)
			m.other = append(m.other, kind)
		case "ServiceMonitor", "Kustomization":
			m.other = append(m.other, kind)
		default:
			t.Fatalf("%s: unexpected kind %q", source, kind)
		}
	}
}

// helpFlags returns the long flags `fenceproxy sub --help` lists.
func helpFlags(t *testing.T, sub string) map[string]bool {
	t.Helper()
	var out, errb bytes.Buffer
	if code := runMain([]string{sub, "--help"}, nil, &out, &errb); code != 0 {
		t.Fatalf("fenceproxy %s --help: exit %d\n%s", sub, code, errb.String())
	}
	flags := map[string]bool{}
	for _, m := range regexp.MustCompile(`(?m)^  -([a-z][a-z0-9-]*)`).FindAllStringSubmatch(out.String(), -1) {
		flags[m[1]] = true
	}
	if len(flags) == 0 {
		t.Fatalf("fenceproxy %s --help lists no flags:\n%s", sub, out.String())
	}
	return flags
}

// subcommands are the ones the manifests may run; each has --help.
var subcommands = []string{"serve", "setup", "check", "healthcheck"}

// adminRoutes are the paths a probe may use (internal/admin).
var adminRoutes = map[string]bool{"/healthz": true, "/readyz": true}

// checkArgs checks that args are a subcommand and flags it accepts, and
// returns the subcommand and the flag values.
func checkArgs(t *testing.T, where string, args []string) (string, map[string]string) {
	t.Helper()
	if len(args) == 0 || !slices.Contains(subcommands, args[0]) {
		t.Fatalf("%s: args %q do not start with a subcommand of %v", where, args, subcommands)
	}
	known := helpFlags(t, args[0])
	vals := map[string]string{}
	for i := 1; i < len(args); i++ {
		a := args[i]
		if !strings.HasPrefix(a, "-") {
			t.Fatalf("%s: stray argument %q in %q", where, a, args)
		}
		name, val, hasVal := strings.Cut(strings.TrimLeft(a, "-"), "=")
		if !known[name] {
			t.Fatalf("%s: fenceproxy %s has no flag %q (its --help lists %v)", where, args[0], a, keys(known))
		}
		if !hasVal && i+1 < len(args) && !strings.HasPrefix(args[i+1], "-") {
			val = args[i+1]
			i++
		}
		vals[name] = val
	}
	return args[0], vals
}

func keys(m map[string]bool) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

// containerConfig returns the configuration a container's --config names:
// the file must be a key of a ConfigMap volume mounted (as a directory,
// so that updates reach it) at the file's directory.
func containerConfig(t *testing.T, m *manifests, where string, spec *corev1.PodSpec, c *corev1.Container, path string) (*config.Config, string) {
	t.Helper()
	if path == "" {
		t.Fatalf("%s: no --config", where)
	}
	for _, vm := range c.VolumeMounts {
		if vm.MountPath != filepath.Dir(path) {
			continue
		}
		if vm.SubPath != "" {
			t.Fatalf("%s: %s mounted with subPath: the kubelet never updates it", where, path)
		}
		for _, v := range spec.Volumes {
			if v.Name != vm.Name || v.ConfigMap == nil {
				continue
			}
			cm := m.configMaps[v.ConfigMap.Name]
			if cm == nil {
				t.Fatalf("%s: ConfigMap %s is not among the manifests", where, v.ConfigMap.Name)
			}
			text, ok := cm.Data[filepath.Base(path)]
			if !ok {
				t.Fatalf("%s: ConfigMap %s has no key %s", where, cm.Name, filepath.Base(path))
			}
			cfg, err := config.Parse([]byte(text))
			if err != nil {
				t.Fatalf("%s: the config of ConfigMap %s: %v", where, cm.Name, err)
			}
			return cfg, text
		}
	}
	t.Fatalf("%s: nothing mounted at %s", where, filepath.Dir(path))
	return nil, ""
}

func port(t *testing.T, hostport string) (string, int) {
	t.Helper()
	h, p, err := net.SplitHostPort(hostport)
	if err != nil {
		t.Fatal(err)
	}
	n, err := strconv.Atoi(p)
	if err != nil {
		t.Fatal(err)
	}
	return h, n
}

func namedPort(c *corev1.Container, name string) (int32, bool) {
	for _, p := range c.Ports {
		if p.Name == name {
			return p.ContainerPort, true
		}
	}
	return 0, false
}

// checked is what checkManifests found, for the tests to run.
type checked struct {
	serveConfigs []string // config texts of the serve containers
	probePaths   map[string]bool
}

// checkManifests checks every fenceproxy container of m against the
// binary and its configuration, and the objects against each other.
func checkManifests(t *testing.T, m *manifests) checked {
	t.Helper()
	out := checked{probePaths: map[string]bool{}}
	type pod struct {
		where  string
		labels map[string]string
		spec   *corev1.PodSpec
	}
	var pods []pod
	for _, d := range m.deployments {
		pods = append(pods, pod{m.name + " Deployment " + d.Name, d.Spec.Template.Labels, &d.Spec.Template.Spec})
		sel := d.Spec.Selector.MatchLabels
		for k, v := range sel {
			if d.Spec.Template.Labels[k] != v {
				t.Errorf("%s Deployment %s: selector %v does not match its pods' labels %v", m.name, d.Name, sel, d.Spec.Template.Labels)
			}
		}
	}
	for _, j := range m.jobs {
		pods = append(pods, pod{m.name + " Job " + j.Name, j.Spec.Template.Labels, &j.Spec.Template.Spec})
	}
	serving := 0
	for _, p := range pods {
		spec := p.spec
		if sc := spec.SecurityContext; sc == nil || sc.RunAsNonRoot == nil || !*sc.RunAsNonRoot {
			t.Errorf("%s: pod not runAsNonRoot", p.where)
		} else if sc.RunAsUser == nil || *sc.RunAsUser != 10001 {
			t.Errorf("%s: runAsUser %v, want the image's user 10001 (Dockerfile)", p.where, sc.RunAsUser)
		}
		var containers []*corev1.Container
		for i := range spec.InitContainers {
			containers = append(containers, &spec.InitContainers[i])
		}
		for i := range spec.Containers {
			containers = append(containers, &spec.Containers[i])
		}
		for _, c := range containers {
			if !strings.Contains(c.Image, "fenceproxy") {
				continue
			}
			where := p.where + " container " + c.Name
			if len(c.Command) > 0 {
				t.Errorf("%s: command %q replaces the image's entrypoint %s", where, c.Command, binaryInImage)
			}
			sc := c.SecurityContext
			if sc == nil || sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem ||
				sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation {
				t.Errorf("%s: want readOnlyRootFilesystem and no privilege escalation, got %+v", where, sc)
			}
			if c.Resources.Requests.Cpu().IsZero() || c.Resources.Requests.Memory().IsZero() {
				t.Errorf("%s: no cpu and memory requests", where)
			}
			sub, flags := checkArgs(t, where, c.Args)
			cfg, text := containerConfig(t, m, where, spec, c, flags["config"])
			if sub != "serve" {
				continue
			}
			serving++
			out.serveConfigs = append(out.serveConfigs, text)
			listenHost, listenPort := port(t, cfg.Listen)
			adminHost, adminPort := port(t, cfg.Admin.Listen)
			if c.Ports != nil {
				if n, ok := namedPort(c, "postgres"); !ok || int(n) != listenPort {
					t.Errorf("%s: containerPort postgres %d, the config listens on %d", where, n, listenPort)
				}
				if n, ok := namedPort(c, "admin"); !ok || int(n) != adminPort {
					t.Errorf("%s: containerPort admin %d, the config's admin.listen is on %d", where, n, adminPort)
				}
				if listenHost != "0.0.0.0" {
					t.Errorf("%s: listen %s is not reachable through the pod's ports", where, cfg.Listen)
				}
			}
			probes := map[string]*corev1.Probe{"readiness": c.ReadinessProbe, "liveness": c.LivenessProbe, "startup": c.StartupProbe}
			wantPath := map[string]string{"readiness": "/readyz", "liveness": "/healthz"}
			for kind, pr := range probes {
				if pr == nil {
					if kind != "startup" {
						t.Errorf("%s: no %s probe", where, kind)
					}
					continue
				}
				var path string
				switch {
				case pr.HTTPGet != nil:
					path = pr.HTTPGet.Path
					if pr.HTTPGet.Port.Type == intstr.String {
						if _, ok := namedPort(c, pr.HTTPGet.Port.StrVal); !ok {
							t.Errorf("%s: %s probe port %q is not a port of the container", where, kind, pr.HTTPGet.Port.StrVal)
						}
						if pr.HTTPGet.Port.StrVal != "admin" {
							t.Errorf("%s: %s probe on port %q, want admin", where, kind, pr.HTTPGet.Port.StrVal)
						}
					} else if int(pr.HTTPGet.Port.IntVal) != adminPort {
						t.Errorf("%s: %s probe on port %d, the admin port is %d", where, kind, pr.HTTPGet.Port.IntVal, adminPort)
					}
					if adminHost != "0.0.0.0" {
						t.Errorf("%s: an HTTP probe needs admin.listen on 0.0.0.0 (the kubelet dials the pod's IP), got %s", where, cfg.Admin.Listen)
					}
				case pr.Exec != nil:
					cmd := pr.Exec.Command
					if len(cmd) < 2 || cmd[0] != binaryInImage {
						t.Errorf("%s: %s probe %q does not run %s", where, kind, cmd, binaryInImage)
						continue
					}
					psub, pflags := checkArgs(t, where+" "+kind+" probe", cmd[1:])
					if psub != "healthcheck" {
						t.Errorf("%s: %s probe runs %s, want healthcheck", where, kind, psub)
					}
					u, err := url.Parse(pflags["url"])
					if err != nil || u.Host == "" {
						t.Errorf("%s: %s probe --url %q", where, kind, pflags["url"])
						continue
					}
					h, n := port(t, u.Host)
					if n != adminPort || (h != "127.0.0.1" && h != adminHost) {
						t.Errorf("%s: %s probe --url %s, the admin listener is %s", where, kind, u, cfg.Admin.Listen)
					}
					if pr.TimeoutSeconds > 0 && time.Duration(pr.TimeoutSeconds)*time.Second <= 3*time.Second {
						t.Errorf("%s: %s probe timeout %ds is not above healthcheck's own 3s", where, kind, pr.TimeoutSeconds)
					}
					path = u.Path
				default:
					t.Errorf("%s: %s probe is neither httpGet nor exec", where, kind)
					continue
				}
				if !adminRoutes[path] {
					t.Errorf("%s: %s probe path %q is not an admin route", where, kind, path)
				}
				if w := wantPath[kind]; w != "" && path != w {
					t.Errorf("%s: %s probe on %s, want %s", where, kind, path, w)
				}
				out.probePaths[path] = true
			}
			// SIGKILL must not come before the delay and the drain end.
			need := cfg.Shutdown.Delay + cfg.Shutdown.DrainTimeout
			grace := 30 * time.Second
			if spec.TerminationGracePeriodSeconds != nil {
				grace = time.Duration(*spec.TerminationGracePeriodSeconds) * time.Second
			}
			if grace < need+5*time.Second {
				t.Errorf("%s: terminationGracePeriodSeconds %v, want at least shutdown.delay + shutdown.drain_timeout + 5s = %v", where, grace, need+5*time.Second)
			}
			if c.RestartPolicy != nil && *c.RestartPolicy == corev1.ContainerRestartPolicyAlways && cfg.Shutdown.Delay != 0 {
				t.Errorf("%s: a native sidecar is stopped after the application: shutdown.delay %v only slows the pod's end", where, cfg.Shutdown.Delay)
			}
		}
	}
	if serving == 0 {
		t.Fatalf("%s: no container runs fenceproxy serve", m.name)
	}
	// Every Service port reaches a named port of a pod it selects; every
	// PodDisruptionBudget selects pods.
	selects := func(sel, labels map[string]string) bool {
		for k, v := range sel {
			if labels[k] != v {
				return false
			}
		}
		return len(sel) > 0
	}
	for _, s := range m.services {
		for _, sp := range s.Spec.Ports {
			found := false
			for _, p := range pods {
				if !selects(s.Spec.Selector, p.labels) {
					continue
				}
				for i := range p.spec.Containers {
					if n, ok := namedPort(&p.spec.Containers[i], sp.TargetPort.StrVal); ok && sp.TargetPort.Type == intstr.String {
						found = true
						if sp.Name != sp.TargetPort.StrVal {
							t.Errorf("%s Service %s: port %s targets %s", m.name, s.Name, sp.Name, sp.TargetPort.StrVal)
						}
						_ = n
					}
				}
			}
			if !found {
				t.Errorf("%s Service %s: port %s (target %s) reaches no container port of the pods it selects", m.name, s.Name, sp.Name, sp.TargetPort.String())
			}
		}
		for _, p := range pods {
			if selects(s.Spec.Selector, p.labels) && strings.Contains(p.where, " Job ") {
				t.Errorf("%s Service %s selects the setup Job's pods", m.name, s.Name)
			}
		}
	}
	for _, pdb := range m.pdbs {
		n := 0
		for _, p := range pods {
			if selects(pdb.Spec.Selector.MatchLabels, p.labels) {
				n++
				if strings.Contains(p.where, " Job ") {
					t.Errorf("%s PodDisruptionBudget %s selects the setup Job's pods", m.name, pdb.Name)
				}
			}
		}
		if n == 0 {
			t.Errorf("%s PodDisruptionBudget %s selects no pods", m.name, pdb.Name)
		}
	}
	return out
}

// TestDockerfileMatchesManifests: the binary's path and the user the
// manifests rely on are the image's.
func TestDockerfileMatchesManifests(t *testing.T) {
	data, err := os.ReadFile("../../Dockerfile")
	if err != nil {
		t.Fatal(err)
	}
	s := string(data)
	for _, want := range []string{`ENTRYPOINT ["` + binaryInImage + `"]`, "--uid 10001", "USER fenceproxy"} {
		if !strings.Contains(s, want) {
			t.Errorf("Dockerfile lacks %q", want)
		}
	}
}

func readManifests(t *testing.T, name string, files ...string) *manifests {
	t.Helper()
	m := &manifests{name: name}
	for _, f := range files {
		data, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		parseManifests(t, m, f, string(data))
	}
	return m
}

// TestKubernetesManifests: the plain manifests parse as their kinds, the
// kustomization lists each of them, and checkManifests passes; the
// sidecar variant likewise.
func TestKubernetesManifests(t *testing.T) {
	files, err := filepath.Glob(filepath.Join(manifestsDir, "*.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var k struct {
		Resources []string `yaml:"resources"`
	}
	data, err := os.ReadFile(filepath.Join(manifestsDir, "kustomization.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	if err := yaml.Unmarshal(data, &k); err != nil {
		t.Fatal(err)
	}
	var listed []string
	for _, f := range files {
		if b := filepath.Base(f); b != "kustomization.yaml" {
			listed = append(listed, b)
		}
	}
	sort.Strings(listed)
	sort.Strings(k.Resources)
	if fmt.Sprint(listed) != fmt.Sprint(k.Resources) {
		t.Errorf("kustomization resources %v, files %v", k.Resources, listed)
	}
	m := readManifests(t, "deploy/kubernetes", files...)
	if len(m.deployments) != 1 || len(m.jobs) != 1 || len(m.services) != 1 || len(m.pdbs) != 1 || len(m.configMaps) != 1 {
		t.Fatalf("deploy/kubernetes: %d Deployments, %d Jobs, %d Services, %d PDBs, %d ConfigMaps; want one each",
			len(m.deployments), len(m.jobs), len(m.services), len(m.pdbs), len(m.configMaps))
	}
	got := checkManifests(t, m)

	side := readManifests(t, "deploy/kubernetes/sidecar", filepath.Join(manifestsDir, "sidecar", "app-with-fenceproxy.yaml"))
	gotSide := checkManifests(t, side)
	spec := side.deployments[0].Spec.Template.Spec
	if len(spec.InitContainers) != 1 || spec.InitContainers[0].RestartPolicy == nil ||
		*spec.InitContainers[0].RestartPolicy != corev1.ContainerRestartPolicyAlways {
		t.Errorf("sidecar: fenceproxy is not a native sidecar (init container with restartPolicy Always)")
	}
	for _, text := range gotSide.serveConfigs {
		cfg, _ := config.Parse([]byte(text))
		if h, _ := port(t, cfg.Listen); h != "127.0.0.1" {
			t.Errorf("sidecar: listen %s, want loopback", cfg.Listen)
		}
		if h, _ := port(t, cfg.Admin.Listen); h != "127.0.0.1" {
			t.Errorf("sidecar: admin.listen %s, want loopback", cfg.Admin.Listen)
		}
	}
	checkRunning(t, got)
	checkRunning(t, gotSide)
}

// renderChart renders the chart with values as `helm template` does.
func renderChart(t *testing.T, values map[string]any) string {
	t.Helper()
	ch, err := loader.Load(chartDir)
	if err != nil {
		t.Fatal(err)
	}
	vals, err := chartutil.ToRenderValues(ch, values,
		chartutil.ReleaseOptions{Name: "fp", Namespace: "db", Revision: 1, IsInstall: true, IsUpgrade: false},
		chartutil.DefaultCapabilities)
	if err != nil {
		t.Fatal(err)
	}
	out, err := engine.Render(ch, vals)
	if err != nil {
		t.Fatalf("helm template: %v", err)
	}
	names := make([]string, 0, len(out))
	for n := range out {
		names = append(names, n)
	}
	sort.Strings(names)
	var b strings.Builder
	for _, n := range names {
		if strings.HasSuffix(n, ".txt") || strings.TrimSpace(out[n]) == "" {
			continue
		}
		fmt.Fprintf(&b, "---\n# Source: %s\n%s\n", n, out[n])
	}
	return b.String()
}

// chartValueSets are the values the chart is linted and rendered with.
var chartValueSets = map[string]map[string]any{
	"defaults": {},
	"job, tables, secret, monitor": {
		"setup": map[string]any{"mode": "job", "guard": true},
		"config": map[string]any{
			"tables": []any{map[string]any{"table": "public.config", "lock": "optional"}},
			"admin":  map[string]any{"pprof": true},
		},
		"auditPassword":         map[string]any{"existingSecret": "fenceproxy-audit"},
		"metrics":               map[string]any{"serviceMonitor": map[string]any{"enabled": true}},
		"restartOnConfigChange": true,
		"ports":                 map[string]any{"postgres": 5432, "admin": 9187},
	},
	"no setup, no pdb": {
		"setup":               map[string]any{"mode": "none"},
		"podDisruptionBudget": map[string]any{"enabled": false},
	},
}

// TestHelmChart: helm lint passes without warnings for each value set,
// and the rendered manifests pass checkManifests.
func TestHelmChart(t *testing.T) {
	for name, values := range chartValueSets {
		t.Run(name, func(t *testing.T) {
			linter := lint.All(chartDir, values, "db", false)
			for _, msg := range linter.Messages {
				if msg.Severity >= support.WarningSev {
					t.Errorf("helm lint: %s", msg)
				} else {
					t.Logf("helm lint: %s", msg)
				}
			}
			text := renderChart(t, values)
			m := &manifests{name: "helm " + name}
			parseManifests(t, m, "helm template", text)
			got := checkManifests(t, m)
			if len(m.deployments) != 1 || len(m.services) != 1 {
				t.Fatalf("rendered %d Deployments, %d Services:\n%s", len(m.deployments), len(m.services), text)
			}
			spec := m.deployments[0].Spec.Template.Spec
			switch mode := values["setup"]; {
			case mode == nil:
				if len(spec.InitContainers) != 1 || spec.InitContainers[0].Args[0] != "setup" {
					t.Errorf("default setup mode: want a setup init container, got %+v", spec.InitContainers)
				}
			case mode.(map[string]any)["mode"] == "job":
				if len(m.jobs) != 1 || m.jobs[0].Annotations["helm.sh/hook"] == "" {
					t.Errorf("setup mode job: want one hook Job, got %d", len(m.jobs))
				} else if !slices.Contains(m.jobs[0].Spec.Template.Spec.Containers[0].Args, "--guard") {
					t.Errorf("setup.guard: the Job's args %q lack --guard", m.jobs[0].Spec.Template.Spec.Containers[0].Args)
				}
				if m.deployments[0].Spec.Template.Annotations["checksum/config"] == "" {
					t.Errorf("restartOnConfigChange: no checksum/config annotation")
				}
			default:
				if len(spec.InitContainers) != 0 || len(m.jobs) != 0 {
					t.Errorf("setup mode none: want no setup container or Job")
				}
			}
			if name == "defaults" {
				checkRunning(t, got)
			}
		})
	}
}

// checkRunning starts `fenceproxy serve` with the first serve
// configuration found (its listeners and upstream moved to this test's
// loopback server) and checks that every probe path answers 200 on its
// admin listener, and that a path that is not a route does not. Under
// -short it skips the rest of the test (it needs PostgreSQL).
func checkRunning(t *testing.T, got checked) {
	t.Helper()
	testutil.SkipSystem(t, "PostgreSQL")
	if len(got.serveConfigs) == 0 || len(got.probePaths) == 0 {
		t.Fatal("nothing to run")
	}
	pg := pgtest.Start(t, pgcluster.Options{})
	var cfg map[string]any
	if err := yaml.Unmarshal([]byte(got.serveConfigs[0]), &cfg); err != nil {
		t.Fatal(err)
	}
	cfg["listen"] = "127.0.0.1:0"
	cfg["upstream"] = map[string]any{"address": pg.Addr()}
	admin, _ := cfg["admin"].(map[string]any)
	if admin == nil {
		admin = map[string]any{}
	}
	admin["listen"] = "127.0.0.1:0"
	cfg["admin"] = admin
	cfg["log"] = map[string]any{"format": "json", "level": "info"}
	cfg["shutdown"] = map[string]any{"delay": "0s", "drain_timeout": "1s"}
	cfg["audit"] = map[string]any{"dsn": pg.SuperuserDSN("postgres")}
	data, err := yaml.Marshal(cfg)
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), "fenceproxy.yaml")
	if err := os.WriteFile(path, data, 0o600); err != nil {
		t.Fatal(err)
	}
	_, _, logs := startServeProcess(t, path)
	m := regexp.MustCompile(`"admin": ?"([0-9.:]+)"`).FindStringSubmatch(logs.String())
	if m == nil {
		t.Fatalf("no admin address in the log:\n%s", logs)
	}
	status := func(p string) int {
		resp, err := http.Get("http://" + m[1] + p)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	for p := range got.probePaths {
		deadline := time.Now().Add(10 * time.Second)
		for code := status(p); code != http.StatusOK; code = status(p) {
			if time.Now().After(deadline) {
				t.Fatalf("GET %s on the running proxy: %d, want 200", p, code)
			}
			time.Sleep(100 * time.Millisecond)
		}
	}
	if code := status("/nosuchroute"); code != http.StatusNotFound {
		t.Errorf("GET /nosuchroute: %d, want 404 (the route check would prove nothing)", code)
	}
}
