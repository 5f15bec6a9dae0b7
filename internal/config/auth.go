package config

import (
	"github.com/fenceproxy/fenceproxy/internal/authfile"
)

// validateAuth checks auth, tls.client_ca_file and the upstream keys that
// go with them.
func (c *Config) validateAuth(bad func(key, format string, args ...any)) {
	switch c.Auth.Method {
	case "relay":
		if c.TLS.ClientCAFile != "" {
			bad("tls.client_ca_file", "only used with auth.method cert")
		}
		if c.Auth.File != "" {
			bad("auth.file", "only used with auth.method cert")
		}
	case "cert":
		if c.TLS.CertFile == "" {
			bad("auth.method", "cert needs tls.cert_file and tls.key_file (client certificates come over TLS)")
		}
		if c.TLS.ClientCAFile == "" {
			bad("tls.client_ca_file", "required when auth.method is cert")
		} else if err := checkReadable(c.TLS.ClientCAFile); err != nil {
			bad("tls.client_ca_file", "%v", err)
		}
		if c.Auth.File != "" {
			// Loaded here so that a bad line fails the load; errors name
			// lines and users, never passwords.
			if _, err := authfile.Load(c.Auth.File); err != nil {
				bad("auth.file", "%v", err)
			}
		}
	default:
		bad("auth.method", "must be relay or cert, got %q", c.Auth.Method)
	}
	t := c.Upstream.TLS
	if t.FollowClient {
		if t.Mode == "disable" {
			bad("upstream.tls.follow_client", "needs upstream.tls.mode require, verify-ca or verify-full (how TLS to the server is checked when used)")
		}
		if c.TLS.CertFile == "" {
			bad("upstream.tls.follow_client", "needs tls.cert_file and tls.key_file, or no client ever negotiates TLS")
		}
	}
	if (t.CertFile == "") != (t.KeyFile == "") {
		bad("upstream.tls", "cert_file and key_file must be set together")
	}
	if t.CertFile != "" && t.Mode == "disable" {
		bad("upstream.tls.cert_file", "needs upstream.tls.mode require, verify-ca or verify-full")
	}
	for key, f := range map[string]string{"upstream.tls.cert_file": t.CertFile, "upstream.tls.key_file": t.KeyFile} {
		if f != "" {
			if err := checkReadable(f); err != nil {
				bad(key, "%v", err)
			}
		}
	}
}
