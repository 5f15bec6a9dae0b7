package main

import (
	"context"
	"fmt"
	"io"
)

// demoMain is replaced by the demo command (issue 5).
func demoMain(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fmt.Fprintln(stderr, "fenceproxy demo: not built yet")
	return 1
}

// rewriteMain is replaced by the rewrite command.
func rewriteMain(args []string, stdin io.Reader, stdout, stderr io.Writer) int {
	fmt.Fprintln(stderr, "fenceproxy rewrite: not built yet")
	return 1
}
