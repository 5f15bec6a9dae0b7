package proxy_test

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"

	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// TestUnixSockets relays a client on a Unix socket to PostgreSQL's own
// Unix socket. TLS is configured, and required, but a Unix socket has
// none: SSLRequest is answered 'N', as PostgreSQL answers it there, and a
// plaintext client is served.
func TestUnixSockets(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	upstream := filepath.Join(cluster.DataDir(), ".s.PGSQL."+strconv.Itoa(cluster.Port()))
	if _, err := os.Stat(upstream); err != nil {
		t.Fatalf("the cluster has no Unix socket (TMPDIR too long?): %v", err)
	}
	srv, err := proxy.NewServer(proxy.Options{
		UpstreamNetwork:  "unix",
		UpstreamAddr:     upstream,
		ClientTLS:        certs.ServerTLSConfig(),
		RequireClientTLS: true,
		Logger:           zaptest.NewLogger(t, zaptest.Level(zap.InfoLevel)),
	})
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	sock := filepath.Join(dir, ".s.PGSQL.6432")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	served := make(chan error, 1)
	go func() { served <- srv.Serve(l) }()

	t.Run("ssl-request", func(t *testing.T) {
		c, err := net.Dial("unix", sock)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		_ = c.SetDeadline(time.Now().Add(10 * time.Second))
		var req [8]byte
		binary.BigEndian.PutUint32(req[0:4], 8)
		binary.BigEndian.PutUint32(req[4:8], 80877103)
		if _, err := c.Write(req[:]); err != nil {
			t.Fatal(err)
		}
		var answer [1]byte
		if _, err := io.ReadFull(c, answer[:]); err != nil || answer[0] != 'N' {
			t.Fatalf("SSLRequest answer %q, %v; want 'N'", answer[0], err)
		}
	})
	t.Run("pgx", func(t *testing.T) {
		ctx := ctxT(t)
		conn, err := pgx.Connect(ctx, fmt.Sprintf("host=%s port=6432 user=postgres dbname=postgres sslmode=disable", dir))
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close(ctx)
		// inet_server_addr() is NULL on a Unix-socket connection.
		var local bool
		if err := conn.QueryRow(ctx, "SELECT inet_server_addr() IS NULL").Scan(&local); err != nil || !local {
			t.Fatalf("upstream over the Unix socket = %v, %v; want true", local, err)
		}
	})

	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := srv.Shutdown(ctx); err != nil {
		t.Fatal(err)
	}
	if err := <-served; !errors.Is(err, proxy.ErrServerClosed) {
		t.Fatalf("Serve: %v", err)
	}
	if _, err := os.Lstat(sock); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("socket file after shutdown: %v, want it removed", err)
	}
}
