package config_test

import (
	"strings"
	"testing"

	"github.com/fenceproxy/fenceproxy/internal/config"
)

// TestUnixSocketAddresses: a listen or upstream.address starting with "/"
// is a socket directory, named the libpq way; the relay, the readiness
// probe (Dial) and the audit listener (AuditConnConfig) reach the same
// socket.
func TestUnixSocketAddresses(t *testing.T) {
	cases := []struct {
		name, yaml               string
		listenNet, listenAddr    string
		upNet, upAddr, auditHost string
		auditPort                uint16
	}{
		{"tcp", "upstream: {address: 'db:5433'}", "tcp", "127.0.0.1:6432", "tcp", "db:5433", "db", 5433},
		{"default ports", "listen: /run/fenceproxy\nupstream: {address: /var/run/postgresql}",
			"unix", "/run/fenceproxy/.s.PGSQL.6432", "unix", "/var/run/postgresql/.s.PGSQL.5432", "/var/run/postgresql", 5432},
		{"ports", "listen: /tmp/\nlisten_port: 7000\nupstream: {address: /tmp, port: 5433}",
			"unix", "/tmp/.s.PGSQL.7000", "unix", "/tmp/.s.PGSQL.5433", "/tmp", 5433},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			cfg, err := config.Parse([]byte(c.yaml))
			if err != nil {
				t.Fatal(err)
			}
			if n, a := cfg.ListenNetwork(); n != c.listenNet || a != c.listenAddr {
				t.Errorf("ListenNetwork = %s %s, want %s %s", n, a, c.listenNet, c.listenAddr)
			}
			if n, a := cfg.Upstream.Dial(); n != c.upNet || a != c.upAddr {
				t.Errorf("Upstream.Dial = %s %s, want %s %s", n, a, c.upNet, c.upAddr)
			}
			pc, err := cfg.AuditConnConfig("app")
			if err != nil {
				t.Fatal(err)
			}
			if pc.Host != c.auditHost || pc.Port != c.auditPort || pc.Database != "app" || pc.TLSConfig != nil || len(pc.Fallbacks) != 0 {
				t.Errorf("audit conn config = host %s port %d db %s tls %v fallbacks %d", pc.Host, pc.Port, pc.Database, pc.TLSConfig != nil, len(pc.Fallbacks))
			}
		})
	}
}

// TestUnixSocketInvalid: misuse of the socket keys names the key.
func TestUnixSocketInvalid(t *testing.T) {
	long := "/" + strings.Repeat("d", 100)
	cases := []struct{ yaml, key string }{
		{"upstream: {address: 'h:5432'}\nlisten_port: 7000", "listen_port"},
		{"upstream: {address: 'h:5432'}\nlisten: /tmp\nlisten_port: 70000", "listen_port"},
		{"upstream: {address: 'h:5432'}\nlisten: " + long, "listen"},
		{"upstream: {address: 'h:5432'}\nlisten: /tmp\ntls: {require: true}", "tls"},
		{"upstream: {address: 'h:5432', port: 5433}", "upstream.port"},
		{"upstream: {address: /tmp, port: -1}", "upstream.port"},
		{"upstream: {address: " + long + "}", "upstream.address"},
		{"upstream: {address: /tmp, tls: {mode: require}}", "upstream.tls.mode"},
		{"upstream: {address: tmp/sock}", "upstream.address"},
	}
	for _, c := range cases {
		_, err := config.Parse([]byte(c.yaml))
		if err == nil {
			t.Errorf("%q: accepted, want an error naming %s", c.yaml, c.key)
			continue
		}
		if !strings.Contains(err.Error(), c.key+":") {
			t.Errorf("%q: error %q does not name %s", c.yaml, err, c.key)
		}
	}
}
