package logsink_test

import (
	"bytes"
	"fmt"
	"io"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/fenceproxy/fenceproxy/internal/logsink"
)

// syncBuffer is a bytes.Buffer safe for the writer's goroutine and the
// test.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// TestOrder: every line reaches the output, in order, once Sync returns.
func TestOrder(t *testing.T) {
	var out syncBuffer
	w := logsink.New(&out, 0)
	defer w.Close()
	var want strings.Builder
	for i := range 5000 {
		line := fmt.Sprintf("line %d\n", i)
		want.WriteString(line)
		if n, err := w.Write([]byte(line)); n != len(line) || err != nil {
			t.Fatalf("Write = %d, %v", n, err)
		}
	}
	if err := w.Sync(); err != nil {
		t.Fatal(err)
	}
	if got := out.String(); got != want.String() {
		t.Fatalf("output differs: %d bytes, want %d", len(got), want.Len())
	}
	if w.Dropped() != 0 {
		t.Errorf("Dropped() = %d, want 0", w.Dropped())
	}
}

// TestStalledOutput: with the output stalled, writes return at once; past
// the limit lines are dropped whole and counted; when the output takes
// writes again, the kept lines come out in order, followed by the notice.
func TestStalledOutput(t *testing.T) {
	pr, pw := io.Pipe() // nothing reads yet: the first write blocks
	w := logsink.New(pw, 100)
	notices := make(chan uint64, 4)
	w.OnDropped(func(n uint64) {
		notices <- n
		_, _ = fmt.Fprintf(w, "dropped %d\n", n)
	})

	done := make(chan struct{})
	go func() {
		defer close(done)
		// The goroutine takes the first line and blocks writing it; the
		// queue then holds what fits in 100 bytes.
		for i := range 50 {
			_, _ = fmt.Fprintf(w, "line %03d\n", i)
			if i == 0 {
				time.Sleep(50 * time.Millisecond) // let the goroutine take it
			}
		}
	}()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("writes blocked on a stalled output")
	}
	// Lines are 9 bytes: 1 being written, 11 queued (99 bytes), 38 dropped.
	if d := w.Dropped(); d != 38 {
		t.Errorf("Dropped() = %d with the output stalled, want 38", d)
	}

	// Read everything the writer produces until the notice.
	var got strings.Builder
	readDone := make(chan struct{})
	go func() {
		defer close(readDone)
		buf := make([]byte, 4096)
		for !strings.Contains(got.String(), "dropped") {
			n, err := pr.Read(buf)
			got.Write(buf[:n])
			if err != nil {
				return
			}
		}
	}()
	select {
	case n := <-notices:
		if n != 38 {
			t.Errorf("notice of %d dropped lines, want 38", n)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("no notice of the dropped lines")
	}
	<-readDone
	var want strings.Builder
	for i := range 12 {
		fmt.Fprintf(&want, "line %03d\n", i)
	}
	// The notice is queued behind the kept lines, in the room kept for it.
	want.WriteString("dropped 38\n")
	if got.String() != want.String() {
		t.Errorf("output:\n%s\nwant:\n%s", got.String(), want.String())
	}
	_ = pr.Close()
	_ = w.Close()
}

// TestSyncStalled: Sync returns after its timeout when the output is
// stalled, and Close does not hang either.
func TestSyncStalled(t *testing.T) {
	_, pw := io.Pipe()
	w := logsink.New(pw, 0)
	_, _ = w.Write([]byte("stuck\n"))
	start := time.Now()
	if err := w.SyncTimeout(100 * time.Millisecond); err != nil {
		t.Fatal(err)
	}
	if time.Since(start) < 100*time.Millisecond {
		t.Errorf("Sync returned before the output took the line and before its timeout")
	}
	closed := make(chan struct{})
	go func() { _ = w.Close(); close(closed) }()
	select {
	case <-closed:
	case <-time.After(15 * time.Second):
		t.Fatal("Close hung on a stalled output")
	}
	if n, _ := w.Write([]byte("after close\n")); n != len("after close\n") || w.Dropped() != 1 {
		t.Errorf("a write after Close: n=%d, Dropped()=%d; want dropped", n, w.Dropped())
	}
}
