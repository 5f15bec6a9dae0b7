// Command rss measures what large client messages cost the proxy's
// process in resident memory: it runs a proxy in this process, with the
// fencing rules of one protected table, in front of a throwaway PostgreSQL;
// a child process (so that the clients' memory is not counted) sends
//
//   - refused: one simple Query of -size bytes that writes to the
//     protected table (over max_check_bytes, so the proxy refuses it),
//   - bind: one Bind whose parameter is -size bytes,
//   - concurrent: -sessions sessions at once, each one simple Query of
//     -size bytes that the proxy forwards,
//   - concurrent-refused: the same with the refused Query, which the
//     proxy also charges its budget for deciding (proxy.decisionCost),
//
// and for each it prints the proxy's RSS before, at the peak and a few
// seconds after (no garbage collection forced: what the proxy gives back
// by itself). Run it with:
//
//	go run ./bench/rss
//
// The peak is the kernel's high-water mark (VmHWM, reset before each case
// through /proc/self/clear_refs), so it is Linux only.
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
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/fenceproxy/fenceproxy/internal/pgcluster"
	"github.com/fenceproxy/fenceproxy/internal/policy"
	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/rules"
)

const childEnv = "FENCEPROXY_RSS_PROXY"

func main() {
	size := flag.Int("size", 60<<20, "bytes in each large message")
	sessions := flag.Int("sessions", 10, "sessions sending a large message at once in the concurrent case")
	settle := flag.Duration("settle", 3*time.Second, "how long to wait after a case before reading the RSS")
	flag.Parse()
	var err error
	if addr := os.Getenv(childEnv); addr != "" {
		err = clients(addr, *size, *sessions)
	} else {
		err = run(*size, *sessions, *settle)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "rss:", err)
		os.Exit(1)
	}
}

// status reads a field (in kB) of /proc/self/status, in bytes.
func status(field string) uint64 {
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		return 0
	}
	for _, line := range strings.Split(string(b), "\n") {
		if f := strings.Fields(line); len(f) >= 2 && f[0] == field+":" {
			kb, _ := strconv.ParseUint(f[1], 10, 64)
			return kb << 10
		}
	}
	return 0
}

// resetPeak resets VmHWM to the current RSS (Linux 4.0 and later).
func resetPeak() error {
	return os.WriteFile("/proc/self/clear_refs", []byte("5"), 0)
}

func mib(b uint64) string { return fmt.Sprintf("%.0f MiB", float64(b)/(1<<20)) }

func run(size, sessions int, settle time.Duration) error {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cl, err := pgcluster.Start(ctx, pgcluster.Options{})
	if err != nil {
		return err
	}
	defer cl.Stop()
	rs, err := rules.Compile(rules.Config{Tables: []rules.Table{{Table: "public.config"}}})
	if err != nil {
		return err
	}
	srv, err := proxy.NewServer(proxy.Options{UpstreamAddr: cl.Addr(), Policy: policy.New(rs, false, policy.Options{})})
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

	self, err := os.Executable()
	if err != nil {
		return err
	}
	child := exec.Command(self, "-size", strconv.Itoa(size), "-sessions", strconv.Itoa(sessions))
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
	if !out.Scan() || out.Text() != "ready" {
		return fmt.Errorf("client process did not start: %q %v", out.Text(), out.Err())
	}

	fmt.Printf("proxy process RSS, messages of %s (%d bytes)\n", mib(uint64(size)), size)
	fmt.Printf("%-44s %10s %10s %10s %14s\n", "case", "before", "peak", "after", "peak-before")
	for _, c := range []struct{ cmd, name string }{
		{"refused", "refused simple Query"},
		{"bind", "Bind with one large parameter"},
		{"concurrent", fmt.Sprintf("%d sessions, one forwarded Query each", sessions)},
		{"concurrent-refused", fmt.Sprintf("%d sessions, one refused Query each", sessions)},
	} {
		time.Sleep(settle)
		before := status("VmRSS")
		if err := resetPeak(); err != nil {
			return fmt.Errorf("reset the peak RSS: %w", err)
		}
		fmt.Fprintln(in, c.cmd)
		if !out.Scan() {
			return fmt.Errorf("client process ended during %s: %v", c.cmd, out.Err())
		}
		if got := out.Text(); !strings.HasPrefix(got, "done") {
			return fmt.Errorf("%s: %s", c.cmd, got)
		}
		peak := status("VmHWM")
		time.Sleep(settle)
		after := status("VmRSS")
		fmt.Printf("%-44s %10s %10s %10s %14s   %s\n", c.name, mib(before), mib(peak), mib(after), mib(peak-before), strings.TrimSpace(strings.TrimPrefix(out.Text(), "done")))
	}
	fmt.Fprintln(in, "quit")
	return nil
}

