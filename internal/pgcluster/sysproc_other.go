//go:build unix && !linux

package pgcluster

import "syscall"

// setParentDeathSignal is a no-op where the kernel has no parent-death signal;
// Stop still cleans up, but a killed parent leaves the server running.
func setParentDeathSignal(*syscall.SysProcAttr, syscall.Signal) {}
