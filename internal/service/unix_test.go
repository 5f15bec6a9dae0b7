package service_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/fenceproxy/fenceproxy/internal/config"
	"github.com/fenceproxy/fenceproxy/internal/rules"
	"github.com/fenceproxy/fenceproxy/internal/service"
	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// TestUnixSocketListen: with listen naming a directory, clients reach the
// proxy with host=<directory> as they reach PostgreSQL; a socket file left
// behind by a killed proxy is replaced, a live one or another file is
// not, and the file is removed on shutdown.
func TestUnixSocketListen(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	createTable(t, "public.unix_listen_a")
	dir := t.TempDir()
	sock := filepath.Join(dir, ".s.PGSQL.7432")
	// A stale socket, as a proxy killed with SIGKILL leaves it.
	stale, err := net.ListenUnix("unix", &net.UnixAddr{Name: sock, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	stale.SetUnlinkOnClose(false)
	_ = stale.Close()

	path := filepath.Join(t.TempDir(), "fenceproxy.yaml")
	text := fmt.Sprintf("listen: %s\nlisten_port: 7432\nupstream:\n  address: %s\nadmin:\n  listen: \"off\"\ntables:\n  - table: public.unix_listen_a\n", dir, cluster.Addr())
	writeFile(t, path, text)
	in, _ := startInstance(t, path)
	if in.Addr() != sock {
		t.Errorf("Addr = %q, want %q", in.Addr(), sock)
	}
	fi, err := os.Lstat(sock)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode().Type() != os.ModeSocket || fi.Mode().Perm() != 0o777 {
		t.Errorf("socket file mode %v, want a socket with 0777 (PostgreSQL's unix_socket_permissions)", fi.Mode())
	}

	ctx := context.Background()
	dsn := fmt.Sprintf("host=%s port=7432 user=postgres dbname=postgres sslmode=disable options='-c fence.token=%%d'", dir)
	c42, err := pgx.Connect(ctx, fmt.Sprintf(dsn, 42))
	if err != nil {
		t.Fatal(err)
	}
	defer c42.Close(ctx)
	if tag, err := c42.Exec(ctx, "UPDATE unix_listen_a SET v = 'x' WHERE id = 1"); err != nil || tag.RowsAffected() != 1 {
		t.Fatalf("fenced write over the socket: %v, %v", tag, err)
	}
	c41, err := pgx.Connect(ctx, fmt.Sprintf(dsn, 41))
	if err != nil {
		t.Fatal(err)
	}
	defer c41.Close(ctx)
	if _, err := c41.Exec(ctx, "UPDATE unix_listen_a SET v = 'y' WHERE id = 1"); sqlstate(err) != rules.CodeStaleToken {
		t.Fatalf("stale write over the socket: %v, want %s", err, rules.CodeStaleToken)
	}

	// A second instance must not take the socket of a running one.
	cfg, err := config.Load(path)
	if err != nil {
		t.Fatal(err)
	}
	if second, err := service.Start(cfg, "", nil); err == nil {
		_ = second.Shutdown()
		t.Fatal("a second instance took the socket of a running one")
	} else if !strings.Contains(err.Error(), "listen:") {
		t.Errorf("error %q does not name listen", err)
	}

	c42.Close(ctx)
	c41.Close(ctx)
	if err := in.Shutdown(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Lstat(sock); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("socket file after shutdown: %v, want it removed", err)
	}

	// Not a socket: left alone, and the start fails.
	if err := os.WriteFile(sock, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if third, err := service.Start(cfg, "", nil); err == nil {
		_ = third.Shutdown()
		t.Fatal("started over a file that is not a socket")
	} else if !strings.Contains(err.Error(), "listen:") || !strings.Contains(err.Error(), "not a socket") {
		t.Errorf("error %q, want listen: ... not a socket", err)
	}
}

// TestUnixSocketUpstream: with upstream.address naming PostgreSQL's socket
// directory, the relay, /readyz and the audit listener all reach it there.
func TestUnixSocketUpstream(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	if _, err := os.Stat(filepath.Join(cluster.DataDir(), ".s.PGSQL."+strconv.Itoa(cluster.Port()))); err != nil {
		t.Fatalf("the cluster has no Unix socket (TMPDIR too long?): %v", err)
	}
	createTable(t, "public.unix_up_a")
	createTable(t, "public.unix_up_audit")
	path := filepath.Join(t.TempDir(), "fenceproxy.yaml")
	writeFile(t, path, fmt.Sprintf(`listen: 127.0.0.1:0
upstream:
  address: %s
  port: %d
admin:
  listen: 127.0.0.1:0
tables:
  - table: public.unix_up_a
  - table: public.unix_up_audit
    mode: audit
`, cluster.DataDir(), cluster.Port()))
	in, _ := startInstance(t, path)
	get(t, "http://"+in.AdminAddr()+"/readyz", http.StatusOK)

	ctx := context.Background()
	c42 := connect(t, in.Addr(), "42")
	var local bool
	if err := c42.QueryRow(ctx, "SELECT inet_server_addr() IS NULL").Scan(&local); err != nil || !local {
		t.Fatalf("upstream over the Unix socket = %v, %v; want true", local, err)
	}
	if tag, err := c42.Exec(ctx, "UPDATE unix_up_a SET v = 'x' WHERE id = 1"); err != nil || tag.RowsAffected() != 1 {
		t.Fatalf("fenced write: %v, %v", tag, err)
	}
	c41 := connect(t, in.Addr(), "41")
	if _, err := c41.Exec(ctx, "UPDATE unix_up_a SET v = 'y' WHERE id = 1"); sqlstate(err) != rules.CodeStaleToken {
		t.Fatalf("stale write: %v, want %s", err, rules.CodeStaleToken)
	}
	// The audit listener connects through the socket as well.
	if _, err := c42.Exec(ctx, "UPDATE unix_up_audit SET v = 'x' WHERE id = 1"); err != nil {
		t.Fatal(err)
	}
	if _, err := c41.Exec(ctx, "UPDATE unix_up_audit SET v = 'y' WHERE id = 1"); err != nil {
		t.Fatalf("audit mode blocked a stale write: %v", err)
	}
	waitFor(t, func() bool {
		return metric(t, in, `fenceproxy_audit_would_reject_total{reason="stale",table="public.unix_up_audit"}`) == 1
	})
}
