package config_test

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/fenceproxy/fenceproxy/internal/config"
	"github.com/fenceproxy/fenceproxy/internal/testcerts"
)

func TestExampleFileLoads(t *testing.T) {
	cfg, err := config.Load("../../config.example.yaml")
	if err != nil {
		t.Fatalf("config.example.yaml: %v", err)
	}
	// The example documents every key with its default: apart from the
	// required upstream and the example table, it must equal Defaults.
	def := config.Defaults()
	if cfg.Listen != def.Listen || cfg.Limits != def.Limits || cfg.Shutdown != def.Shutdown ||
		cfg.Log != def.Log || cfg.Admin != def.Admin || cfg.TokenSetting != def.TokenSetting ||
		cfg.RewriteCacheEntries != def.RewriteCacheEntries || cfg.Upstream.ConnectTimeout != def.Upstream.ConnectTimeout ||
		cfg.Upstream.TLS != def.Upstream.TLS || cfg.TLS != def.TLS || cfg.Audit != def.Audit {
		t.Errorf("config.example.yaml drifted from Defaults:\n got %+v\nwant %+v", cfg, def)
	}
	if len(cfg.Tables) != 1 || cfg.Tables[0].Table != "public.config" {
		t.Errorf("tables = %+v", cfg.Tables)
	}
	if len(cfg.Guard.ExemptRoles) != 0 {
		t.Errorf("guard = %+v, want no exempt roles", cfg.Guard)
	}
}

