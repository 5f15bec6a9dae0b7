// Package syncx holds a bounded wait on a sync.Cond, which the relay (a
// session waiting for the server's answers) and the log output (a Sync
// waiting for the writer goroutine) both need.
package syncx

import (
	"sync"
	"time"
)

// WaitUntil waits on c, whose Locker the caller holds, until done reports
// true or timeout has passed, and reports whether done held. done is
// called with the Locker held; whoever makes it true must Broadcast c.
func WaitUntil(c *sync.Cond, timeout time.Duration, done func() bool) bool {
	expired := false
	t := time.AfterFunc(timeout, func() {
		c.L.Lock()
		expired = true
		c.L.Unlock()
		c.Broadcast()
	})
	defer t.Stop()
	for !done() {
		if expired {
			return false
		}
		c.Wait()
	}
	return true
}
