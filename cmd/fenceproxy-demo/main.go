// Command fenceproxy-demo starts a throwaway PostgreSQL cluster, an
// embedded etcd and fenceproxy in front of PostgreSQL, plays the
// stale-lock-holder timeline step by step, and then keeps serving until
// Ctrl-C. With --redis the locks come from a throwaway redis-server
// (which must be installed) instead of etcd, or with --redis=URL from
// that server. It is a separate command so that the production binary,
// fenceproxy, links neither the embedded etcd server nor the throwaway
// cluster code. See README.md, "Quick start".
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/fenceproxy/fenceproxy/internal/demo"
)

func main() {
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

func run(args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("fenceproxy-demo", flag.ContinueOnError)
	fs.SetOutput(stderr)
	listen := fs.String("listen", "127.0.0.1:6432", "proxy address (a free port is used if it is taken)")
	ttl := fs.Duration("ttl", 2*time.Second, "lease TTL of the demo lock")
	exit := fs.Bool("exit", false, "exit after the narration instead of serving until Ctrl-C (non-interactive)")
	var rf redisFlag
	fs.Var(&rf, "redis", "take the locks from Redis instead of etcd: alone, a throwaway redis-server (must be installed); --redis=URL, the server at URL")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	go func() {
		// The first SIGINT/SIGTERM stops the demo and removes what it made;
		// restoring the default action lets a second one end it at once.
		<-ctx.Done()
		stop()
	}()
	if _, err := demo.Run(ctx, demo.Options{Out: stdout, Listen: *listen, LeaseTTL: *ttl, Exit: *exit, Redis: rf.value}); err != nil {
		fmt.Fprintf(stderr, "fenceproxy-demo: %v\n", err)
		return 1
	}
	return 0
}

// redisFlag is --redis: a flag that may stand alone (start a throwaway
// redis-server) or carry a URL.
type redisFlag struct{ value string }

func (f *redisFlag) IsBoolFlag() bool { return true }

func (f *redisFlag) String() string { return f.value }

func (f *redisFlag) Set(s string) error {
	switch s {
	case "true":
		f.value = demo.RedisStart
	case "false":
		f.value = ""
	default:
		if !strings.HasPrefix(s, "redis://") && !strings.HasPrefix(s, "rediss://") {
			return fmt.Errorf("want a redis:// or rediss:// URL, got %q", s)
		}
		f.value = s
	}
	return nil
}
