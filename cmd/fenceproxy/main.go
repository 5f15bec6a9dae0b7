// Command fenceproxy is a PostgreSQL wire-protocol proxy that fences writes
// to protected tables with lock tokens. See README.md.
//
// Subcommands:
//
//	fenceproxy serve --config FILE       run the proxy
//	fenceproxy rewrite --config FILE SQL show what the proxy would send for SQL
//	fenceproxy healthcheck               probe a running proxy's /readyz
//	fenceproxy lock KEY -- CMD     run CMD holding an etcd lock (FENCE_TOKEN)
//	fenceproxy setup --config FILE       prepare the databases (objects, fence columns)
//	fenceproxy check --config FILE       report what the databases lack
package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"
)

const usage = `usage: fenceproxy <command> [flags]

commands:
  serve   [--config FILE]    run the proxy with the given config file
  rewrite [--config FILE] [SQL | -]
                             print what the proxy would send for SQL, or why it refuses
  healthcheck [--url URL]    exit 0 if a running proxy's admin /readyz answers 200
  lock    [flags] KEY -- COMMAND [ARGS]
                             run COMMAND holding an etcd lock; FENCE_TOKEN holds the token
  setup   [--config FILE] [--dsn DSN] [--database D]... [--add-columns]
                             install the fenceproxy objects (and fence columns) in the databases
  check   [--config FILE] [--dsn DSN] [--database D]...
                             report what the databases lack, with fixes; exit 1 if anything
  version                    print the version

Run 'fenceproxy <command> --help' for the flags of a command. Every flag can
also be set from the environment: FENCEPROXY_ and its long name in upper
case ("-" as "_"), e.g. FENCEPROXY_CONFIG; the command line wins.
`

// version is set at build time with -ldflags "-X main.version=...".
var version = "dev"

func main() {
	os.Exit(runMain(os.Args[1:], os.Stdin, os.Stdout, os.Stderr))
}

func runMain(args []string, stdin io.Reader, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		fmt.Fprint(stderr, usage)
		return 2
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	go func() {
		// The first SIGINT/SIGTERM starts a graceful stop; restoring the
		// default action lets a second one end the process at once.
		<-ctx.Done()
		stop()
	}()
	switch args[0] {
	case "serve":
		return serveMain(ctx, args[1:], stdout, stderr)
	case "rewrite":
		return rewriteMain(args[1:], stdin, stdout, stderr)
	case "lock":
		return lockMain(ctx, args[1:], stdout, stderr)
	case "setup":
		return setupMain(ctx, args[1:], stdout, stderr)
	case "check":
		return checkMain(ctx, args[1:], stdout, stderr)
	case "demo":
		// The demo links an embedded etcd server and throwaway-cluster code
		// that the production binary leaves out.
		fmt.Fprintln(stderr, "fenceproxy: the demo is its own command: go run ./cmd/fenceproxy-demo")
		return 2
	case "healthcheck":
		return healthcheckMain(ctx, args[1:], stdout, stderr)
	case "version", "--version", "-version":
		fmt.Fprintln(stdout, "fenceproxy", versionString())
		return 0
	case "help", "-h", "--help":
		fmt.Fprint(stdout, usage)
		return 0
	default:
		fmt.Fprintf(stderr, "fenceproxy: unknown command %q\n\n%s", args[0], usage)
		return 2
	}
}
