package rediscluster

import "syscall"

// sysProcAttr gives redis-server its own process group, killed if the
// thread that started it dies, so a test binary killed by -timeout takes
// the server along.
func sysProcAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
}
