//go:build unix && !linux

package pgbouncer

import "syscall"

func setParentDeathSignal(*syscall.SysProcAttr) {}
