package proxy

import (
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"runtime"
	"testing"
	"time"
)

// TestBodyAllocatesAsBytesArrive sends a header that announces 60 MiB and
// then only a few bytes: the reader must not allocate the announced size.
func TestBodyAllocatesAsBytesArrive(t *testing.T) {
	const announced = 60 << 20
	msg := []byte{'Q', 0, 0, 0, 0}
	binary.BigEndian.PutUint32(msg[1:], announced+4)
	msg = append(msg, bytes.Repeat([]byte{'x'}, 1000)...)
	m := newMsgReader(bytes.NewReader(msg), ioBufferSize, 64<<20)
	_, n, err := m.header()
	if err != nil || n != announced {
		t.Fatalf("header = %d, %v", n, err)
	}
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	if _, err := m.body(n); !errors.Is(err, io.ErrUnexpectedEOF) {
		t.Fatalf("body = %v, want %v", err, io.ErrUnexpectedEOF)
	}
	runtime.ReadMemStats(&after)
	if got := after.TotalAlloc - before.TotalAlloc; got > 1<<20 {
		t.Fatalf("reading 1000 bytes of an announced %d allocated %d bytes", announced, got)
	}
}

// TestReaderReturnsLargeBufferWhenIdle streams a message larger than the
// small buffer, then lets the peer pause: the reader must wait for more
// with its small buffer, not the large one.
func TestReaderReturnsLargeBufferWhenIdle(t *testing.T) {
	a, b := net.Pipe()
	defer a.Close()
	defer b.Close()
	m := newMsgReader(a, ioBufferSize, 1<<20)
	body := bytes.Repeat([]byte{'d'}, 3*ioBufferSize)
	msg := binary.BigEndian.AppendUint32([]byte{'D'}, uint32(len(body)+4))
	msg = append(msg, body...)
	go func() {
		_, _ = b.Write(msg)
		_, _ = b.Write([]byte{'Z', 0, 0, 0, 5, 'I'})
	}()
	if _, n, err := m.header(); err != nil || n != len(body) {
		t.Fatalf("header = %d, %v", n, err)
	}
	if err := m.copyBody(io.Discard, len(body)); err != nil {
		t.Fatal(err)
	}
	if _, n, err := m.header(); err != nil || n != 1 {
		t.Fatalf("header = %d, %v", n, err)
	}
	if _, err := m.body(1); err != nil {
		t.Fatal(err)
	}
	// The next header waits for the peer.
	done := make(chan struct{})
	go func() {
		defer close(done)
		_, _, _ = m.header()
	}()
	_, _ = b.Write([]byte{'Z'}) // part of a header: the reader is now blocked reading
	b.Close()
	<-done
	if m.large != nil || len(m.buf) > smallBufferSize {
		t.Fatalf("reader holds a %d-byte buffer while its peer is idle", len(m.buf))
	}
}

// TestRelayWriterReturnsBufferOnFlush checks that a relayWriter holds no
// buffer between batches and writes what it was given.
func TestRelayWriterReturnsBufferOnFlush(t *testing.T) {
	var out bytes.Buffer
	w := newRelayWriter(&out)
	for i := 0; i < 1000; i++ {
		if err := writeRaw(w, 'D', []byte("row")); err != nil {
			t.Fatal(err)
		}
	}
	if err := w.Flush(); err != nil {
		t.Fatal(err)
	}
	if w.large != nil {
		t.Fatal("buffer kept after Flush")
	}
	if out.Len() != 1000*8 {
		t.Fatalf("wrote %d bytes, want %d", out.Len(), 1000*8)
	}
}

// TestLargeBodyChargesBudget reads a 1 MiB body with a budget: its buffers
// are charged (about 1.25 times the body), given back after release, and a
// body the budget has no room for is skipped with errNoBudget, leaving the
// reader at the next message.
func TestLargeBodyChargesBudget(t *testing.T) {
	const size = 1 << 20
	frame := func(typ byte, n int) []byte {
		msg := []byte{typ, 0, 0, 0, 0}
		binary.BigEndian.PutUint32(msg[1:], uint32(n+4))
		return append(msg, bytes.Repeat([]byte{'x'}, n)...)
	}
	b := NewMessageBudget(2<<20, 50*time.Millisecond)
	m := newMsgReader(bytes.NewReader(append(frame('Q', size), frame('S', 0)...)), ioBufferSize, 64<<20)
	m.budget = b
	if _, n, err := m.header(); err != nil || n != size {
		t.Fatalf("header = %d, %v", n, err)
	}
	body, err := m.body(size)
	if err != nil || len(body) != size {
		t.Fatalf("body = %d bytes, %v", len(body), err)
	}
	held, _ := b.InUse()
	if held < size || held > size+size/2 {
		t.Errorf("a %d-byte body holds %d bytes of the budget", size, held)
	}
	m.release()
	deadline := time.Now().Add(2 * time.Second)
	for held, _ = b.InUse(); held != 0 && time.Now().Before(deadline); held, _ = b.InUse() {
		time.Sleep(time.Millisecond)
	}
	if held != 0 {
		t.Fatalf("budget holds %d bytes after release", held)
	}

	// No room: the budget is taken by someone else.
	if err := b.acquire(2<<20, 0); err != nil {
		t.Fatal(err)
	}
	m = newMsgReader(bytes.NewReader(append(frame('Q', size), frame('S', 0)...)), ioBufferSize, 64<<20)
	m.budget = b
	_, n, _ := m.header()
	start, err := m.body(n)
	if !errors.Is(err, errNoBudget) || len(start) != largeBodyBytes {
		t.Fatalf("body with no room = %d bytes, %v; want the first %d and errNoBudget", len(start), err, largeBodyBytes)
	}
	if typ, n, err := m.header(); err != nil || typ != 'S' || n != 0 {
		t.Fatalf("next header = %q %d %v, want the Sync after the skipped body", typ, n, err)
	}
	b.release(2 << 20)
}
