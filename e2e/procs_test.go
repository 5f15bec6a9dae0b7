package e2e_test

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// The parent's side of the worker processes: start the test binary as a
// worker, send it command lines, read its report lines, pause and resume it.

const (
	// roleEnv selects the worker a re-executed test binary runs instead of
	// the tests: roleClient or roleTorture.
	roleEnv = "FENCEPROXY_E2E_ROLE"
	// configEnv carries the worker's workerConfig as JSON.
	configEnv = "FENCEPROXY_E2E_WORKER"
	// linePrefix marks the worker's protocol lines on stdout; anything
	// else a library might print there is passed to the test log instead.
	linePrefix = "E2E "
)

const (
	roleClient  = "client"
	roleTorture = "torture"
)

// workerConfig is what a worker needs to know, passed in its environment.
type workerConfig struct {
	Name string   `json:"name"`
	DSN  string   `json:"dsn"`
	Etcd []string `json:"etcd"`

	// Torture workers only.
	//
	// DSNs are the proxies (or the database) a torture worker connects
	// to, one picked at random for each new connection; it ignores DSN.
	DSNs           []string      `json:"dsns"`
	KeyPrefix      string        `json:"key_prefix"`
	Keys           int           `json:"keys"`
	TTL            time.Duration `json:"ttl"`
	MinThink       time.Duration `json:"min_think"`
	MaxThink       time.Duration `json:"max_think"`
	TxThinkOdds    float64       `json:"tx_think_odds"` // chance of thinking before COMMIT too
	SimpleProtocol bool          `json:"simple_protocol"`
	Seed           uint64        `json:"seed"`
	// SkipBusyOdds is the chance that a worker that finds the lock of the
	// key it picked taken moves on to another key instead of waiting in
	// line. Default 0: always wait.
	SkipBusyOdds float64 `json:"skip_busy_odds"`
	// NameLock selects the lock-fencing protocol: the session names its
	// lock in fence.lock as well as its token in fence.token, and the
	// operation has no stamp. Otherwise the worker sets fence.token only
	// and stamps the row before reading it.
	NameLock bool `json:"name_lock"`
	// LockViaStartup (with NameLock) hands each grant to PostgreSQL as
	// startup parameters, with pgxlock.Configure on a fresh connection
	// per operation, closed after it. Otherwise the worker keeps its
	// connection and sets both settings with set_config.
	LockViaStartup bool `json:"lock_via_startup"`
}

// proc is a running worker process.
type proc struct {
	name  string
	cmd   *exec.Cmd
	stdin io.WriteCloser
	// lines receives the worker's protocol lines, without linePrefix; it
	// is closed when the worker's stdout ends.
	lines  chan string
	stderr *tailBuffer
	// exited is closed once the process has been waited for.
	exited  chan struct{}
	waitErr error

	mu      sync.Mutex
	stopped bool // SIGSTOP sent and not yet followed by SIGCONT
}

// startProc starts the test binary as a worker with role and cfg. The
// process is resumed and ended when t finishes, however the test ends.
func startProc(t testing.TB, role string, cfg workerConfig) *proc {
	t.Helper()
	exe, err := os.Executable()
	if err != nil {
		t.Fatalf("find the test binary: %v", err)
	}
	js, err := json.Marshal(cfg)
	if err != nil {
		t.Fatal(err)
	}
	// -test.run=^$: should the role be ignored somehow, run no tests
	// rather than recursing into them.
	cmd := exec.Command(exe, "-test.run=^$")
	cmd.Env = append(os.Environ(), roleEnv+"="+role, configEnv+"="+string(js))
	cmd.SysProcAttr = workerProcAttr()
	p := &proc{
		name:   cfg.Name,
		cmd:    cmd,
		lines:  make(chan string, 1024),
		stderr: &tailBuffer{max: 64 << 10},
		exited: make(chan struct{}),
	}
	cmd.Stderr = p.stderr
	if p.stdin, err = cmd.StdinPipe(); err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatalf("start worker %s: %v", cfg.Name, err)
	}
	go func() {
		// Wait only after stdout is drained, as exec.Cmd requires.
		sc := bufio.NewScanner(stdout)
		sc.Buffer(make([]byte, 64<<10), 1<<20)
		for sc.Scan() {
			line := sc.Text()
			if rest, ok := strings.CutPrefix(line, linePrefix); ok {
				p.lines <- rest
			} else {
				fmt.Fprintf(p.stderr, "stdout: %s\n", line)
			}
		}
		close(p.lines)
		p.waitErr = cmd.Wait()
		close(p.exited)
	}()
	t.Cleanup(func() {
		if err := p.end(10 * time.Second); err != nil {
			t.Errorf("worker %s: %v; stderr:\n%s", p.name, err, p.stderr.String())
		}
	})
	return p
}

