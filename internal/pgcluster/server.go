package pgcluster

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
)

// Starting, readiness and stopping of the postmaster process.

// startServerLocked starts the postmaster; with newPort it picks a fresh port
// for each attempt, otherwise it retries the cluster's port.
func (c *Cluster) startServerLocked(ctx context.Context, newPort bool) error {
	for attempt := 1; ; attempt++ {
		if newPort {
			port, err := reservePort()
			if err != nil {
				return err
			}
			releasePort(c.port)
			c.port = port
		}
		err := c.launchLocked(ctx)
		if err == nil || !errors.Is(err, errAddrInUse) || attempt == bindAttempts {
			return err
		}
		c.log("pgcluster: port %d is taken, retrying", c.port)
		if !newPort {
			select {
			case <-time.After(200 * time.Millisecond):
			case <-ctx.Done():
				return fmt.Errorf("pgcluster: start: %w", ctx.Err())
			}
		}
	}
}

// launchLocked runs one postmaster and waits until it accepts connections;
// on failure the process group is gone when it returns.
func (c *Cluster) launchLocked(ctx context.Context) error {
	if err := c.writeConfLocked(); err != nil {
		return err
	}
	logF, err := os.OpenFile(c.logFile, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o600)
	if err != nil {
		return fmt.Errorf("pgcluster: %w", err)
	}
	defer logF.Close()
	if err := c.runAs.chown(c.logFile); err != nil {
		return err
	}
	logStart, err := logF.Seek(0, io.SeekEnd)
	if err != nil {
		return fmt.Errorf("pgcluster: %w", err)
	}

	// Not tied to ctx: the server outlives the start-up. SIGQUIT on the
	// parent's death is PostgreSQL's immediate shutdown, which still
	// removes shared memory, unlike SIGKILL.
	cmd := c.command(context.Background(), "postgres", syscall.SIGQUIT, "-D", c.dataDir)
	cmd.Stdout, cmd.Stderr = logF, logF
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("pgcluster: start postgres: %w", err)
	}
	srv := &server{cmd: cmd, done: make(chan struct{})}
	go func() {
		srv.err = cmd.Wait()
		close(srv.done)
	}()

	if err := c.waitReady(ctx, srv); err != nil {
		exited := false
		select {
		case <-srv.done:
			exited = true
		default:
		}
		stopErr := srv.stop(immediateShutdown)
		tail := c.logTail(logStart)
		if exited && strings.Contains(tail, "could not create any TCP/IP sockets") {
			return fmt.Errorf("%w: %d", errAddrInUse, c.port)
		}
		err = fmt.Errorf("%w\nserver log (%s):\n%s", err, c.logFile, tail)
		if !exited {
			err = errors.Join(err, stopErr)
		}
		return err
	}
	c.srv = srv
	c.log("pgcluster: postgres pid %d accepting connections on %s", cmd.Process.Pid, c.Addr())
	return nil
}

// waitReady polls with real connections, as pg_isready would, until the
// server accepts one, exits or startTimeout passes.
func (c *Cluster) waitReady(ctx context.Context, srv *server) error {
	ctx, cancel := context.WithTimeout(ctx, startTimeout)
	defer cancel()
	// An exiting postmaster ends the wait at once, even mid-attempt: when
	// it failed to bind, the port may belong to a listener that never
	// answers.
	go func() {
		select {
		case <-srv.done:
			cancel()
		case <-ctx.Done():
		}
	}()
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	dsn := c.SuperuserDSN("postgres")
	for {
		attemptCtx, cancelAttempt := context.WithTimeout(ctx, 2*time.Second)
		conn, err := pgconn.Connect(attemptCtx, dsn)
		cancelAttempt()
		if err == nil {
			return conn.Close(ctx)
		}
		select {
		case <-ctx.Done():
		case <-tick.C:
			continue
		}
		select {
		case <-srv.done:
			return fmt.Errorf("pgcluster: postgres exited during start-up: %v", srv.err)
		default:
			return fmt.Errorf("pgcluster: postgres not accepting connections on %s: %w (last attempt: %v)", c.Addr(), ctx.Err(), err)
		}
	}
}

