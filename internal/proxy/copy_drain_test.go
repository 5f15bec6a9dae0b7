package proxy_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgproto3"

	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// TestExtendedCopyInLeavesSessionIdle: COPY FROM STDIN through the
// extended protocol, as libpq's PQexecParams sends it (Parse, Bind,
// Describe, Execute, Sync; then the data, CopyDone, Sync). The server
// ignores the first Sync in copy-in mode, so the proxy must not wait for a
// ReadyForQuery for it: afterwards the session is idle, and a drain closes
// it without waiting for the drain timeout.
func TestExtendedCopyInLeavesSessionIdle(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	table := newTable(t, "id int")
	p := startProxy(t, proxy.Options{})
	_, fe := rawSession(t, p.Addr(), nil)
	fe.Send(&pgproto3.Parse{Query: "COPY " + table + " FROM STDIN"})
	fe.Send(&pgproto3.Bind{})
	fe.Send(&pgproto3.Describe{ObjectType: 'P'})
	fe.Send(&pgproto3.Execute{})
	fe.Send(&pgproto3.Sync{})
	if err := fe.Flush(); err != nil {
		t.Fatal(err)
	}
	for {
		msg, err := fe.Receive()
		if err != nil {
			t.Fatal(err)
		}
		if _, ok := msg.(*pgproto3.CopyInResponse); ok {
			break
		}
		if e, ok := msg.(*pgproto3.ErrorResponse); ok {
			t.Fatalf("COPY: %s", e.Message)
		}
	}
	fe.Send(&pgproto3.CopyData{Data: []byte("1\n2\n")})
	fe.Send(&pgproto3.CopyDone{})
	fe.Send(&pgproto3.Sync{})
	if err := fe.Flush(); err != nil {
		t.Fatal(err)
	}
	for {
		msg, err := fe.Receive()
		if err != nil {
			t.Fatal(err)
		}
		if r, ok := msg.(*pgproto3.ReadyForQuery); ok {
			if r.TxStatus != 'I' {
				t.Fatalf("transaction status %q after COPY", r.TxStatus)
			}
			break
		}
	}
	// The drain timeout is far away: if the session is taken for busy,
	// Shutdown only returns when the context ends.
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if err := p.Server.Shutdown(ctx); err != nil {
		t.Fatal(err)
	}
	if ctx.Err() != nil {
		t.Fatal("the idle session after an extended-protocol COPY was only closed by the drain timeout")
	}
}
