package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"time"

	"github.com/fenceproxy/fenceproxy/demo"
)

func demoMain(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("demo", flag.ContinueOnError)
	fs.SetOutput(stderr)
	listen := fs.String("listen", "127.0.0.1:6432", "proxy address (a free port is used if it is taken)")
	ttl := fs.Duration("ttl", 2*time.Second, "lease TTL of the demo lock")
	exit := fs.Bool("exit", false, "exit after the narration instead of serving until Ctrl-C (non-interactive)")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	_, err := demo.Run(ctx, demo.Options{Out: stdout, Listen: *listen, LeaseTTL: *ttl, Exit: *exit})
	if err != nil {
		fmt.Fprintf(stderr, "fenceproxy demo: %v\n", err)
		return 1
	}
	return 0
}
