package main

import (
	"bytes"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

func TestHelpExitsZeroWithSynopsis(t *testing.T) {
	for _, cmd := range []string{"serve", "rewrite", "lock", "healthcheck"} {
		for _, flag := range []string{"--help", "-h"} {
			var out, errb bytes.Buffer
			code := runMain([]string{cmd, flag}, strings.NewReader(""), &out, &errb)
			if code != 0 || !strings.HasPrefix(out.String(), "usage: fenceproxy "+cmd) {
				t.Errorf("%s %s: exit %d, stdout %q, stderr %q", cmd, flag, code, out.String(), errb.String())
			}
		}
	}
}

// fenceproxy rewrite is a dry run for DBAs: a file with only tables: is
// enough, through --config, -c or FENCEPROXY_CONFIG (the flag wins).
func TestRewriteConfigSpellings(t *testing.T) {
	dir := t.TempDir()
	good := filepath.Join(dir, "tables.yaml")
	if err := os.WriteFile(good, []byte("tables:\n  - table: public.config\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	missing := filepath.Join(dir, "missing.yaml")
	run := func(env string, args ...string) (int, string) {
		t.Helper()
		if env != "" {
			t.Setenv("FENCEPROXY_CONFIG", env)
		}
		var out, errb bytes.Buffer
		code := runMain(append([]string{"rewrite"}, append(args, "UPDATE config SET a = 1")...), strings.NewReader(""), &out, &errb)
		return code, out.String() + errb.String()
	}
	for name, c := range map[string]struct {
		env  string
		args []string
	}{
		"long":      {"", []string{"--config", good}},
		"short":     {"", []string{"-c", good}},
		"env":       {good, nil},
		"flag-wins": {missing, []string{"--config", good}},
	} {
		if code, out := run(c.env, c.args...); code != 0 || !strings.Contains(out, "-- rewritten") {
			t.Errorf("%s: exit %d: %s", name, code, out)
		}
	}
	if code, out := run(missing); code != 1 || !strings.Contains(out, "missing.yaml") {
		t.Errorf("env naming a missing file: exit %d: %s", code, out)
	}
}

func TestHealthcheck(t *testing.T) {
	status := http.StatusOK
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(status) }))
	defer srv.Close()
	for _, c := range []struct {
		status, code int
	}{{http.StatusOK, 0}, {http.StatusServiceUnavailable, 1}} {
		status = c.status
		var out, errb bytes.Buffer
		if code := runMain([]string{"healthcheck", "--url", srv.URL + "/readyz"}, strings.NewReader(""), &out, &errb); code != c.code {
			t.Errorf("status %d: exit %d, want %d (%s)", c.status, code, c.code, errb.String())
		}
	}
	var out, errb bytes.Buffer
	if code := runMain([]string{"healthcheck", "--url", "http://127.0.0.1:1/readyz"}, strings.NewReader(""), &out, &errb); code != 1 {
		t.Errorf("nothing listening: exit %d", code)
	}
}

// A built binary reports where it was built from, not "dev".
func TestVersionFromBuildInfo(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the binary")
	}
	bin := filepath.Join(t.TempDir(), "fenceproxy")
	if out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	out, err := exec.Command(bin, "version").Output()
	if err != nil {
		t.Fatal(err)
	}
	v := strings.TrimSpace(string(out))
	if !strings.HasPrefix(v, "fenceproxy ") || v == "fenceproxy dev" {
		t.Errorf("version %q", v)
	}
}
