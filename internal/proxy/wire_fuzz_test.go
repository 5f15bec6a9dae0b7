package proxy

import (
	"bufio"
	"bytes"
	"errors"
	"io"
	"testing"
)

// FuzzMsgReader feeds arbitrary bytes to the framing code: it must never
// panic, never return a body longer than its limit, and either consume a
// whole message or report an error.
func FuzzMsgReader(f *testing.F) {
	f.Add([]byte{'Q', 0, 0, 0, 9, 's', 'e', 'l', 0})
	f.Add([]byte{'X', 0, 0, 0, 4})
	f.Add([]byte{'P', 0xff, 0xff, 0xff, 0xff})
	f.Add([]byte{'d', 0, 0, 0, 3})
	f.Add([]byte{0, 0, 0, 8, 4, 210, 22, 47})
	f.Fuzz(func(t *testing.T, data []byte) {
		const max = 64
		m := newMsgReader(bytes.NewReader(data), 16, max)
		var out bytes.Buffer
		w := bufio.NewWriter(&out)
		for i := 0; i < 100; i++ {
			typ, n, err := m.header()
			if err != nil {
				if !errors.Is(err, io.EOF) && !errors.Is(err, io.ErrUnexpectedEOF) &&
					!errors.Is(err, errBadLength) && !errors.Is(err, errMessageTooLarge) {
					t.Fatalf("unexpected error %v", err)
				}
				return
			}
			if n > max {
				t.Fatalf("body of %d bytes accepted over the limit %d", n, max)
			}
			if typ%2 == 0 {
				b, err := m.body(n)
				if err != nil {
					return
				}
				if len(b) != n {
					t.Fatalf("body %d bytes, want %d", len(b), n)
				}
			} else if err := m.copyBody(w, n); err != nil {
				return
			}
		}
		// Startup packets: never panic, bounded.
		if pkt, err := readStartupPacket(bytes.NewReader(data)); err == nil && (len(pkt) < 8 || len(pkt) > maxStartupPacket) {
			t.Fatalf("startup packet of %d bytes accepted", len(pkt))
		}
	})
}
