package config

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"net"
	"os"
)

// UpstreamTLSConfig returns the TLS configuration for connections to the
// upstream server under upstream.tls, or nil for mode disable. The relay's
// connections and the audit listener's both use it, so they cannot drift.
func (c *Config) UpstreamTLSConfig() (*tls.Config, error) {
	tc, err := c.upstreamTLSConfig()
	if err != nil || tc == nil || c.Upstream.TLS.CertFile == "" {
		return tc, err
	}
	cert, err := tls.LoadX509KeyPair(c.Upstream.TLS.CertFile, c.Upstream.TLS.KeyFile)
	if err != nil {
		return nil, fmt.Errorf("upstream.tls.cert_file/upstream.tls.key_file: %w", err)
	}
	tc.Certificates = []tls.Certificate{cert}
	return tc, nil
}

func (c *Config) upstreamTLSConfig() (*tls.Config, error) {
	t := c.Upstream.TLS
	switch t.Mode {
	case "require":
		// Encrypt without verifying, like libpq's sslmode=require.
		return &tls.Config{InsecureSkipVerify: true, MinVersion: tls.VersionTLS12}, nil //nolint:gosec // documented mode
	case "verify-ca", "verify-full":
	default:
		return nil, nil
	}
	pem, err := os.ReadFile(t.CAFile)
	if err != nil {
		return nil, fmt.Errorf("upstream.tls.ca_file: %w", err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pem) {
		return nil, fmt.Errorf("upstream.tls.ca_file: no PEM certificates in %s", t.CAFile)
	}
	name := t.ServerName
	if name == "" {
		name, _, _ = net.SplitHostPort(c.Upstream.Address)
	}
	tc := &tls.Config{RootCAs: pool, ServerName: name, MinVersion: tls.VersionTLS12}
	if t.Mode == "verify-ca" {
		// Verify the chain only, like libpq's sslmode=verify-ca: Go's own
		// check would also match the host name, so it is replaced.
		tc.InsecureSkipVerify = true //nolint:gosec // the chain is verified below
		tc.VerifyPeerCertificate = func(raw [][]byte, _ [][]*x509.Certificate) error {
			return verifyChain(raw, pool)
		}
	}
	return tc, nil
}

// verifyChain verifies the certificate chain the server sent against pool,
// without matching a host name.
func verifyChain(raw [][]byte, pool *x509.CertPool) error {
	if len(raw) == 0 {
		return errors.New("upstream sent no certificate")
	}
	certs := make([]*x509.Certificate, len(raw))
	for i, b := range raw {
		c, err := x509.ParseCertificate(b)
		if err != nil {
			return err
		}
		certs[i] = c
	}
	inter := x509.NewCertPool()
	for _, c := range certs[1:] {
		inter.AddCert(c)
	}
	_, err := certs[0].Verify(x509.VerifyOptions{Roots: pool, Intermediates: inter})
	return err
}