// TestGuardKeys: guard.exempt_roles is read by Load and LoadRules alike,
// and validated by both.
func TestGuardKeys(t *testing.T) {
	dir := t.TempDir()
	good := filepath.Join(dir, "good.yaml")
	if err := os.WriteFile(good, []byte("upstream: {address: 'h:5432'}\nguard: {exempt_roles: [migrator, \"Ops Team\"]}\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	for name, load := range map[string]func(string) (*config.Config, error){"Load": config.Load, "LoadRules": config.LoadRules} {
		cfg, err := load(good)
		if err != nil || len(cfg.Guard.ExemptRoles) != 2 || cfg.Guard.ExemptRoles[1] != "Ops Team" {
			t.Errorf("%s: %+v, %v", name, cfg, err)
		}
	}
	bad := filepath.Join(dir, "bad.yaml")
	if err := os.WriteFile(bad, []byte("guard: {exempt_roles: [a, '']}\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := config.LoadRules(bad); err == nil || !strings.Contains(err.Error(), "guard.exempt_roles[1]: must not be empty") {
		t.Errorf("LoadRules of an empty role name: %v", err)
	}
}

func TestMinimalFileGetsDefaults(t *testing.T) {
	cfg, err := config.Load("testdata/minimal.yaml")
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Listen != "127.0.0.1:6432" || cfg.Limits.MaxConnections != 1000 || cfg.Shutdown.DrainTimeout != 30*time.Second ||
		cfg.Shutdown.Delay != 0 || cfg.TokenSetting != "fence.token" || cfg.Admin.Listen != "127.0.0.1:6438" || cfg.Upstream.TLS.Mode != "disable" {
		t.Errorf("defaults not applied: %+v", cfg)
	}
}

// TestInvalidConfigNamesTheKey: every validation error names the key.
func TestInvalidConfigNamesTheKey(t *testing.T) {
	cases := []struct{ yaml, key string }{
		{"", "upstream.address"},
		{"upstream: {address: nohost}", "upstream.address"},
		{"upstream: {address: 'h:5432'}\nlisten: ':x'", "listen"},
		{"upstream: {address: 'h:5432', tls: {mode: maybe}}", "upstream.tls.mode"},
		{"upstream: {address: 'h:5432', tls: {mode: verify-full}}", "upstream.tls.ca_file"},
		{"upstream: {address: 'h:5432', connect_timeout: -1s}", "upstream.connect_timeout"},
		{"upstream: {address: 'h:5432', tls: {mode: verify-ca}}", "upstream.tls.ca_file"},
		{"upstream: {address: 'h:5432', tls: {mode: require, server_name: db}}", "upstream.tls.server_name"},
		{"upstream: {address: 'h:70000'}", "upstream.address"},
		{"upstream: {address: 'h:5432'}\ntls: {cert_file: /nonexistent.pem}", "tls"},
		{"upstream: {address: 'h:5432'}\ntls: {require: true}", "tls.require"},
		{"upstream: {address: 'h:5432'}\nlimits: {max_connections: 0}", "limits.max_connections"},
		{"upstream: {address: 'h:5432'}\nlimits: {max_message_bytes: 10}", "limits.max_message_bytes"},
		{"upstream: {address: 'h:5432'}\nlimits: {large_message_budget: 1000}", "limits.large_message_budget"},
		{"upstream: {address: 'h:5432'}\nlimits: {large_message_wait: 0s}", "limits.large_message_wait"},
		{"upstream: {address: 'h:5432'}\nlimits: {relay_loops: -1}", "limits.relay_loops"},
		{"upstream: {address: 'h:5432'}\nlimits: {relay_loops: 1000}", "limits.relay_loops"},
		{"upstream: {address: 'h:5432'}\nauto_prepare: -1", "auto_prepare"},
		{"upstream: {address: 'h:5432'}\nauto_prepare: 1001", "auto_prepare"},
		{"upstream: {address: 'h:5432'}\nshutdown: {delay: -1s}", "shutdown.delay"},
		{"upstream: {address: 'h:5432'}\nlog: {format: xml}", "log.format"},
		{"upstream: {address: 'h:5432'}\nlog: {level: loud}", "log.level"},
		{"upstream: {address: 'h:5432'}\nadmin: {listen: nope}", "admin.listen"},
		{"upstream: {address: 'h:5432'}\naudit: {dsn: 'postgres://u:secret@h:5432/?sslmode=bogus'}", "audit.dsn"},
		{"upstream: {address: 'h:5432'}\ntables: [{table: config}]", "tables[0]"},
		{"upstream: {address: 'h:5432'}\ntables: [{table: public.a, on_stale: maybe}]", "tables[0].on_stale"},
		{"upstream: {address: 'h:5432'}\ntables: [{table: public.a, mode: loud}]", "tables[0].mode"},
		{"upstream: {address: 'h:5432'}\ntables: [{table: public.a}, {table: public.a}]", "tables[1]"},
		{"upstream: {address: 'h:5432'}\ntoken_setting: notdotted", "token_setting"},
		{"upstream: {address: 'h:5432'}\nguard: {exempt_roles: ['']}", "guard.exempt_roles[0]"},
		{"upstream: {address: 'h:5432'}\nguard: {exempt_roles: [migrator, migrator]}", "guard.exempt_roles[1]"},
		{"upstream: {address: 'h:5432'}\nguard: {exempt_roles: [" + strings.Repeat("r", 64) + "]}", "guard.exempt_roles[0]"},
		{"upstream: {address: 'h:5432'}\nguard: {exempt: [migrator]}", "exempt"}, // unknown key
		{"upstream: {address: 'h:5432'}\nlisten_addr: x", "listen_addr"},         // unknown key
	}
	for _, c := range cases {
		path := filepath.Join(t.TempDir(), "c.yaml")
		if err := os.WriteFile(path, []byte(c.yaml), 0o644); err != nil {
			t.Fatal(err)
		}
		_, err := config.Load(path)
		if err == nil {
			t.Errorf("%q: accepted, want an error naming %s", c.yaml, c.key)
			continue
		}
		if !strings.Contains(err.Error(), c.key) {
			t.Errorf("%q: error %q does not name %s", c.yaml, err, c.key)
		}
		if strings.Contains(err.Error(), "secret") {
			t.Errorf("%q: error %q repeats a password", c.yaml, err)
		}
	}
}

func TestAuditConnConfig(t *testing.T) {
	cfg, err := config.Parse([]byte("upstream: {address: 'db:5433', tls: {mode: require}}"))
	if err != nil {
		t.Fatal(err)
	}
	t.Setenv("FENCEPROXY_AUDIT_PASSWORD", "pw")
	pc, err := cfg.AuditConnConfig("app")
	if err != nil {
		t.Fatal(err)
	}
	if pc.Host != "db" || pc.Port != 5433 || pc.User != "postgres" || pc.Database != "app" || pc.Password != "pw" || pc.TLSConfig == nil {
		t.Errorf("audit conn config = host %s port %d user %s db %s tls %v", pc.Host, pc.Port, pc.User, pc.Database, pc.TLSConfig != nil)
	}
}

// The audit listener and the relay reach the upstream with the same TLS
// settings, built in one place.
func TestAuditConnUsesUpstreamTLS(t *testing.T) {
	certs, err := testcerts.Generate(t.TempDir(), "db.internal")
	if err != nil {
		t.Fatal(err)
	}
	for _, mode := range []string{"disable", "require", "verify-ca", "verify-full"} {
		t.Run(mode, func(t *testing.T) {
			cfg, err := config.Parse([]byte(fmt.Sprintf("upstream: {address: 'db.internal:5433', tls: {mode: %s, ca_file: %q}}", mode, certs.CAFile)))
			if err != nil {
				t.Fatal(err)
			}
			up, err := cfg.UpstreamTLSConfig()
			if err != nil {
				t.Fatal(err)
			}
			pc, err := cfg.AuditConnConfig("app")
			if err != nil {
				t.Fatal(err)
			}
			if (up == nil) != (pc.TLSConfig == nil) || len(pc.Fallbacks) != 0 {
				t.Fatalf("relay TLS %v, audit TLS %v, fallbacks %d", up != nil, pc.TLSConfig != nil, len(pc.Fallbacks))
			}
			if up == nil {
				return
			}
			if up.ServerName != pc.TLSConfig.ServerName || up.InsecureSkipVerify != pc.TLSConfig.InsecureSkipVerify ||
				(up.RootCAs == nil) != (pc.TLSConfig.RootCAs == nil) || (up.VerifyPeerCertificate == nil) != (pc.TLSConfig.VerifyPeerCertificate == nil) {
				t.Errorf("relay and audit TLS differ: %+v vs %+v", up, pc.TLSConfig)
			}
			if mode == "verify-full" && pc.TLSConfig.ServerName != "db.internal" {
				t.Errorf("server name %q", pc.TLSConfig.ServerName)
			}
		})
	}
}
