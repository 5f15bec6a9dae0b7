// Package etcdcluster runs an embedded etcd cluster (one or three members)
// inside the current process, listening on free 127.0.0.1 ports.
//
// It exists for tests (see the etcdtest subpackage) and for the demo command,
// so it must not import "testing". Members run with fsync disabled: the data
// is disposable and the speed matters more than durability.
package etcdcluster

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/server/v3/embed"
	"go.uber.org/zap"
)

// Options configures Start.
type Options struct {
	// Members is the cluster size: 1 or 3. Zero means 1.
	Members int
	// Dir is the parent directory for the members' data directories. Empty
	// means a fresh temporary directory, removed by Close. A caller-supplied
	// Dir is left in place.
	Dir string
	// Logger receives the etcd servers' logs. Nil means no logging.
	Logger *zap.Logger
}

// Cluster is a running embedded etcd cluster. Its methods are safe for
// concurrent use.
type Cluster struct {
	lg      *zap.Logger
	dir     string
	tempDir bool
	token   string

	mu      sync.Mutex
	members []*member
	closed  bool
}

type member struct {
	name      string
	dir       string
	clientURL url.URL
	peerURL   url.URL
	etcd      *embed.Etcd // nil while stopped
}

// startAttempts bounds how often Start picks fresh ports after a bind
// failure: a port found free can be taken by another process before etcd
// binds it.
const startAttempts = 5

// Start launches a cluster and waits until every member is ready to serve
// clients, or until ctx is done.
func Start(ctx context.Context, opts Options) (*Cluster, error) {
	n := opts.Members
	if n == 0 {
		n = 1
	}
	if n != 1 && n != 3 {
		return nil, fmt.Errorf("etcdcluster: members must be 1 or 3, got %d", opts.Members)
	}
	lg := opts.Logger
	if lg == nil {
		lg = zap.NewNop()
	}
	c := &Cluster{lg: lg, dir: opts.Dir}
	if c.dir == "" {
		d, err := os.MkdirTemp("", "etcdcluster-")
		if err != nil {
			return nil, fmt.Errorf("etcdcluster: %w", err)
		}
		c.dir, c.tempDir = d, true
	}

	var err error
	for attempt := 1; attempt <= startAttempts; attempt++ {
		err = c.startAll(ctx, n)
		if err == nil {
			return c, nil
		}
		c.stopAll()
		c.removeMemberDirs()
		if !isAddrInUse(err) || ctx.Err() != nil {
			break
		}
	}
	c.removeTempDir()
	return nil, err
}

// startAll starts n fresh members on newly picked ports.
func (c *Cluster) startAll(ctx context.Context, n int) error {
	ports, err := freePorts(2 * n)
	if err != nil {
		return err
	}
	c.token = fmt.Sprintf("etcdcluster-%d-%d", os.Getpid(), time.Now().UnixNano())
	c.members = make([]*member, n)
	initial := make([]string, n)
	for i := range c.members {
		m := &member{
			name:      fmt.Sprintf("m%d", i),
			dir:       filepath.Join(c.dir, fmt.Sprintf("m%d", i)),
			clientURL: url.URL{Scheme: "http", Host: fmt.Sprintf("127.0.0.1:%d", ports[2*i])},
			peerURL:   url.URL{Scheme: "http", Host: fmt.Sprintf("127.0.0.1:%d", ports[2*i+1])},
		}
		c.members[i] = m
		initial[i] = m.name + "=" + m.peerURL.String()
	}
	cluster := strings.Join(initial, ",")

	// Members of a multi-member cluster only become ready once a quorum is
	// up, so start them all before waiting on any.
	for _, m := range c.members {
		e, err := embed.StartEtcd(c.config(m, cluster))
		if err != nil {
			return fmt.Errorf("etcdcluster: start %s: %w", m.name, err)
		}
		m.etcd = e
	}
	for _, m := range c.members {
		if err := waitReady(ctx, m.etcd, m.name); err != nil {
			return err
		}
	}
	return nil
}

func (c *Cluster) config(m *member, initialCluster string) *embed.Config {
	cfg := embed.NewConfig()
	cfg.Name = m.name
	cfg.Dir = m.dir
	cfg.ListenClientUrls = []url.URL{m.clientURL}
	cfg.AdvertiseClientUrls = []url.URL{m.clientURL}
	cfg.ListenPeerUrls = []url.URL{m.peerURL}
	cfg.AdvertisePeerUrls = []url.URL{m.peerURL}
	cfg.InitialCluster = initialCluster
	cfg.InitialClusterToken = c.token
	cfg.ClusterState = embed.ClusterStateFlagNew
	cfg.EnableGRPCGateway = false
	cfg.UnsafeNoFsync = true
	cfg.ZapLoggerBuilder = embed.NewZapLoggerBuilder(c.lg.Named(m.name))
	return cfg
}

func waitReady(ctx context.Context, e *embed.Etcd, name string) error {
	select {
	case <-e.Server.ReadyNotify():
		return nil
	case err := <-e.Err():
		return fmt.Errorf("etcdcluster: %s failed while starting: %w", name, err)
	case <-ctx.Done():
		return fmt.Errorf("etcdcluster: waiting for %s: %w", name, ctx.Err())
	}
}

// Endpoints returns the client URLs of all members, including stopped ones,
// in member order.
func (c *Cluster) Endpoints() []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	eps := make([]string, len(c.members))
	for i, m := range c.members {
		eps[i] = m.clientURL.String()
	}
	return eps
}

// Dir returns the parent directory of the members' data directories.
func (c *Cluster) Dir() string { return c.dir }

