package service_test

import (
	"context"
	"fmt"
	"path/filepath"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/fenceproxy/fenceproxy/internal/pgcluster"
	"github.com/fenceproxy/fenceproxy/internal/pgcluster/pgtest"
	"github.com/fenceproxy/fenceproxy/internal/testcerts"
	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// TestUpstreamVerifyModes: verify-ca and verify-full accept the upstream's
// certificate with the right CA and refuse it with another.
func TestUpstreamVerifyModes(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	certs, err := testcerts.Generate(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	other, err := testcerts.Generate(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	pg := pgtest.Start(t, pgcluster.Options{TLS: &pgcluster.TLSFiles{CertFile: certs.CertFile, KeyFile: certs.KeyFile}})
	for _, c := range []struct {
		mode, ca string
		ok       bool
	}{
		{"verify-ca", certs.CAFile, true},
		{"verify-full", certs.CAFile, true},
		{"verify-ca", other.CAFile, false},
		{"verify-full", other.CAFile, false},
	} {
		path := filepath.Join(t.TempDir(), "fenceproxy.yaml")
		writeFile(t, path, fmt.Sprintf("listen: 127.0.0.1:0\nupstream:\n  address: %s\n  tls:\n    mode: %s\n    ca_file: %s\nadmin:\n  listen: \"off\"\n", pg.Addr(), c.mode, c.ca))
		in, _ := startInstance(t, path)
		conn, err := pgx.Connect(context.Background(), "postgres://postgres@"+in.Addr()+"/postgres?sslmode=disable")
		if c.ok {
			if err != nil {
				t.Errorf("%s with the right CA: %v", c.mode, err)
				continue
			}
			var ssl bool
			if err := conn.QueryRow(context.Background(), "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()").Scan(&ssl); err != nil || !ssl {
				t.Errorf("%s: upstream connection not encrypted (%v, %v)", c.mode, ssl, err)
			}
			conn.Close(context.Background())
		} else if sqlstate(err) != "08006" {
			t.Errorf("%s with another CA: %v, want 08006", c.mode, err)
		}
	}
}