// logTail returns the last lines the server logged since offset.
func (c *Cluster) logTail(offset int64) string {
	f, err := os.Open(c.logFile)
	if err != nil {
		return fmt.Sprintf("(cannot read log: %v)", err)
	}
	defer f.Close()
	const maxRead = 64 << 10
	if fi, err := f.Stat(); err == nil && fi.Size()-offset > maxRead {
		offset = fi.Size() - maxRead
	}
	if _, err := f.Seek(offset, io.SeekStart); err != nil {
		return fmt.Sprintf("(cannot read log: %v)", err)
	}
	data, err := io.ReadAll(f)
	if err != nil {
		return fmt.Sprintf("(cannot read log: %v)", err)
	}
	return lastLines(data, logTailLines)
}

func lastLines(data []byte, n int) string {
	lines := bytes.Split(bytes.TrimRight(data, "\n"), []byte("\n"))
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return string(bytes.Join(lines, []byte("\n")))
}

// StopServer shuts the postmaster down (fast shutdown: sessions are
// terminated) and keeps the data directory, so StartServer can bring the
// same cluster back on the same port. Stopping a stopped server is a no-op.
func (c *Cluster) StopServer() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.stopServerLocked()
}

func (c *Cluster) stopServerLocked() error {
	srv := c.srv
	if srv == nil {
		return nil
	}
	c.srv = nil
	pid := srv.cmd.Process.Pid
	select {
	case <-srv.done:
		// Crashed or killed from outside. Its backends notice that the
		// postmaster is gone and exit by themselves.
		return fmt.Errorf("pgcluster: postgres pid %d had exited: %v", pid, srv.err)
	default:
	}
	if err := srv.stop(fastShutdown); err != nil {
		return err
	}
	c.log("pgcluster: postgres pid %d stopped", pid)
	return nil
}

// stopStep is a signal to the postmaster and how long to wait for it to exit.
type stopStep struct {
	sig  syscall.Signal
	wait time.Duration
}

// The signals are the shutdown modes of
// https://www.postgresql.org/docs/current/server-shutdown.html: SIGINT is
// fast shutdown (sessions are terminated; SIGTERM would wait for them),
// SIGQUIT immediate shutdown (the postmaster SIGQUITs its children and
// SIGKILLs them after 5 seconds).
var (
	fastShutdown      = []stopStep{{syscall.SIGINT, stopTimeout}, {syscall.SIGQUIT, 10 * time.Second}}
	immediateShutdown = []stopStep{{syscall.SIGQUIT, 10 * time.Second}}
)

// stop takes the steps in turn until the postmaster exits, then SIGKILLs
// its process group. Only the postmaster can reach the backends, which
// call setsid and so are in groups of their own; should it be killed,
// they exit when they notice its death. stop returns nil when the first
// step worked.
func (srv *server) stop(steps []stopStep) error {
	pid := srv.cmd.Process.Pid
	for i, st := range steps {
		// Process.Signal, unlike kill(2) on the pid, cannot hit a reused pid.
		if err := srv.cmd.Process.Signal(st.sig); err != nil && !errors.Is(err, os.ErrProcessDone) {
			return fmt.Errorf("pgcluster: signal postgres pid %d: %w", pid, err)
		}
		timer := time.NewTimer(st.wait)
		select {
		case <-srv.done:
			timer.Stop()
			if i == 0 && srv.err == nil {
				return nil
			}
			return fmt.Errorf("pgcluster: postgres pid %d did not exit cleanly on %v: %v", pid, steps[0].sig, srv.err)
		case <-timer.C:
		}
	}
	killErr := killGroup(pid)
	<-srv.done
	return errors.Join(fmt.Errorf("pgcluster: postgres pid %d ignored %v, killed", pid, steps[len(steps)-1].sig), killErr)
}