// send writes one command line to the worker.
func (p *proc) send(t testing.TB, format string, args ...any) {
	t.Helper()
	if _, err := fmt.Fprintf(p.stdin, format+"\n", args...); err != nil {
		t.Fatalf("worker %s: send: %v; stderr:\n%s", p.name, err, p.stderr.String())
	}
}

// next returns the worker's next line, failing the test if none comes
// within a generous timeout (a sign of a hang, not of slowness).
func (p *proc) next(t testing.TB) string {
	t.Helper()
	select {
	case line, ok := <-p.lines:
		if !ok {
			<-p.exited
			t.Fatalf("worker %s exited (%v); stderr:\n%s", p.name, p.waitErr, p.stderr.String())
		}
		return line
	case <-time.After(60 * time.Second):
		t.Fatalf("worker %s: no answer within 60s; stderr:\n%s", p.name, p.stderr.String())
		return ""
	}
}

// pause stops the process with SIGSTOP, like a stop-the-world pause: every
// thread stops, including the lease monitor and any keep-alive.
func (p *proc) pause(t testing.TB) {
	t.Helper()
	if err := p.signal(syscall.SIGSTOP); err != nil {
		t.Fatalf("worker %s: SIGSTOP: %v", p.name, err)
	}
}

// resume continues a paused process with SIGCONT.
func (p *proc) resume(t testing.TB) {
	t.Helper()
	if err := p.signal(syscall.SIGCONT); err != nil {
		t.Fatalf("worker %s: SIGCONT: %v", p.name, err)
	}
}

func (p *proc) signal(sig syscall.Signal) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	select {
	case <-p.exited:
		return fmt.Errorf("process has exited")
	default:
	}
	if err := p.cmd.Process.Signal(sig); err != nil {
		return err
	}
	switch sig {
	case syscall.SIGSTOP:
		p.stopped = true
	case syscall.SIGCONT:
		p.stopped = false
	}
	return nil
}

// end resumes the worker, closes its stdin (which tells it to finish) and
// waits for it to exit, killing it after grace. It is idempotent. A worker
// that had to be killed, or exited with a failure, is reported.
func (p *proc) end(grace time.Duration) error {
	select {
	case <-p.exited:
		return p.exitErr()
	default:
	}
	_ = p.signal(syscall.SIGCONT)
	_ = p.stdin.Close()
	select {
	case <-p.exited:
		return p.exitErr()
	case <-time.After(grace):
	}
	_ = p.cmd.Process.Kill()
	<-p.exited
	return fmt.Errorf("did not exit within %v of stdin closing; killed", grace)
}

// wait waits for the worker to exit on its own, killing it after grace.
func (p *proc) wait(grace time.Duration) error {
	select {
	case <-p.exited:
		return p.exitErr()
	case <-time.After(grace):
		return p.end(time.Second)
	}
}

func (p *proc) exitErr() error {
	if p.waitErr != nil {
		return fmt.Errorf("exited: %w", p.waitErr)
	}
	return nil
}

// tailBuffer keeps the last max bytes written to it; it holds a worker's
// stderr for failure messages.
type tailBuffer struct {
	mu  sync.Mutex
	max int
	buf []byte
}

func (b *tailBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.buf = append(b.buf, p...)
	if over := len(b.buf) - b.max; over > 0 {
		b.buf = append(b.buf[:0], b.buf[over:]...)
	}
	return len(p), nil
}

func (b *tailBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return string(b.buf)
}
