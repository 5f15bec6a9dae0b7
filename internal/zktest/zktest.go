// Package zktest runs a throwaway standalone ZooKeeper (Debian's
// zookeeperd) on a free 127.0.0.1 port for tests, and speaks just enough of
// the ZooKeeper client protocol to play the lock recipe: create, exists
// (the node's Stat), get children, delete, ping and close, with no watches.
//
// Start fails the test with a clear message when zookeeperd is missing;
// callers skip under -short themselves (testutil.SkipSystem) before calling
// it. Restart kills the server with SIGKILL and starts it again on the same
// data directory, so what the server acknowledged (its transaction log is
// fsynced before each reply) survives and nothing else does.
package zktest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"sync"
	"syscall"
	"testing"
	"time"
)

// Where zookeeperd puts its jar and configuration directory (the log4j
// settings); java comes from PATH.
const (
	JarEnv     = "FENCEPROXY_ZOOKEEPER_JAR"
	defaultJar = "/usr/share/java/zookeeper.jar"
	confDir    = "/etc/zookeeper/conf"
	// CLI is zookeeperd's command-line client.
	CLI = "/usr/share/zookeeper/bin/zkCli.sh"

	startTimeout = 60 * time.Second
)

// Server is a standalone ZooKeeper process with its data directory.
type Server struct {
	t    testing.TB
	jar  string
	java string
	dir  string

	mu     sync.Mutex
	port   int
	cmd    *exec.Cmd
	exited chan struct{}
}

// Start starts a server with a fresh data directory and waits until it
// accepts a session. It is stopped when the test ends.
func Start(t testing.TB) *Server {
	t.Helper()
	jar := os.Getenv(JarEnv)
	if jar == "" {
		jar = defaultJar
	}
	if _, err := os.Stat(jar); err != nil {
		t.Fatalf("zktest: ZooKeeper is not installed: %s missing (apt-get install zookeeperd, or scripts/install-deps.sh; or set %s)", jar, JarEnv)
	}
	java, err := exec.LookPath("java")
	if err != nil {
		t.Fatalf("zktest: java not found in PATH (zookeeperd needs a JRE: apt-get install zookeeperd)")
	}
	s := &Server{t: t, jar: jar, java: java, dir: t.TempDir()}
	if err := os.MkdirAll(filepath.Join(s.dir, "data"), 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.kill)
	s.launch()
	return s
}

// Addr is the server's current host:port (it changes on Restart).
func (s *Server) Addr() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return net.JoinHostPort("127.0.0.1", strconv.Itoa(s.port))
}

// DataDir is the server's data directory (snapshots and transaction log).
func (s *Server) DataDir() string { return filepath.Join(s.dir, "data") }

// Restart kills the server with SIGKILL and starts it again on the same
// data directory (on a new free port) and waits until it accepts a
// session.
func (s *Server) Restart() {
	s.t.Helper()
	s.kill()
	s.launch()
}

