//go:build !linux

package main

import (
	"fmt"
	"os"
)

// The prototype relays with epoll: Linux only.
func main() {
	fmt.Fprintln(os.Stderr, "relayproto: Linux only (epoll)")
	os.Exit(2)
}