// Client returns a new client connected to all members. The caller closes it.
func (c *Cluster) Client() (*clientv3.Client, error) {
	cli, err := clientv3.New(clientv3.Config{
		Endpoints:   c.Endpoints(),
		DialTimeout: 5 * time.Second,
		Logger:      zap.NewNop(),
	})
	if err != nil {
		return nil, fmt.Errorf("etcdcluster: client: %w", err)
	}
	return cli, nil
}

// StopMember stops member i gracefully: a leader first hands leadership to
// a peer. Its data directory is kept for RestartMember. Stopping a stopped
// member does nothing.
func (c *Cluster) StopMember(i int) { c.stopMember(i, false) }

// KillMember stops member i without coordinating with its peers, as a crash
// would: a leader's followers notice only when its heartbeats stop, after an
// election timeout. Its data directory is kept for RestartMember.
func (c *Cluster) KillMember(i int) { c.stopMember(i, true) }

func (c *Cluster) stopMember(i int, hard bool) {
	c.mu.Lock()
	if i < 0 || i >= len(c.members) || c.members[i].etcd == nil {
		c.mu.Unlock()
		return
	}
	e := c.members[i].etcd
	c.members[i].etcd = nil
	c.mu.Unlock()
	// Closing can take seconds (leadership transfer, draining clients); do
	// not hold the lock meanwhile.
	closeEtcd(e, hard)
}

// closeEtcd closes e. With hard set, the raft loop stops first, which also
// makes Close skip its leadership transfer.
//
// A hard stop first closes the peer listeners: once the storage is closed,
// a peer's /version request would read the storage version from the closed
// backend, panic with the backend's read lock held (net/http recovers the
// panic), and leave every later /version request of the member blocked.
func closeEtcd(e *embed.Etcd, hard bool) {
	if hard {
		for _, p := range e.Peers {
			_ = p.Close()
		}
		e.Server.HardStop()
	}
	e.Close()
}

// RestartMember starts a member stopped by StopMember again, on the same
// ports and data directory, and waits until it is ready.
func (c *Cluster) RestartMember(ctx context.Context, i int) error {
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return errors.New("etcdcluster: cluster closed")
	}
	if i < 0 || i >= len(c.members) {
		c.mu.Unlock()
		return fmt.Errorf("etcdcluster: no member %d", i)
	}
	m := c.members[i]
	if m.etcd != nil {
		c.mu.Unlock()
		return nil
	}
	initial := make([]string, len(c.members))
	for j, o := range c.members {
		initial[j] = o.name + "=" + o.peerURL.String()
	}
	cfg := c.config(m, strings.Join(initial, ","))
	// The ports were released by StopMember and another process may have
	// taken one; the peer URL is fixed in the cluster membership, so all we
	// can do is try again briefly.
	var (
		e   *embed.Etcd
		err error
	)
	for attempt := 1; ; attempt++ {
		e, err = embed.StartEtcd(cfg)
		if err == nil || !isAddrInUse(err) || attempt == startAttempts {
			break
		}
		time.Sleep(200 * time.Millisecond)
		cfg = c.config(m, strings.Join(initial, ","))
	}
	if err != nil {
		c.mu.Unlock()
		return fmt.Errorf("etcdcluster: restart %s: %w", m.name, err)
	}
	m.etcd = e
	c.mu.Unlock()

	if err := waitReady(ctx, e, m.name); err != nil {
		c.StopMember(i)
		return err
	}
	return nil
}

// LeaderIndex returns the index of the member that currently leads, waiting
// for an election to finish if there is no leader, until ctx is done.
func (c *Cluster) LeaderIndex(ctx context.Context) (int, error) {
	t := time.NewTicker(20 * time.Millisecond)
	defer t.Stop()
	for {
		if i := c.leaderIndex(); i >= 0 {
			return i, nil
		}
		select {
		case <-t.C:
		case <-ctx.Done():
			return -1, fmt.Errorf("etcdcluster: no leader: %w", ctx.Err())
		}
	}
}

func (c *Cluster) leaderIndex() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	for i, m := range c.members {
		if m.etcd == nil {
			continue
		}
		if s := m.etcd.Server; s.Leader() != 0 && s.Leader() == s.MemberID() {
			return i
		}
	}
	return -1
}

// Close stops all members and removes the data directory if Start created
// it. It is safe to call more than once.
func (c *Cluster) Close() {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return
	}
	c.closed = true
	c.stopAll()
	c.removeTempDir()
}

// stopAll stops every running member at once, without leadership
// transfers: while all members go down a transfer can only time out.
func (c *Cluster) stopAll() {
	var wg sync.WaitGroup
	for _, m := range c.members {
		if m.etcd == nil {
			continue
		}
		wg.Add(1)
		go func(e *embed.Etcd) {
			defer wg.Done()
			closeEtcd(e, true)
		}(m.etcd)
		m.etcd = nil
	}
	wg.Wait()
}

func (c *Cluster) removeMemberDirs() {
	for _, m := range c.members {
		os.RemoveAll(m.dir)
	}
}

func (c *Cluster) removeTempDir() {
	if c.tempDir {
		os.RemoveAll(c.dir)
	}
}

// freePorts returns n distinct ports that were free a moment ago. Holding
// all listeners until every port is chosen keeps them distinct.
func freePorts(n int) ([]int, error) {
	ls := make([]net.Listener, 0, n)
	defer func() {
		for _, l := range ls {
			l.Close()
		}
	}()
	ports := make([]int, 0, n)
	for range n {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, fmt.Errorf("etcdcluster: pick port: %w", err)
		}
		ls = append(ls, l)
		ports = append(ports, l.Addr().(*net.TCPAddr).Port)
	}
	return ports, nil
}

func isAddrInUse(err error) bool {
	// embed wraps listener errors with %v in places, so match the text too.
	return err != nil && strings.Contains(err.Error(), "address already in use")
}