// clients runs the cases the parent asks for, one per line on stdin, and
// answers "done" and what the server said, or the error.
func clients(addr string, size, sessions int) error {
	ctx := context.Background()
	dsn := "postgres://postgres@" + addr + "/postgres?sslmode=disable"
	connect := func() (*pgconn.PgConn, error) { return pgconn.Connect(ctx, dsn) }
	fmt.Println("ready")
	in := bufio.NewScanner(os.Stdin)
	for in.Scan() {
		var (
			note string
			err  error
		)
		switch in.Text() {
		case "refused":
			note, err = refused(ctx, connect, size)
		case "bind":
			note, err = bind(ctx, connect, size)
		case "concurrent":
			note, err = concurrent(ctx, connect, literal("SELECT length('", "')", size), sessions)
		case "concurrent-refused":
			note, err = concurrent(ctx, connect, refusedSQL(size), sessions)
		case "quit":
			return nil
		default:
			err = fmt.Errorf("unknown command %q", in.Text())
		}
		if err != nil {
			fmt.Println("error:", err)
			continue
		}
		fmt.Println("done", note)
	}
	return in.Err()
}

// literal returns a statement of exactly size bytes: prefix, a string
// literal, suffix.
func literal(prefix, suffix string, size int) string {
	return prefix + strings.Repeat("x", size-len(prefix)-len(suffix)) + suffix
}

// refusedSQL is a write of size bytes to the protected table, over
// max_check_bytes.
func refusedSQL(size int) string {
	return literal("INSERT INTO config VALUES ('", "')", size)
}

func refused(ctx context.Context, connect func() (*pgconn.PgConn, error), size int) (string, error) {
	c, err := connect()
	if err != nil {
		return "", err
	}
	defer c.Close(ctx)
	_, err = c.Exec(ctx, refusedSQL(size)).ReadAll()
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) {
		return "", fmt.Errorf("want a refusal, got %v", err)
	}
	return "(" + pgErr.Code + ")", nil
}

func bind(ctx context.Context, connect func() (*pgconn.PgConn, error), size int) (string, error) {
	c, err := connect()
	if err != nil {
		return "", err
	}
	defer c.Close(ctx)
	res := c.ExecParams(ctx, "SELECT length($1::text)", [][]byte{[]byte(strings.Repeat("b", size))}, nil, nil, nil).Read()
	if res.Err != nil {
		return "", res.Err
	}
	if len(res.Rows) != 1 || string(res.Rows[0][0]) != strconv.Itoa(size) {
		return "", fmt.Errorf("length = %q, want %d", res.Rows, size)
	}
	return "", nil
}

// concurrent sends sql on sessions sessions at once: a SELECT length of
// a literal, answered, or a write the proxy refuses (FP003).
func concurrent(ctx context.Context, connect func() (*pgconn.PgConn, error), sql string, sessions int) (string, error) {
	conns := make([]*pgconn.PgConn, sessions)
	for i := range conns {
		c, err := connect()
		if err != nil {
			return "", err
		}
		defer c.Close(ctx)
		conns[i] = c
	}
	want := strconv.Itoa(len(sql) - len("SELECT length('')"))
	var (
		wg      sync.WaitGroup
		mu      sync.Mutex
		refused int // for want of budget
		fenced  int // FP003
		first   error
	)
	for _, c := range conns {
		wg.Add(1)
		go func() {
			defer wg.Done()
			res, err := c.Exec(ctx, sql).ReadAll()
			mu.Lock()
			defer mu.Unlock()
			var pgErr *pgconn.PgError
			switch {
			case errors.As(err, &pgErr) && pgErr.Code == "53200":
				refused++
			case errors.As(err, &pgErr) && pgErr.Code == rules.CodeRefused:
				fenced++
			case err != nil:
				first = cmp(first, err)
			case len(res) != 1 || len(res[0].Rows) != 1 || string(res[0].Rows[0][0]) != want:
				first = cmp(first, fmt.Errorf("unexpected result %v", res))
			}
		}()
	}
	wg.Wait()
	if first != nil {
		return "", first
	}
	if fenced > 0 {
		return fmt.Sprintf("(%d FP003, %d refused for want of budget)", fenced, refused), nil
	}
	return fmt.Sprintf("(%d answered, %d refused for want of budget)", sessions-refused, refused), nil
}

func cmp(a, b error) error {
	if a != nil {
		return a
	}
	return b
}
