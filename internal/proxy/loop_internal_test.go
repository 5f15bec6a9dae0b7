//go:build linux

package proxy

import (
	"sync/atomic"
	"testing"
	"time"
)

// TestLoopStopWaitsForTasks checks the loop's own rules: stop returns only
// once every task has finished (one sleeping, one waiting for a goroutine
// through await), the tasks ran on the loop's thread, and what is posted
// after the loop stopped is dropped rather than run or blocking.
func TestLoopStopWaitsForTasks(t *testing.T) {
	l, err := newLoop()
	if err != nil {
		t.Fatal(err)
	}
	var slept, awaited, onLoop atomic.Int32
	started := make(chan struct{}, 2)
	l.goTask(func() {
		started <- struct{}{}
		if l.onLoop() {
			onLoop.Add(1)
		}
		l.sleep(50 * time.Millisecond)
		slept.Add(1)
	})
	l.goTask(func() {
		started <- struct{}{}
		var inside bool
		l.await(func() {
			inside = l.onLoop() // in a goroutine of its own: not the loop
			time.Sleep(80 * time.Millisecond)
		})
		if !inside && l.onLoop() {
			awaited.Add(1)
		}
	})
	<-started
	<-started
	begin := time.Now()
	l.stop()
	if d := time.Since(begin); d < 40*time.Millisecond {
		t.Errorf("stop returned after %v, before the tasks could end", d)
	}
	if slept.Load() != 1 || awaited.Load() != 1 || onLoop.Load() != 1 {
		t.Fatalf("after stop: slept %d, awaited %d, on the loop %d; want 1 each", slept.Load(), awaited.Load(), onLoop.Load())
	}
	ran := make(chan struct{}, 1)
	l.post(func() { ran <- struct{}{} })
	select {
	case <-ran:
		t.Fatal("a function posted after stop ran")
	case <-time.After(50 * time.Millisecond):
	}
}
