// Command fenceproxy-demo starts a throwaway PostgreSQL cluster, an
// embedded etcd and fenceproxy in front of PostgreSQL, plays the
// stale-lock-holder timeline step by step, and then keeps serving until
// Ctrl-C. It is a separate command so that the production binary,
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
	if _, err := demo.Run(ctx, demo.Options{Out: stdout, Listen: *listen, LeaseTTL: *ttl, Exit: *exit}); err != nil {
		fmt.Fprintf(stderr, "fenceproxy-demo: %v\n", err)
		return 1
	}
	return 0
}
