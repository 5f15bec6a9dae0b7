package proxy

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"io"

	"github.com/jackc/pgx/v5/pgproto3"
)

// Protocol codes carried in the first word of a startup packet.
const (
	codeSSLRequest    = 80877103
	codeGSSENCRequest = 80877104
	codeCancelRequest = 80877102
	protocolMajor3    = 3

	// maxStartupPacket mirrors PostgreSQL's MAX_STARTUP_PACKET_LENGTH.
	maxStartupPacket = 10000
)

// errMessageTooLarge is returned by msgReader when a length field exceeds
// the configured limit.
var errMessageTooLarge = errors.New("proxy: message too large")

// errBadLength is returned for a length field below the protocol minimum.
var errBadLength = errors.New("proxy: invalid message length")

// msgReader frames protocol messages from a buffered stream. pgproto3's
// Receive decodes every message into a struct; the relay needs to pass most
// messages through untouched, so it frames them here and uses pgproto3 only
// for the few it inspects.
type msgReader struct {
	r       *bufio.Reader
	max     int    // largest body accepted
	scratch []byte // for bodies larger than the bufio buffer
}

func newMsgReader(r io.Reader, size, max int) *msgReader {
	return &msgReader{r: bufio.NewReaderSize(r, size), max: max}
}

// header reads one message header and returns its type and body length.
func (m *msgReader) header() (byte, int, error) {
	h, err := m.r.Peek(5)
	if err != nil {
		if len(h) > 0 && errors.Is(err, io.EOF) {
			err = io.ErrUnexpectedEOF
		}
		return 0, 0, err
	}
	typ := h[0]
	n := int(binary.BigEndian.Uint32(h[1:5]))
	if n < 4 {
		return typ, 0, fmt.Errorf("%w: %d for message type %q", errBadLength, n, typ)
	}
	if n-4 > m.max {
		return typ, n - 4, fmt.Errorf("%w: %d bytes for message type %q (limit %d)", errMessageTooLarge, n-4, typ, m.max)
	}
	_, _ = m.r.Discard(5)
	return typ, n - 4, nil
}

// body reads a whole body of n bytes. The slice is valid until the next
// call on m.
func (m *msgReader) body(n int) ([]byte, error) {
	if n <= m.r.Size() {
		b, err := m.r.Peek(n)
		if err != nil {
			return nil, unexpected(err)
		}
		_, _ = m.r.Discard(n)
		return b, nil
	}
	if cap(m.scratch) < n {
		m.scratch = make([]byte, n)
	}
	b := m.scratch[:n]
	if _, err := io.ReadFull(m.r, b); err != nil {
		return nil, unexpected(err)
	}
	// Do not keep a large buffer around for the rest of the session.
	if n > 64<<10 {
		m.scratch = nil
	}
	return b, nil
}

// writeError is a failed write in copyBody: the side written to failed,
// not the side read from.
type writeError struct{ err error }

func (e *writeError) Error() string { return e.err.Error() }
func (e *writeError) Unwrap() error { return e.err }

// copyBody streams a body of n bytes to w without holding all of it. A
// failed write is returned as a *writeError.
func (m *msgReader) copyBody(w *bufio.Writer, n int) error {
	for n > 0 {
		chunk := m.r.Buffered()
		if chunk == 0 {
			chunk = 1
		}
		if chunk > n {
			chunk = n
		}
		b, err := m.r.Peek(chunk)
		if err != nil {
			return unexpected(err)
		}
		if _, err := w.Write(b); err != nil {
			return &writeError{err}
		}
		_, _ = m.r.Discard(chunk)
		n -= chunk
	}
	return nil
}

// skip discards a body of n bytes.
func (m *msgReader) skip(n int) error {
	if _, err := m.r.Discard(n); err != nil {
		return unexpected(err)
	}
	return nil
}

// buffered reports whether more input is already buffered, i.e. whether the
// next header call will not block.
func (m *msgReader) buffered() bool { return m.r.Buffered() > 0 }

func unexpected(err error) error {
	if errors.Is(err, io.EOF) {
		return io.ErrUnexpectedEOF
	}
	return err
}

// writeHeader writes a message header for a body of n bytes.
func writeHeader(w *bufio.Writer, typ byte, n int) error {
	var h [5]byte
	h[0] = typ
	binary.BigEndian.PutUint32(h[1:], uint32(n+4))
	_, err := w.Write(h[:])
	return err
}

// writeRaw writes a message given its type and body.
func writeRaw(w *bufio.Writer, typ byte, body []byte) error {
	if err := writeHeader(w, typ, len(body)); err != nil {
		return err
	}
	_, err := w.Write(body)
	return err
}

// encoder is implemented by every pgproto3 message.
type encoder interface {
	Encode(dst []byte) ([]byte, error)
}

// writeMsg encodes a pgproto3 message into w.
func writeMsg(w *bufio.Writer, msg encoder) error {
	buf, err := msg.Encode(nil)
	if err != nil {
		return err
	}
	_, err = w.Write(buf)
	return err
}

// readStartupPacket reads one length-prefixed startup-phase packet (no type
// byte) and returns it whole, length included.
func readStartupPacket(r io.Reader) ([]byte, error) {
	var h [4]byte
	if _, err := io.ReadFull(r, h[:]); err != nil {
		return nil, err
	}
	n := int(binary.BigEndian.Uint32(h[:]))
	if n < 8 || n > maxStartupPacket {
		return nil, fmt.Errorf("%w: startup packet length %d", errBadLength, n)
	}
	pkt := make([]byte, n)
	copy(pkt, h[:])
	if _, err := io.ReadFull(r, pkt[4:]); err != nil {
		return nil, unexpected(err)
	}
	return pkt, nil
}

// startupCode returns the request code (or protocol version) of a packet
// read by readStartupPacket.
func startupCode(pkt []byte) uint32 { return binary.BigEndian.Uint32(pkt[4:8]) }

// fatal builds a FATAL ErrorResponse.
func fatal(code, msg string) *pgproto3.ErrorResponse {
	return &pgproto3.ErrorResponse{Severity: "FATAL", SeverityUnlocalized: "FATAL", Code: code, Message: msg}
}
