package proxy

import (
	"bufio"
	"encoding/binary"
	"errors"
	"net"
	"testing"

	"bytes"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"
)

type failingWriter struct{}

func (failingWriter) Write([]byte) (int, error) { return 0, errors.New("write: broken pipe") }

// TestClientWriteFailureBlamesClient relays a result row to a client whose
// connection fails: the session must end blaming the client, not the
// upstream it was reading from.
func TestClientWriteFailureBlamesClient(t *testing.T) {
	core, logs := observer.New(zap.InfoLevel)
	srv, err := NewServer(Options{UpstreamAddr: "127.0.0.1:1", Logger: zap.New(core)})
	if err != nil {
		t.Fatal(err)
	}
	client, peer := net.Pipe()
	defer peer.Close()
	s := newSession(srv, client, 1)
	row := []byte{'D', 0, 0, 0, 0}
	row = append(row, bytes.Repeat([]byte{'x'}, 200)...)
	binary.BigEndian.PutUint32(row[1:], uint32(len(row)-1))
	s.ur = newMsgReader(bytes.NewReader(row), 64, 1<<20)
	s.cw = bufio.NewWriterSize(failingWriter{}, 16)
	s.state.relaying = true

	err = s.copyUpstreamToClient()
	if side := sideOf(err); side != "client" {
		t.Fatalf("copyUpstreamToClient = %v, blamed on %q; want the client", err, side)
	}
	s.close(err)
	s.logEnd()
	entries := logs.FilterMessage("session failed").AllUntimed()
	if len(entries) != 1 {
		t.Fatalf("logged %d \"session failed\" lines, want 1", len(entries))
	}
	if side := entries[0].ContextMap()["side"]; side != "client" {
		t.Fatalf("logged side %v, want client", side)
	}
}
