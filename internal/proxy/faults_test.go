package proxy_test

import (
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgproto3"

	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// faultHooks counts sessions, statements and failed accepts.
type faultHooks struct {
	countingHooks
	acceptFailed atomic.Int64
}

func (h *faultHooks) AcceptFailed(error) { h.acceptFailed.Add(1) }

// TestAcceptOutOfFileDescriptors runs the proxy out of file descriptors:
// a flood of connections that never authenticate makes Accept fail with
// EMFILE. The proxy must keep serving the session it has, count the failed
// accepts, and serve new clients once descriptors are free again.
//
// Not parallel: it lowers the descriptor limit of the whole test process.
func TestAcceptOutOfFileDescriptors(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	hooks := &faultHooks{}
	p := startProxy(t, proxy.Options{Hooks: hooks})
	conn := connect(t, superDSN(p))
	selectOne(t, conn)

	var old syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &old); err != nil {
		t.Fatal(err)
	}
	open, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	// A little headroom: the flood below must exhaust it.
	lim := old
	lim.Cur = uint64(len(open) + 48)
	if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil {
		t.Fatal(err)
	}
	restored := false
	restore := func() {
		if !restored {
			restored = true
			if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &old); err != nil {
				t.Errorf("restore RLIMIT_NOFILE: %v", err)
			}
		}
	}
	t.Cleanup(restore)

	// The flood comes from another process, so that the connections use
	// none of this process's descriptors; it raises its own limit again.
	script := fmt.Sprintf(`ulimit -n %d; for i in $(seq 1 200); do exec {fd}<>/dev/tcp/%s/%d || exit 1; done; echo up; exec sleep 600`,
		old.Cur, p.Host(), p.Port())
	flood := exec.Command("bash", "-c", script)
	out, err := flood.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := flood.Start(); err != nil {
		t.Fatal(err)
	}
	stopFlood := func() {
		if flood.Process != nil && flood.ProcessState == nil {
			_ = flood.Process.Kill()
			_ = flood.Wait()
		}
	}
	t.Cleanup(stopFlood)
	var up [3]byte
	if _, err := out.Read(up[:]); err != nil {
		t.Fatalf("flood did not connect: %v", err)
	}

	waitFor(t, "a failed accept to be counted", func() bool { return hooks.acceptFailed.Load() > 0 })
	// The established session is unaffected.
	selectOne(t, conn)

	stopFlood()
	restore()
	// Descriptors come back as the flood's sessions notice their clients
	// are gone; then new clients are served.
	time.Sleep(100 * time.Millisecond)
	conn2 := connect(t, superDSN(p))
	selectOne(t, conn2)
	selectOne(t, conn)
}

// TestVanishedClientStatementCancelled closes a client's socket while its
// statement runs: the proxy must cancel the statement upstream instead of
// leaving the backend to run it to its end.
func TestVanishedClientStatementCancelled(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	t.Parallel()
	p := startProxy(t, proxy.Options{})
	app := "vanish_" + strconv.FormatInt(time.Now().UnixNano(), 36)
	c, fe := rawSession(t, p.Addr(), map[string]string{"application_name": app})
	fe.Send(&pgproto3.Query{String: "SELECT pg_sleep(60)"})
	if err := fe.Flush(); err != nil {
		t.Fatal(err)
	}
	direct := connect(t, cluster.SuperuserDSN("postgres"))
	running := func() int {
		var n int
		err := direct.QueryRow(ctxT(t), `SELECT count(*) FROM pg_stat_activity
			WHERE application_name = $1 AND state = 'active' AND query LIKE 'SELECT pg_sleep%'`, app).Scan(&n)
		if err != nil {
			t.Fatal(err)
		}
		return n
	}
	waitFor(t, "the statement to run", func() bool { return running() == 1 })
	_ = c.Close()
	waitFor(t, "the statement to be cancelled", func() bool { return running() == 0 })
}
