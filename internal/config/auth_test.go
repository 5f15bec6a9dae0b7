package config_test

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/fenceproxy/fenceproxy/internal/config"
)

// TestAuthKeys: auth.method cert, tls.client_ca_file, auth.file and the
// upstream.tls keys that go with them are checked together, and errors
// name the key without repeating a password.
func TestAuthKeys(t *testing.T) {
	dir := t.TempDir()
	file := func(name, content string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	pem := file("x.pem", "not read at load")
	users := file("users.txt", `"alice" "hunter2"`+"\n")
	scram := file("scram.txt", `"bob" "SCRAM-SHA-256$4096:c2FsdA==$hunter2:hunter2"`+"\n")
	tlsKeys := "tls: {cert_file: " + pem + ", key_file: " + pem + ", client_ca_file: " + pem + "}\n"
	up := "upstream: {address: 'h:5432'}\n"
	upTLS := "upstream: {address: 'h:5432', tls: {mode: require, follow_client: true, cert_file: " + pem + ", key_file: " + pem + "}}\n"

	good := upTLS + tlsKeys + "auth: {method: cert, file: " + users + "}\n"
	cfg, err := config.Parse([]byte(good))
	if err != nil {
		t.Fatalf("valid config refused: %v", err)
	}
	if cfg.Auth.Method != "cert" || !cfg.Upstream.TLS.FollowClient {
		t.Errorf("auth %+v, follow_client %v", cfg.Auth, cfg.Upstream.TLS.FollowClient)
	}
	if d := config.Defaults(); d.Auth.Method != "relay" {
		t.Errorf("default auth.method %q, want relay", d.Auth.Method)
	}

	cases := []struct{ yaml, key string }{
		{up + "auth: {method: password}", "auth.method"},
		{up + "auth: {method: cert}", "auth.method"}, // no TLS
		{up + "tls: {cert_file: " + pem + ", key_file: " + pem + "}\nauth: {method: cert}", "tls.client_ca_file"},
		{up + "tls: {cert_file: " + pem + ", key_file: " + pem + ", client_ca_file: " + pem + "}", "tls.client_ca_file"}, // relay
		{up + "auth: {file: " + users + "}", "auth.file"},
		{up + tlsKeys + "auth: {method: cert, file: " + scram + "}", "auth.file"},
		{up + tlsKeys + "auth: {method: cert, file: /nonexistent}", "auth.file"},
		{"upstream: {address: 'h:5432', tls: {follow_client: true}}\n" + tlsKeys + "auth: {method: cert}", "upstream.tls.follow_client"},
		{"upstream: {address: 'h:5432', tls: {mode: require, follow_client: true}}", "upstream.tls.follow_client"},
		{"upstream: {address: 'h:5432', tls: {mode: require, cert_file: " + pem + "}}", "upstream.tls"},
		{"upstream: {address: 'h:5432', tls: {cert_file: " + pem + ", key_file: " + pem + "}}", "upstream.tls.cert_file"},
	}
	for _, c := range cases {
		_, err := config.Parse([]byte(c.yaml))
		if err == nil {
			t.Errorf("%q: accepted, want an error naming %s", c.yaml, c.key)
			continue
		}
		if !strings.Contains(err.Error(), c.key) {
			t.Errorf("%q: error %q does not name %s", c.yaml, err, c.key)
		}
		if strings.Contains(err.Error(), "hunter2") {
			t.Errorf("%q: error %q repeats a password", c.yaml, err)
		}
	}
}