func (s *Server) launch() {
	s.t.Helper()
	port, err := freePort()
	if err != nil {
		s.t.Fatal(err)
	}
	cfg := fmt.Sprintf("tickTime=2000\ndataDir=%s\nclientPort=%d\nclientPortAddress=127.0.0.1\n"+
		"admin.enableServer=false\nmaxClientCnxns=0\n4lw.commands.whitelist=*\n", s.DataDir(), port)
	cfgFile := filepath.Join(s.dir, "zoo.cfg")
	if err := os.WriteFile(cfgFile, []byte(cfg), 0o644); err != nil {
		s.t.Fatal(err)
	}
	logFile, err := os.OpenFile(filepath.Join(s.dir, "zookeeper.out"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		s.t.Fatal(err)
	}
	defer logFile.Close()
	cmd := exec.Command(s.java,
		"-Dzookeeper.log.dir="+s.dir, "-Dzookeeper.root.logger=INFO,CONSOLE",
		"-Xmx256m", "-cp", confDir+":"+s.jar,
		"org.apache.zookeeper.server.quorum.QuorumPeerMain", cfgFile)
	cmd.Stdout, cmd.Stderr = logFile, logFile
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		s.t.Fatalf("zktest: start ZooKeeper: %v", err)
	}
	exited := make(chan struct{})
	go func() { cmd.Wait(); close(exited) }()
	s.mu.Lock()
	s.port, s.cmd, s.exited = port, cmd, exited
	s.mu.Unlock()

	deadline := time.Now().Add(startTimeout)
	for {
		c, err := Dial(s.Addr())
		if err == nil {
			c.Close()
			return
		}
		select {
		case <-exited:
			s.t.Fatalf("zktest: ZooKeeper exited during start-up: %s", s.output())
		case <-time.After(200 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			s.t.Fatalf("zktest: ZooKeeper did not accept a session within %v (%v): %s", startTimeout, err, s.output())
		}
	}
}

func (s *Server) output() string {
	b, _ := os.ReadFile(filepath.Join(s.dir, "zookeeper.out"))
	if len(b) > 4000 {
		b = b[len(b)-4000:]
	}
	return string(b)
}

func (s *Server) kill() {
	s.mu.Lock()
	cmd, exited := s.cmd, s.exited
	s.cmd = nil
	s.mu.Unlock()
	if cmd == nil {
		return
	}
	syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
	<-exited
}

func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// RunCLI runs zkCli.sh against addr with one command (for example "stat",
// "/locks/a/lock-0000000000") and returns its output.
func RunCLI(ctx context.Context, addr string, command ...string) (string, error) {
	cmd := exec.CommandContext(ctx, CLI, append([]string{"-server", addr}, command...)...)
	cmd.Env = append(os.Environ(), "ZOO_LOG_DIR="+os.TempDir())
	out, err := cmd.CombinedOutput()
	return string(out), err
}

// The client side: ZooKeeper's jute encoding, big-endian, each message
// framed by a 4-byte length.

// Create flags.
const (
	Persistent          int32 = 0
	Ephemeral           int32 = 1
	Sequential          int32 = 2
	EphemeralSequential int32 = 3
)

const (
	opDelete       = 2
	opExists       = 3
	opGetChildren  = 8
	opPing         = 11
	opCreate       = 1
	opCloseSession = -11
	xidPing        = -2
)

// Error is a ZooKeeper error code in a reply.
type Error int32

// The codes the lock recipe meets.
const (
	ErrNoNode     Error = -101
	ErrNodeExists Error = -110
	ErrNotEmpty   Error = -111
)

func (e Error) Error() string {
	switch e {
	case ErrNoNode:
		return "zk: node does not exist"
	case ErrNodeExists:
		return "zk: node already exists"
	case ErrNotEmpty:
		return "zk: node has children"
	}
	return fmt.Sprintf("zk: error %d", int32(e))
}

// Stat is a node's metadata (ZooKeeper's org.apache.zookeeper.data.Stat).
type Stat struct {
	Czxid, Mzxid, Ctime, Mtime  int64
	Version, Cversion, Aversion int32
	EphemeralOwner              int64
	DataLength, NumChildren     int32
	Pzxid                       int64
}

// Conn is one ZooKeeper session. Requests are sent one at a time; a
// background ping keeps the session alive. Safe for concurrent use.
type Conn struct {
	mu        sync.Mutex
	nc        net.Conn
	xid       int32
	sessionID int64
	stop      chan struct{}
	done      chan struct{}
	closeOnce sync.Once
}

const sessionTimeout = 30 * time.Second

// Dial opens a session on the server at addr.
func Dial(addr string) (*Conn, error) {
	nc, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		return nil, err
	}
	var w enc
	w.i32(0)                                    // protocolVersion
	w.i64(0)                                    // lastZxidSeen
	w.i32(int32(sessionTimeout.Milliseconds())) // timeOut
	w.i64(0)                                    // sessionId
	w.buf(make([]byte, 16))                     // passwd
	w.bool(false)                               // readOnly
	nc.SetDeadline(time.Now().Add(10 * time.Second))
	if err := writeFrame(nc, w.b.Bytes()); err != nil {
		nc.Close()
		return nil, err
	}
	resp, err := readFrame(nc)
	if err != nil {
		nc.Close()
		return nil, fmt.Errorf("zk: connect: %w", err)
	}
	d := dec{b: resp}
	d.i32() // protocolVersion
	timeout := d.i32()
	sid := d.i64()
	if d.err != nil || timeout <= 0 || sid == 0 {
		nc.Close()
		return nil, fmt.Errorf("zk: connect refused (timeout %d, session %#x, %v)", timeout, sid, d.err)
	}
	nc.SetDeadline(time.Time{})
	c := &Conn{nc: nc, sessionID: sid, stop: make(chan struct{}), done: make(chan struct{})}
	go c.pinger(time.Duration(timeout) * time.Millisecond / 3)
	return c, nil
}

// SessionID is the session's id.
func (c *Conn) SessionID() int64 { return c.sessionID }

func (c *Conn) pinger(every time.Duration) {
	defer close(c.done)
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-c.stop:
			return
		case <-t.C:
			if _, _, err := c.call(xidPing, opPing, nil); err != nil {
				return
			}
		}
	}
}

// call sends one request and reads its reply: the reply header's zxid and
// the body.
func (c *Conn) call(xid, op int32, body []byte) (int64, []byte, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if xid == 0 {
		c.xid++
		xid = c.xid
	}
	var w enc
	w.i32(xid)
	w.i32(op)
	w.b.Write(body)
	c.nc.SetDeadline(time.Now().Add(15 * time.Second))
	defer c.nc.SetDeadline(time.Time{})
	if err := writeFrame(c.nc, w.b.Bytes()); err != nil {
		return 0, nil, err
	}
	for {
		resp, err := readFrame(c.nc)
		if err != nil {
			return 0, nil, err
		}
		d := dec{b: resp}
		rxid, zxid, code := d.i32(), d.i64(), d.i32()
		if d.err != nil {
			return 0, nil, d.err
		}
		if rxid != xid {
			continue // a late ping reply, or a notification (no watches are set)
		}
		if code != 0 {
			return zxid, nil, Error(code)
		}
		return zxid, d.b, nil
	}
}

