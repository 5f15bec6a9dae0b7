// Package testcerts generates, at run time, a throwaway certificate authority
// and a server certificate signed by it (and, on request, client
// certificates), as PEM files for servers such as PostgreSQL and as
// in-memory values for Go TLS configs. The keys are ECDSA
// P-256; nothing here is fit for production.
package testcerts

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"slices"
	"time"
)

// Validity is how long generated certificates are valid, starting an hour
// in the past to tolerate clock skew.
const Validity = 365 * 24 * time.Hour

// Files describes what Generate wrote. The CA private key is not written.
type Files struct {
	// CAFile is the CA certificate (PEM), e.g. for sslrootcert.
	CAFile string
	// CertFile is the server certificate (PEM), signed by the CA.
	CertFile string
	// KeyFile is the server private key (PEM, PKCS #8), mode 0600.
	KeyFile string
	// CAPool holds the CA certificate.
	CAPool *x509.CertPool
	// CACert is the parsed CA certificate.
	CACert *x509.Certificate
	// Cert is the server certificate and key.
	Cert tls.Certificate
	// Hosts are the names and addresses the server certificate is valid for.
	Hosts []string

	caKey *ecdsa.PrivateKey // signs client certificates (ClientCert)
}

// Client describes a client certificate written by ClientCert.
type Client struct {
	// CertFile is the client certificate (PEM), e.g. for sslcert.
	CertFile string
	// KeyFile is its private key (PEM, PKCS #8), mode 0600 as libpq
	// requires, e.g. for sslkey.
	KeyFile string
	// Cert is the certificate and key, for a Go TLS config.
	Cert tls.Certificate
}

// ClientCert creates a client certificate signed by the CA with Common Name
// cn (the user name PostgreSQL's cert method compares it with) and writes
// it as <name>.crt and <name>.key into dir.
func (f *Files) ClientCert(dir, name, cn string) (*Client, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, fmt.Errorf("testcerts: %w", err)
	}
	now := time.Now()
	tmpl := &x509.Certificate{
		Subject:     pkix.Name{CommonName: cn},
		NotBefore:   now.Add(-time.Hour),
		NotAfter:    now.Add(Validity),
		KeyUsage:    x509.KeyUsageDigitalSignature,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	}
	_, der, err := sign(tmpl, f.CACert, &key.PublicKey, f.caKey)
	if err != nil {
		return nil, err
	}
	keyDER, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		return nil, fmt.Errorf("testcerts: %w", err)
	}
	c := &Client{CertFile: filepath.Join(dir, name+".crt"), KeyFile: filepath.Join(dir, name+".key")}
	certPEM := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})
	keyPEM := pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: keyDER})
	if c.Cert, err = tls.X509KeyPair(certPEM, keyPEM); err != nil {
		return nil, fmt.Errorf("testcerts: %w", err)
	}
	if err := writeFile(c.CertFile, certPEM, 0o644); err != nil {
		return nil, err
	}
	if err := writeFile(c.KeyFile, keyPEM, 0o600); err != nil {
		return nil, err
	}
	return c, nil
}

// Generate creates a CA and a server certificate valid for "localhost",
// 127.0.0.1, ::1 and hosts (DNS names or IP addresses), and writes ca.crt,
// server.crt and server.key into dir, replacing existing files.
func Generate(dir string, hosts ...string) (*Files, error) {
	names := []string{"localhost", "127.0.0.1", "::1"}
	for _, h := range hosts {
		if !slices.Contains(names, h) {
			names = append(names, h)
		}
	}
	now := time.Now()

	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, fmt.Errorf("testcerts: %w", err)
	}
	caTmpl := &x509.Certificate{
		Subject:               pkix.Name{CommonName: "fenceproxy test CA"},
		NotBefore:             now.Add(-time.Hour),
		NotAfter:              now.Add(Validity),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign,
		BasicConstraintsValid: true,
		IsCA:                  true,
		MaxPathLenZero:        true,
	}
	caCert, caDER, err := sign(caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		return nil, err
	}

	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, fmt.Errorf("testcerts: %w", err)
	}
	tmpl := &x509.Certificate{
		Subject:     pkix.Name{CommonName: names[0]},
		NotBefore:   now.Add(-time.Hour),
		NotAfter:    now.Add(Validity),
		KeyUsage:    x509.KeyUsageDigitalSignature,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	for _, h := range names {
		if ip := net.ParseIP(h); ip != nil {
			tmpl.IPAddresses = append(tmpl.IPAddresses, ip)
		} else {
			tmpl.DNSNames = append(tmpl.DNSNames, h)
		}
	}
	_, der, err := sign(tmpl, caCert, &key.PublicKey, caKey)
	if err != nil {
		return nil, err
	}
	keyDER, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		return nil, fmt.Errorf("testcerts: %w", err)
	}

	f := &Files{
		CAFile:   filepath.Join(dir, "ca.crt"),
		CertFile: filepath.Join(dir, "server.crt"),
		KeyFile:  filepath.Join(dir, "server.key"),
		CAPool:   x509.NewCertPool(),
		CACert:   caCert,
		Hosts:    names,
		caKey:    caKey,
	}
	f.CAPool.AddCert(caCert)
	certPEM := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})
	keyPEM := pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: keyDER})
	if f.Cert, err = tls.X509KeyPair(certPEM, keyPEM); err != nil {
		return nil, fmt.Errorf("testcerts: %w", err)
	}
	writes := []struct {
		path string
		data []byte
		mode os.FileMode
	}{
		{f.CAFile, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: caDER}), 0o644},
		{f.CertFile, certPEM, 0o644},
		{f.KeyFile, keyPEM, 0o600},
	}
	for _, w := range writes {
		if err := writeFile(w.path, w.data, w.mode); err != nil {
			return nil, err
		}
	}
	return f, nil
}

// ServerTLSConfig returns a config serving the server certificate.
func (f *Files) ServerTLSConfig() *tls.Config {
	return &tls.Config{Certificates: []tls.Certificate{f.Cert}, MinVersion: tls.VersionTLS12}
}

// ClientTLSConfig returns a config trusting only the CA and verifying
// serverName.
func (f *Files) ClientTLSConfig(serverName string) *tls.Config {
	return &tls.Config{RootCAs: f.CAPool, ServerName: serverName, MinVersion: tls.VersionTLS12}
}

func sign(tmpl, parent *x509.Certificate, pub *ecdsa.PublicKey, parentKey *ecdsa.PrivateKey) (*x509.Certificate, []byte, error) {
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 128))
	if err != nil {
		return nil, nil, fmt.Errorf("testcerts: %w", err)
	}
	tmpl.SerialNumber = serial
	der, err := x509.CreateCertificate(rand.Reader, tmpl, parent, pub, parentKey)
	if err != nil {
		return nil, nil, fmt.Errorf("testcerts: %w", err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, nil, fmt.Errorf("testcerts: %w", err)
	}
	return cert, der, nil
}

// writeFile writes data with exactly mode, also when the file exists.
func writeFile(path string, data []byte, mode os.FileMode) error {
	if err := os.WriteFile(path, data, mode); err != nil {
		return fmt.Errorf("testcerts: %w", err)
	}
	if err := os.Chmod(path, mode); err != nil {
		return fmt.Errorf("testcerts: %w", err)
	}
	return nil
}
