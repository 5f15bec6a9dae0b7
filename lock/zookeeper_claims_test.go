package lock_test

import (
	"context"
	"errors"
	"fmt"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/fenceproxy/fenceproxy/internal/testutil"
	"github.com/fenceproxy/fenceproxy/internal/zktest"
)

// Claims of docs/tokens.md's "ZooKeeper and Curator" section, against a
// real ZooKeeper (zookeeperd) started by the test: the lock node's czxid is
// a safe token, the sequential node's suffix is not.

// zkGrant is one grant of the lock recipe: the holder's node, its
// sequence suffix and its czxid (the token the docs recommend).
type zkGrant struct {
	node       string
	suffix     string
	czxid      int64
	createZxid int64 // the zxid in the create reply's header
}

// ensurePath creates p and its ancestors as persistent nodes if missing.
func ensurePath(c *zktest.Conn, p string) error {
	parts := strings.Split(strings.Trim(p, "/"), "/")
	for i := range parts {
		_, _, err := c.Create("/"+strings.Join(parts[:i+1], "/"), nil, zktest.Persistent)
		if err != nil && !errors.Is(err, zktest.ErrNodeExists) {
			return err
		}
	}
	return nil
}

// zkAcquire plays the lock recipe (Curator's InterProcessMutex and
// ZooKeeper's recipe): create an ephemeral sequential child of parent,
// creating parent if missing; hold the lock when that child has the lowest
// sequence. It polls the children instead of watching the predecessor
// (the order of grants is the same).
func zkAcquire(ctx context.Context, c *zktest.Conn, parent string) (zkGrant, error) {
	var g zkGrant
	for {
		node, zxid, err := c.Create(parent+"/lock-", nil, zktest.EphemeralSequential)
		if errors.Is(err, zktest.ErrNoNode) {
			if err := ensurePath(c, parent); err != nil {
				return g, err
			}
			continue
		}
		if err != nil {
			return g, err
		}
		g.node, g.createZxid = node, zxid
		g.suffix = node[len(node)-10:]
		break
	}
	for {
		kids, err := c.Children(parent)
		if err != nil {
			return g, err
		}
		sort.Slice(kids, func(i, j int) bool { return kids[i][len(kids[i])-10:] < kids[j][len(kids[j])-10:] })
		if len(kids) > 0 && parent+"/"+kids[0] == g.node {
			st, err := c.Exists(g.node)
			if err != nil {
				return g, err
			}
			g.czxid = st.Czxid
			return g, nil
		}
		select {
		case <-ctx.Done():
			return g, ctx.Err()
		case <-time.After(2 * time.Millisecond):
		}
	}
}

