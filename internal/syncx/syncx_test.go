package syncx

import (
	"sync"
	"testing"
	"time"
)

func TestWaitUntilDone(t *testing.T) {
	var mu sync.Mutex
	c := sync.NewCond(&mu)
	ready := false
	go func() {
		time.Sleep(10 * time.Millisecond)
		mu.Lock()
		ready = true
		mu.Unlock()
		c.Broadcast()
	}()
	mu.Lock()
	ok := WaitUntil(c, time.Minute, func() bool { return ready })
	mu.Unlock()
	if !ok || !ready {
		t.Fatalf("WaitUntil = %v with ready %v, want true once ready", ok, ready)
	}
}

func TestWaitUntilTimeout(t *testing.T) {
	var mu sync.Mutex
	c := sync.NewCond(&mu)
	mu.Lock()
	ok := WaitUntil(c, 20*time.Millisecond, func() bool { return false })
	mu.Unlock()
	if ok {
		t.Fatal("WaitUntil = true for a condition that never holds")
	}
}
