package main

import (
	"context"
	"fmt"
	"io"
)

// rewriteMain is replaced by the rewrite command.
func rewriteMain(args []string, stdin io.Reader, stdout, stderr io.Writer) int {
	fmt.Fprintln(stderr, "fenceproxy rewrite: not built yet")
	return 1
}
