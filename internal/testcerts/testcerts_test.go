package testcerts_test

import (
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"os"
	"path/filepath"
	"testing"

	"github.com/fenceproxy/fenceproxy/internal/testcerts"
)

func TestGenerate(t *testing.T) {
	dir := t.TempDir()
	f, err := testcerts.Generate(dir, "db.example", "10.1.2.3", "localhost")
	if err != nil {
		t.Fatal(err)
	}
	for path, wantMode := range map[string]os.FileMode{f.CAFile: 0o644, f.CertFile: 0o644, f.KeyFile: 0o600} {
		if filepath.Dir(path) != dir {
			t.Errorf("%s not in %s", path, dir)
		}
		fi, err := os.Stat(path)
		if err != nil {
			t.Fatal(err)
		}
		if fi.Mode().Perm() != wantMode {
			t.Errorf("%s: mode %v, want %v", path, fi.Mode().Perm(), wantMode)
		}
	}
	// The files on disk are what a server would load.
	pair, err := tls.LoadX509KeyPair(f.CertFile, f.KeyFile)
	if err != nil {
		t.Fatal(err)
	}
	leaf, err := x509.ParseCertificate(pair.Certificate[0])
	if err != nil {
		t.Fatal(err)
	}
	caPEM, err := os.ReadFile(f.CAFile)
	if err != nil {
		t.Fatal(err)
	}
	roots := x509.NewCertPool()
	if !roots.AppendCertsFromPEM(caPEM) {
		t.Fatal("ca.crt holds no certificate")
	}
	if block, _ := pem.Decode(caPEM); block == nil || !f.CACert.Equal(mustParse(t, block.Bytes)) {
		t.Error("ca.crt differs from CACert")
	}

	for _, name := range []string{"localhost", "127.0.0.1", "::1", "db.example", "10.1.2.3"} {
		for poolName, pool := range map[string]*x509.CertPool{"ca.crt": roots, "CAPool": f.CAPool} {
			opts := x509.VerifyOptions{DNSName: name, Roots: pool, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}
			if _, err := leaf.Verify(opts); err != nil {
				t.Errorf("verify for %q with %s: %v", name, poolName, err)
			}
		}
	}
	if _, err := leaf.Verify(x509.VerifyOptions{DNSName: "other.example", Roots: roots}); err == nil {
		t.Error("certificate verified for other.example")
	}
	if len(f.Hosts) != 5 {
		t.Errorf("Hosts = %q, want 5 distinct names", f.Hosts)
	}
}

func TestHandshake(t *testing.T) {
	f, err := testcerts.Generate(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	// TCP rather than net.Pipe: a TLS 1.3 server writes session tickets
	// that nobody reads during the handshake, which a pipe would block on.
	l, err := tls.Listen("tcp", "127.0.0.1:0", f.ServerTLSConfig())
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	names := []string{"localhost", "127.0.0.1"}
	errc := make(chan error, len(names))
	go func() {
		for range names {
			conn, err := l.Accept()
			if err == nil {
				err = conn.(*tls.Conn).Handshake()
				conn.Close()
			}
			errc <- err
		}
	}()
	for _, name := range names {
		conn, err := tls.Dial("tcp", l.Addr().String(), f.ClientTLSConfig(name))
		if err != nil {
			t.Fatalf("client handshake for %s: %v", name, err)
		}
		conn.Close()
		if err := <-errc; err != nil {
			t.Fatalf("server handshake: %v", err)
		}
	}
}

func TestGenerateMissingDir(t *testing.T) {
	if _, err := testcerts.Generate(filepath.Join(t.TempDir(), "missing")); err == nil {
		t.Error("Generate into a missing directory succeeded")
	}
}

func mustParse(t *testing.T, der []byte) *x509.Certificate {
	t.Helper()
	c, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	return c
}
