// Command sessionmem measures what an idle client session costs the proxy:
// it runs a proxy in this process in front of a throwaway PostgreSQL, opens
// -sessions connections from a child process (so that the clients' memory
// is not counted), and prints the proxy process's memory per session while
// the sessions are idle, before and after each fetched a result of
// -result bytes. Run it with:
//
//	go run ./bench/sessionmem -sessions 1000 -result 100000
//
// Figures are after a garbage collection and returning free memory to the
// OS; they vary a little from run to run.
package main

import (
	"bufio"
	"context"
	"errors"
	"flag"
	"fmt"
	"net"
	"os"
	"os/exec"
	"runtime"
	"runtime/debug"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/fenceproxy/fenceproxy/internal/pgcluster"
	"github.com/fenceproxy/fenceproxy/internal/proxy"
)

const childEnv = "FENCEPROXY_SESSIONMEM_PROXY"

func main() {
	sessions := flag.Int("sessions", 1000, "client sessions to open")
	result := flag.Int("result", 100000, "bytes each session fetches")
	flag.Parse()
	var err error
	if addr := os.Getenv(childEnv); addr != "" {
		err = clients(addr, *sessions, *result)
	} else {
		err = run(*sessions, *result)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "sessionmem:", err)
		os.Exit(1)
	}
}

// usage is the proxy process's memory.
type usage struct{ rss, heap, stack uint64 }

func measure() usage {
	runtime.GC()
	debug.FreeOSMemory()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return usage{rss: rss(), heap: ms.HeapInuse, stack: ms.StackInuse}
}

// rss reads VmRSS from /proc/self/status, in bytes (0 if unavailable).
func rss() uint64 {
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		return 0
	}
	for _, line := range strings.Split(string(b), "\n") {
		if f := strings.Fields(line); len(f) >= 2 && f[0] == "VmRSS:" {
			kb, _ := strconv.ParseUint(f[1], 10, 64)
			return kb << 10
		}
	}
	return 0
}

func run(n, result int) error {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cl, err := pgcluster.Start(ctx, pgcluster.Options{Settings: map[string]string{
		"max_connections": strconv.Itoa(n + 50),
	}})
	if err != nil {
		return err
	}
	defer cl.Stop()
	srv, err := proxy.NewServer(proxy.Options{UpstreamAddr: cl.Addr(), MaxConnections: n + 50})
	if err != nil {
		return err
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	go func() { _ = srv.Serve(l) }()
	defer func() {
		sctx, scancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer scancel()
		_ = srv.Shutdown(sctx)
	}()

	base := measure()
	self, err := os.Executable()
	if err != nil {
		return err
	}
	child := exec.Command(self, "-sessions", strconv.Itoa(n), "-result", strconv.Itoa(result))
	child.Env = append(os.Environ(), childEnv+"="+l.Addr().String())
	child.Stderr = os.Stderr
	in, err := child.StdinPipe()
	if err != nil {
		return err
	}
	outPipe, err := child.StdoutPipe()
	if err != nil {
		return err
	}
	if err := child.Start(); err != nil {
		return err
	}
	defer func() { _ = child.Process.Kill(); _ = child.Wait() }()
	out := bufio.NewScanner(outPipe)
	expect := func(want string) error {
		if !out.Scan() {
			return fmt.Errorf("client process ended before %q: %v", want, out.Err())
		}
		if got := out.Text(); got != want {
			return fmt.Errorf("client process said %q, want %q", got, want)
		}
		return nil
	}

	if err := expect("idle"); err != nil {
		return err
	}
	time.Sleep(time.Second)
	fresh := measure()
	fmt.Fprintln(in, "query")
	if err := expect("used"); err != nil {
		return err
	}
	time.Sleep(time.Second)
	used := measure()
	fmt.Fprintln(in, "quit")

	fmt.Printf("%d sessions, each fetched %d bytes; proxy process memory per session:\n", n, result)
	fmt.Printf("%-28s %12s %12s %12s\n", "", "RSS", "heap in use", "stacks")
	row := func(name string, u usage) {
		per := func(a, b uint64) string {
			return fmt.Sprintf("%.1f KiB", (float64(a)-float64(b))/float64(n)/1024)
		}
		fmt.Printf("%-28s %12s %12s %12s\n", name, per(u.rss, base.rss), per(u.heap, base.heap), per(u.stack, base.stack))
	}
	row("idle, before any query", fresh)
	row("idle, after the result", used)
	fmt.Printf("ratio after/before (RSS): %.2f\n", (float64(used.rss)-float64(base.rss))/(float64(fresh.rss)-float64(base.rss)))
	return nil
}

// clients opens n sessions through the proxy at addr, then on command runs
// one query returning result bytes in each.
func clients(addr string, n, result int) error {
	ctx := context.Background()
	conns := make([]*pgconn.PgConn, n)
	var wg sync.WaitGroup
	errs := make(chan error, n)
	sem := make(chan struct{}, 50)
	for i := range conns {
		wg.Add(1)
		go func() {
			defer wg.Done()
			sem <- struct{}{}
			defer func() { <-sem }()
			c, err := pgconn.Connect(ctx, "postgres://postgres@"+addr+"/postgres?sslmode=disable")
			if err != nil {
				errs <- err
				return
			}
			conns[i] = c
		}()
	}
	wg.Wait()
	close(errs)
	if err := <-errs; err != nil {
		return err
	}
	fmt.Println("idle")
	in := bufio.NewScanner(os.Stdin)
	if !in.Scan() || in.Text() != "query" {
		return errors.New("no query command")
	}
	sql := fmt.Sprintf("SELECT repeat('x', %d)", result)
	errs = make(chan error, n)
	for _, c := range conns {
		wg.Add(1)
		go func() {
			defer wg.Done()
			sem <- struct{}{}
			defer func() { <-sem }()
			if _, err := c.Exec(ctx, sql).ReadAll(); err != nil {
				errs <- err
			}
		}()
	}
	wg.Wait()
	close(errs)
	if err := <-errs; err != nil {
		return err
	}
	fmt.Println("used")
	in.Scan()
	for _, c := range conns {
		_ = c.Close(ctx)
	}
	return nil
}
