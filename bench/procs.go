package main

import (
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"syscall"
	"time"
)

// pids maps the port of each relay the bench started (fenceproxy,
// PgBouncer, the prototypes) to its process, whose CPU time the
// select-only table reads.
var pids = map[int]int{}

// startRelayProto starts bench/relayproto (mode copy or epoll) in front of
// PostgreSQL.
func startRelayProto(bin, mode string, upstreamPort int) (int, func(), error) {
	port, err := freePort()
	if err != nil {
		return 0, nil, err
	}
	cmd := exec.Command(bin, "-mode", mode, "-listen", "127.0.0.1:"+strconv.Itoa(port), "-upstream", "127.0.0.1:"+strconv.Itoa(upstreamPort))
	cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
	if err := cmd.Start(); err != nil {
		return 0, nil, err
	}
	pids[port] = cmd.Process.Pid
	stop := func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	}
	if err := waitPort(port, 10*time.Second); err != nil {
		stop()
		return 0, nil, err
	}
	return port, stop, nil
}

func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

func waitPort(port int, d time.Duration) error {
	deadline := time.Now().Add(d)
	for time.Now().Before(deadline) {
		c, err := net.DialTimeout("tcp", "127.0.0.1:"+strconv.Itoa(port), 200*time.Millisecond)
		if err == nil {
			c.Close()
			return nil
		}
		time.Sleep(50 * time.Millisecond)
	}
	return fmt.Errorf("nothing listening on port %d after %v", port, d)
}

func startProxy(bin, work string, upstreamPort int, extraConfig string, env ...string) (int, func(), error) {
	port, err := freePort()
	if err != nil {
		return 0, nil, err
	}
	cfg := filepath.Join(work, fmt.Sprintf("fenceproxy-%d.yaml", port))
	text := fmt.Sprintf(`listen: 127.0.0.1:%d
upstream:
  address: 127.0.0.1:%d
log:
  level: warn
admin:
  listen: "off"
tables:
  - table: public.config
`, port, upstreamPort) + extraConfig
	if err := os.WriteFile(cfg, []byte(text), 0o644); err != nil {
		return 0, nil, err
	}
	cmd := exec.Command(bin, "serve", "-c", cfg)
	cmd.Env = append(os.Environ(), env...)
	cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
	if err := cmd.Start(); err != nil {
		return 0, nil, err
	}
	pids[port] = cmd.Process.Pid
	stop := func() {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		_ = cmd.Wait()
	}
	if err := waitPort(port, 10*time.Second); err != nil {
		stop()
		return 0, nil, err
	}
	return port, stop, nil
}

// startPgBouncer starts PgBouncer in session mode. Unless pooled, a server
// connection serves one client connection and is closed with it
// (server_lifetime = 0), so that every pgbench run meets new server
// processes, as it does directly and through fenceproxy, which pools
// nothing. A pooled PgBouncer hands a new client the server process an
// earlier one used, whose memory is already mapped: on this VM a new
// backend's first touches of shared buffers (page faults) cost the
// machine about 30 µs per select-only transaction for seconds, which a
// 5 s run of pooled PgBouncer does not pay and the others do.
func startPgBouncer(work string, upstreamPort int, pooled bool) (int, func(), error) {
	bin, err := exec.LookPath("pgbouncer")
	if err != nil {
		if _, serr := os.Stat("/usr/sbin/pgbouncer"); serr != nil {
			return 0, nil, errors.New("pgbouncer not installed (apt-get install pgbouncer, or run bench/run.sh)")
		}
		bin = "/usr/sbin/pgbouncer"
	}
	port, err := freePort()
	if err != nil {
		return 0, nil, err
	}
	dir := filepath.Join(work, "pgbouncer")
	lifetime := "0"
	if pooled {
		dir += "-pooled"
		lifetime = "3600"
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return 0, nil, err
	}
	ini := fmt.Sprintf(`[databases]
* = host=127.0.0.1 port=%d
[pgbouncer]
listen_addr = 127.0.0.1
listen_port = %d
unix_socket_dir =
auth_type = trust
auth_file = %s/users.txt
pool_mode = session
max_client_conn = 200
default_pool_size = 50
server_lifetime = %s
logfile = %s/pgbouncer.log
`, upstreamPort, port, dir, lifetime, dir)
	if err := os.WriteFile(filepath.Join(dir, "pgbouncer.ini"), []byte(ini), 0o644); err != nil {
		return 0, nil, err
	}
	if err := os.WriteFile(filepath.Join(dir, "users.txt"), []byte(`"postgres" ""`+"\n"), 0o644); err != nil {
		return 0, nil, err
	}
	cmd := exec.Command(bin, "-q", filepath.Join(dir, "pgbouncer.ini"))
	// PgBouncer refuses to run as root.
	if os.Geteuid() == 0 {
		u, err := user.Lookup("postgres")
		if err != nil {
			return 0, nil, fmt.Errorf("pgbouncer must not run as root and there is no postgres user: %w", err)
		}
		uid, _ := strconv.Atoi(u.Uid)
		gid, _ := strconv.Atoi(u.Gid)
		if err := os.Chown(work, uid, gid); err != nil {
			return 0, nil, err
		}
		for _, p := range []string{dir, filepath.Join(dir, "pgbouncer.ini"), filepath.Join(dir, "users.txt")} {
			if err := os.Chown(p, uid, gid); err != nil {
				return 0, nil, err
			}
		}
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}}
	}
	cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
	if err := cmd.Start(); err != nil {
		return 0, nil, err
	}
	pids[port] = cmd.Process.Pid
	stop := func() {
		_ = cmd.Process.Signal(syscall.SIGINT)
		_ = cmd.Wait()
	}
	if err := waitPort(port, 10*time.Second); err != nil {
		stop()
		return 0, nil, err
	}
	return port, stop, nil
}
