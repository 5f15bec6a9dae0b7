//go:build !linux

package e2e_test

import "syscall"

// workerProcAttr has no parent-death signal outside Linux; a worker still
// exits when its stdin closes, unless it is stopped at that moment.
func workerProcAttr() *syscall.SysProcAttr { return nil }
