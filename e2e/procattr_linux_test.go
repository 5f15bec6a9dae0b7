package e2e_test

import "syscall"

// workerProcAttr makes the kernel kill a worker when the test process dies
// (say, at -timeout), so that no worker is left behind, stopped or not.
// Pdeathsig fires when the thread that started the worker exits; Go's
// runtime does not retire threads of goroutines that never locked one.
func workerProcAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}
