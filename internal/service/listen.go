package service

import (
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"syscall"
	"time"

	"github.com/fenceproxy/fenceproxy/internal/config"
)

// socketMode is the Unix socket's permissions: PostgreSQL's default
// unix_socket_permissions. Access is restricted by the directory's
// permissions, as the PostgreSQL documentation recommends.
const socketMode fs.FileMode = 0o777

// listen opens the client listener of cfg: TCP, or a Unix socket whose
// file is removed when the listener is closed.
func listen(cfg *config.Config) (net.Listener, error) {
	network, addr := cfg.ListenNetwork()
	if network != "unix" {
		l, err := net.Listen(network, addr)
		if err != nil {
			return nil, fmt.Errorf("listen: %w", err)
		}
		return l, nil
	}
	if err := removeStaleSocket(addr); err != nil {
		return nil, fmt.Errorf("listen: %w", err)
	}
	l, err := net.Listen("unix", addr)
	if err != nil {
		return nil, fmt.Errorf("listen: %w", err)
	}
	// The umask applies to the file bind creates.
	if err := os.Chmod(addr, socketMode); err != nil {
		_ = l.Close()
		return nil, fmt.Errorf("listen: %w", err)
	}
	return l, nil
}

// removeStaleSocket removes a socket file left by a process that did not
// close its listener (kill -9), as PgBouncer does; a file that is not a
// socket, or a socket someone still accepts on, is an error.
func removeStaleSocket(path string) error {
	fi, err := os.Lstat(path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	if fi.Mode().Type() != fs.ModeSocket {
		return fmt.Errorf("%s exists and is not a socket", path)
	}
	c, err := net.DialTimeout("unix", path, time.Second)
	if err == nil {
		_ = c.Close()
		return fmt.Errorf("%s: another process is listening on it", path)
	}
	// Only a refused connection proves that nobody listens; a socket we
	// may not connect to (EACCES) may well be alive.
	if !errors.Is(err, syscall.ECONNREFUSED) {
		return fmt.Errorf("%s exists and cannot be checked for a listener: %w", path, err)
	}
	return os.Remove(path)
}
