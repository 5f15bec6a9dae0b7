package pgcluster

import "syscall"

// setParentDeathSignal asks the kernel to send sig to the child when the
// creating thread dies, so that a test binary killed by -timeout or a signal
// takes its servers with it. Go threads only exit when a goroutine locked to
// one returns (https://go.dev/issue/27505), which callers here do not do.
func setParentDeathSignal(attr *syscall.SysProcAttr, sig syscall.Signal) {
	attr.Pdeathsig = sig
}
