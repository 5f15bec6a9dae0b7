package logsink_test

import (
	"fmt"
	"io"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/fenceproxy/fenceproxy/internal/logsink"
	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// TestOrder: every line reaches the output, in order, once Sync returns.
func TestOrder(t *testing.T) {
	var out testutil.SyncBuffer
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

// gateOutput is an output whose first Write blocks until open is closed,
// after telling entered that it started.
type gateOutput struct {
	entered, open chan struct{}
	once          sync.Once
	out           testutil.SyncBuffer
}

func newGateOutput() *gateOutput {
	return &gateOutput{entered: make(chan struct{}), open: make(chan struct{})}
}

func (g *gateOutput) Write(p []byte) (int, error) {
	g.once.Do(func() {
		close(g.entered)
		<-g.open
	})
	return g.out.Write(p)
}

// TestStalledOutput: with the output stalled, writes return at once; past
// the limit lines are dropped whole and counted; when the output takes
// writes again, the kept lines come out in order, followed by the notice.
func TestStalledOutput(t *testing.T) {
	g := newGateOutput()
	w := logsink.New(g, 100)
	defer w.Close()
	notices := make(chan uint64, 4)
	w.OnDropped(func(n uint64) {
		notices <- n
		_, _ = fmt.Fprintf(w, "dropped %d\n", n)
	})
	_, _ = fmt.Fprintf(w, "line %03d\n", 0)
	<-g.entered // the goroutine is writing line 0, and blocked
	done := make(chan struct{})
	go func() {
		defer close(done)
		for i := 1; i < 50; i++ {
			_, _ = fmt.Fprintf(w, "line %03d\n", i)
		}
	}()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("writes blocked on a stalled output")
	}
	// Lines are 9 bytes: 11 queued behind line 0 (99 bytes), 38 dropped.
	if d := w.Dropped(); d != 38 {
		t.Errorf("Dropped() = %d with the output stalled, want 38", d)
	}
	select {
	case n := <-notices:
		t.Fatalf("notice of %d dropped lines while the output was stalled", n)
	default:
	}
	close(g.open)
	select {
	case n := <-notices:
		if n != 38 {
			t.Errorf("notice of %d dropped lines, want 38", n)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("no notice of the dropped lines")
	}
	if err := w.Sync(); err != nil {
		t.Fatal(err)
	}
	var want strings.Builder
	for i := range 12 {
		fmt.Fprintf(&want, "line %03d\n", i)
	}
	// The notice follows the kept lines.
	want.WriteString("dropped 38\n")
	if got := g.out.String(); got != want.String() {
		t.Errorf("output:\n%s\nwant:\n%s", got, want.String())
	}
}

// TestAfterStall: writers that keep writing through a stall and after it
// get whole lines out, each intact (the queue and the batch being written
// never share memory), and the kept and dropped lines add up.
func TestAfterStall(t *testing.T) {
	g := newGateOutput()
	w := logsink.New(g, 4096)
	defer w.Close()
	// Notices take the queue past its limit (into the room kept for them),
	// so that batches of every size are written.
	w.OnDropped(func(n uint64) { _, _ = fmt.Fprintf(w, "dropped %d\n", n) })
	const writers, lines = 4, 3000
	var wg sync.WaitGroup
	for k := range writers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range lines {
				_, _ = fmt.Fprintf(w, "writer %d line %05d %s\n", k, i, strings.Repeat("x", 40))
				if k == 0 && i == lines/3 {
					close(g.open) // the output moves again
				}
			}
		}()
	}
	wg.Wait()
	if err := w.Sync(); err != nil {
		t.Fatal(err)
	}
	got := strings.Split(strings.TrimSuffix(g.out.String(), "\n"), "\n")
	last := make([]int, writers)
	for k := range last {
		last[k] = -1
	}
	kept := 0
	for _, line := range got {
		var k, i int
		var pad string
		if strings.HasPrefix(line, "dropped ") {
			continue
		}
		kept++
		if n, err := fmt.Sscanf(line, "writer %d line %05d %s", &k, &i, &pad); n != 3 || err != nil || pad != strings.Repeat("x", 40) || k < 0 || k >= writers {
			t.Fatalf("torn line %q", line)
		}
		if i <= last[k] {
			t.Fatalf("writer %d: line %d after line %d", k, i, last[k])
		}
		last[k] = i
	}
	if dropped := int(w.Dropped()); kept+dropped != writers*lines {
		t.Errorf("%d lines kept + %d dropped, want %d", kept, dropped, writers*lines)
	}
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