func zkDial(t *testing.T, s *zktest.Server) *zktest.Conn {
	t.Helper()
	c, err := zktest.Dial(s.Addr())
	if err != nil {
		t.Fatalf("dial ZooKeeper: %v", err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// zkContend runs contenders sessions, each taking the lock rounds times
// (holding it briefly, then deleting its node), and returns the grants in
// the order they were held. It fails the test if two held at once.
func zkContend(t *testing.T, s *zktest.Server, parent string, contenders, rounds int) []zkGrant {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	var (
		mu       sync.Mutex
		grants   []zkGrant
		inFlight atomic.Int32
		wg       sync.WaitGroup
		errs     = make(chan error, contenders)
	)
	for i := 0; i < contenders; i++ {
		c := zkDial(t, s)
		wg.Add(1)
		go func() {
			defer wg.Done()
			for r := 0; r < rounds; r++ {
				g, err := zkAcquire(ctx, c, parent)
				if err != nil {
					errs <- err
					return
				}
				if n := inFlight.Add(1); n != 1 {
					errs <- fmt.Errorf("%d holders at once", n)
				}
				mu.Lock()
				grants = append(grants, g)
				mu.Unlock()
				time.Sleep(time.Millisecond)
				inFlight.Add(-1)
				if err := c.Delete(g.node); err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	return grants
}

// checkIncreasing fails unless each grant's czxid is larger than the one
// before, and equals the zxid of its create.
func checkIncreasing(t *testing.T, what string, grants []zkGrant) {
	t.Helper()
	for i, g := range grants {
		if g.czxid != g.createZxid {
			t.Errorf("%s: %s czxid %#x, but its create's zxid %#x", what, g.node, g.czxid, g.createZxid)
		}
		if i > 0 && g.czxid <= grants[i-1].czxid {
			t.Errorf("%s: grant %d (%s) czxid %#x not above grant %d's %#x", what, i, g.node, g.czxid, i-1, grants[i-1].czxid)
		}
	}
}

// TestZooKeeperCzxidSafeSuffixNot: under contention the holders' czxids
// increase in grant order; deleting and re-creating the lock parent
// restarts the sequence suffix at 0000000000 (the suffix counts the creates
// under the parent: grant i gets i), while czxids keep increasing; zkCli.sh's
// stat shows the same czxid.
func TestZooKeeperCzxidSafeSuffixNot(t *testing.T) {
	testutil.SkipSystem(t, "ZooKeeper (zookeeperd)")
	t.Parallel()
	s := zktest.Start(t)
	const parent = "/locks/report"

	before := zkContend(t, s, parent, 4, 10)
	checkIncreasing(t, "contention", before)
	last := before[len(before)-1]
	t.Logf("contention: %d grants, czxid %#x..%#x, suffixes %s..%s",
		len(before), before[0].czxid, last.czxid, before[0].suffix, last.suffix)

	// The cleanup the docs warn about: the parent goes, a new one comes.
	c := zkDial(t, s)
	if err := c.Delete(parent); err != nil {
		t.Fatalf("delete %s: %v", parent, err)
	}
	var after []zkGrant
	var cversions []int32
	for i := 0; i < 3; i++ {
		g, err := zkAcquire(t.Context(), c, parent)
		if err != nil {
			t.Fatal(err)
		}
		after = append(after, g)
		if err := c.Delete(g.node); err != nil {
			t.Fatal(err)
		}
		st, err := c.Exists(parent)
		if err != nil {
			t.Fatal(err)
		}
		cversions = append(cversions, st.Cversion)
	}
	// The suffix counts the creates under this parent: grant i got i.
	for what, gs := range map[string][]zkGrant{"before": before, "after": after} {
		for i, g := range gs {
			if want := fmt.Sprintf("%010d", i); g.suffix != want {
				t.Errorf("%s the re-creation: grant %d got suffix %s, want %s", what, i, g.suffix, want)
			}
		}
	}
	t.Logf("parent's cversion after each create+delete: %v (the suffixes count creates only)", cversions)
	if after[0].suffix != "0000000000" {
		t.Errorf("first holder after the parent was re-created: suffix %s, the docs say 0000000000", after[0].suffix)
	}
	if after[0].suffix >= last.suffix {
		t.Errorf("suffix after re-creation %s not below the last before it %s: the docs' point is lost", after[0].suffix, last.suffix)
	}
	all := append(append([]zkGrant(nil), before...), after...)
	checkIncreasing(t, "across the parent's re-creation", all)
	t.Logf("after re-creating %s: suffixes %s %s %s (the last before: %s), czxid %#x..%#x (the last before: %#x)",
		parent, after[0].suffix, after[1].suffix, after[2].suffix, last.suffix,
		after[0].czxid, after[len(after)-1].czxid, last.czxid)

	// zkCli.sh's stat on a held node prints the same czxid.
	g, err := zkAcquire(t.Context(), c, parent)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	out, err := zktest.RunCLI(ctx, s.Addr(), "stat", g.node)
	if err != nil {
		t.Fatalf("zkCli.sh stat %s: %v\n%s", g.node, err, out)
	}
	m := regexp.MustCompile(`(?m)^cZxid = 0x([0-9a-f]+)$`).FindStringSubmatch(out)
	if m == nil {
		t.Fatalf("zkCli.sh stat %s: no cZxid line:\n%s", g.node, out)
	}
	cliZxid, err := strconv.ParseInt(m[1], 16, 64)
	if err != nil || cliZxid != g.czxid {
		t.Errorf("zkCli.sh stat %s: cZxid 0x%s, the protocol's Stat %#x", g.node, m[1], g.czxid)
	}
	if g.czxid <= all[len(all)-1].czxid {
		t.Errorf("%s czxid %#x not above the previous grant's %#x", g.node, g.czxid, all[len(all)-1].czxid)
	}
}

// TestZooKeeperCzxidAcrossRestart: a ZooKeeper killed with SIGKILL and
// restarted on its data directory gives later holders larger czxids. A
// standalone server has no leader election: the epoch (the zxid's high 32
// bits) stays 0 and the counter continues from the transaction log.
func TestZooKeeperCzxidAcrossRestart(t *testing.T) {
	testutil.SkipSystem(t, "ZooKeeper (zookeeperd)")
	t.Parallel()
	s := zktest.Start(t)
	const parent = "/locks/nightly"

	grantN := func(n int) []zkGrant {
		c, err := zktest.Dial(s.Addr())
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close() // the session ends before the restart: no ephemeral left
		var gs []zkGrant
		for i := 0; i < n; i++ {
			g, err := zkAcquire(t.Context(), c, parent)
			if err != nil {
				t.Fatal(err)
			}
			gs = append(gs, g)
			if err := c.Delete(g.node); err != nil {
				t.Fatal(err)
			}
		}
		return gs
	}
	before := grantN(5)
	s.Restart()
	after := grantN(5)
	s.Restart()
	again := grantN(5)
	all := append(append(append([]zkGrant(nil), before...), after...), again...)
	checkIncreasing(t, "across restarts", all)
	for _, gs := range [][]zkGrant{before, after, again} {
		t.Logf("czxid %#x..%#x (epoch %d), suffixes %s..%s", gs[0].czxid, gs[len(gs)-1].czxid,
			gs[0].czxid>>32, gs[0].suffix, gs[len(gs)-1].suffix)
	}
}
