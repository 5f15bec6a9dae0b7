package pgbouncer

import "syscall"

// setParentDeathSignal asks the kernel to kill PgBouncer when the creating
// thread dies (https://go.dev/issue/27505 explains when Go threads exit).
func setParentDeathSignal(attr *syscall.SysProcAttr) {
	attr.Pdeathsig = syscall.SIGKILL
}