// Create creates path with data and open ACLs; flags is one of Persistent,
// Ephemeral, Sequential, EphemeralSequential. It returns the created path
// (with the sequence suffix) and the zxid in the reply's header (the
// creating transaction's).
func (c *Conn) Create(path string, data []byte, flags int32) (string, int64, error) {
	var w enc
	w.str(path)
	w.buf(data)
	w.i32(1) // one ACL: world:anyone, all permissions (OPEN_ACL_UNSAFE)
	w.i32(31)
	w.str("world")
	w.str("anyone")
	w.i32(flags)
	zxid, body, err := c.call(0, opCreate, w.b.Bytes())
	if err != nil {
		return "", zxid, err
	}
	d := dec{b: body}
	created := d.str()
	return created, zxid, d.err
}

// Exists returns path's Stat, or ErrNoNode.
func (c *Conn) Exists(path string) (Stat, error) {
	var w enc
	w.str(path)
	w.bool(false)
	_, body, err := c.call(0, opExists, w.b.Bytes())
	if err != nil {
		return Stat{}, err
	}
	d := dec{b: body}
	st := Stat{
		Czxid: d.i64(), Mzxid: d.i64(), Ctime: d.i64(), Mtime: d.i64(),
		Version: d.i32(), Cversion: d.i32(), Aversion: d.i32(),
		EphemeralOwner: d.i64(), DataLength: d.i32(), NumChildren: d.i32(),
		Pzxid: d.i64(),
	}
	return st, d.err
}

// Children returns the names of path's children.
func (c *Conn) Children(path string) ([]string, error) {
	var w enc
	w.str(path)
	w.bool(false)
	_, body, err := c.call(0, opGetChildren, w.b.Bytes())
	if err != nil {
		return nil, err
	}
	d := dec{b: body}
	n := d.i32()
	names := make([]string, 0, max(n, 0))
	for i := int32(0); i < n && d.err == nil; i++ {
		names = append(names, d.str())
	}
	return names, d.err
}

// Delete deletes path whatever its version.
func (c *Conn) Delete(path string) error {
	var w enc
	w.str(path)
	w.i32(-1)
	_, _, err := c.call(0, opDelete, w.b.Bytes())
	return err
}

// Close ends the session (the server deletes its ephemeral nodes) and the
// connection.
func (c *Conn) Close() error {
	var err error
	c.closeOnce.Do(func() {
		close(c.stop)
		<-c.done
		_, _, err = c.call(0, opCloseSession, nil)
		c.nc.Close()
	})
	return err
}

type enc struct{ b bytes.Buffer }

func (e *enc) i32(v int32) { e.b.Write([]byte{byte(v >> 24), byte(v >> 16), byte(v >> 8), byte(v)}) }
func (e *enc) i64(v int64) { e.i32(int32(v >> 32)); e.i32(int32(v)) }
func (e *enc) bool(v bool) {
	if v {
		e.b.WriteByte(1)
	} else {
		e.b.WriteByte(0)
	}
}
func (e *enc) buf(v []byte) { e.i32(int32(len(v))); e.b.Write(v) }
func (e *enc) str(v string) { e.i32(int32(len(v))); e.b.WriteString(v) }

type dec struct {
	b   []byte
	err error
}

var errShort = errors.New("zk: short reply")

func (d *dec) i32() int32 {
	if d.err != nil || len(d.b) < 4 {
		d.err = errShort
		return 0
	}
	v := int32(uint32(d.b[0])<<24 | uint32(d.b[1])<<16 | uint32(d.b[2])<<8 | uint32(d.b[3]))
	d.b = d.b[4:]
	return v
}

func (d *dec) i64() int64 {
	hi := d.i32()
	lo := d.i32()
	return int64(hi)<<32 | int64(uint32(lo))
}

func (d *dec) str() string {
	n := d.i32()
	if d.err != nil || n < 0 {
		return ""
	}
	if int(n) > len(d.b) {
		d.err = errShort
		return ""
	}
	s := string(d.b[:n])
	d.b = d.b[n:]
	return s
}

func writeFrame(nc net.Conn, msg []byte) error {
	var w enc
	w.buf(msg)
	_, err := nc.Write(w.b.Bytes())
	return err
}

func readFrame(nc net.Conn) ([]byte, error) {
	var hdr [4]byte
	if _, err := io.ReadFull(nc, hdr[:]); err != nil {
		return nil, err
	}
	n := int(uint32(hdr[0])<<24 | uint32(hdr[1])<<16 | uint32(hdr[2])<<8 | uint32(hdr[3]))
	if n < 0 || n > 16<<20 {
		return nil, fmt.Errorf("zk: frame of %d bytes", n)
	}
	b := make([]byte, n)
	_, err := io.ReadFull(nc, b)
	return b, err
}
