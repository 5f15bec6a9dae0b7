package service_test

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/fenceproxy/fenceproxy/internal/config"
	"github.com/fenceproxy/fenceproxy/internal/service"
	"github.com/fenceproxy/fenceproxy/internal/testcerts"
)

// TestProxyOptionsCertAuth checks that auth.method cert, auth.file,
// upstream.tls.follow_client and upstream.tls.cert_file reach the relay.
func TestProxyOptionsCertAuth(t *testing.T) {
	dir := t.TempDir()
	f, err := testcerts.Generate(dir)
	if err != nil {
		t.Fatal(err)
	}
	users := filepath.Join(dir, "users.txt")
	if err := os.WriteFile(users, []byte(`"alice" "hunter2"`+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	cfg, err := config.Parse([]byte(`
upstream: {address: '127.0.0.1:5432', tls: {mode: verify-full, ca_file: ` + f.CAFile + `, follow_client: true, cert_file: ` + f.CertFile + `, key_file: ` + f.KeyFile + `}}
tls: {cert_file: ` + f.CertFile + `, key_file: ` + f.KeyFile + `, client_ca_file: ` + f.CAFile + `}
auth: {method: cert, file: ` + users + `}
`))
	if err != nil {
		t.Fatal(err)
	}
	opts, err := service.ProxyOptions(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ca := opts.ClientCertAuth
	if ca == nil || ca.CAs == nil || ca.Passwords["alice"] != "hunter2" {
		t.Fatalf("ClientCertAuth (set: %v) lacks the CA or alice's password", ca != nil)
	}
	if !opts.UpstreamTLSFollowsClient {
		t.Error("UpstreamTLSFollowsClient not set")
	}
	if opts.UpstreamTLS == nil || len(opts.UpstreamTLS.Certificates) != 1 {
		t.Error("upstream.tls.cert_file not presented upstream")
	}

	cfg, err = config.Parse([]byte("upstream: {address: '127.0.0.1:5432'}"))
	if err != nil {
		t.Fatal(err)
	}
	if opts, err = service.ProxyOptions(cfg); err != nil || opts.ClientCertAuth != nil || opts.UpstreamTLSFollowsClient {
		t.Errorf("defaults: err %v, ClientCertAuth set %v, follow %v", err, opts.ClientCertAuth != nil, opts.UpstreamTLSFollowsClient)
	}
}
