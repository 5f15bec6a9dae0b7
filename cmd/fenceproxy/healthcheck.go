package main

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"time"
)

// healthcheckMain implements `fenceproxy healthcheck`: it asks a running
// proxy's admin listener whether it is ready, for container health checks
// (the slim image has no curl). Exit 0 when /readyz answers 200, 1
// otherwise.
func healthcheckMain(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	c := newCommand("healthcheck", "healthcheck [--url URL] [--timeout D]", stdout, stderr)
	url := c.fs.String("url", "http://127.0.0.1:6438/readyz", "readiness URL of the proxy's admin listener")
	timeout := c.fs.Duration("timeout", 3*time.Second, "how long to wait for the answer")
	if code, ok := c.parse(args); !ok {
		return code
	}
	ctx, cancel := context.WithTimeout(ctx, *timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, *url, nil)
	if err != nil {
		fmt.Fprintf(stderr, "fenceproxy healthcheck: %v\n", err)
		return exitUsage
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		fmt.Fprintf(stderr, "fenceproxy healthcheck: %v\n", err)
		return 1
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		fmt.Fprintf(stderr, "fenceproxy healthcheck: %s answered %s\n", *url, resp.Status)
		return 1
	}
	fmt.Fprintln(stdout, "ready")
	return 0
}
