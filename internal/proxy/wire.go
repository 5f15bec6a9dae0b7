package proxy

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"sync"

	"github.com/jackc/pgx/v5/pgproto3"
)

// Protocol codes carried in the first word of a startup packet.
const (
	codeSSLRequest    = 80877103
	codeGSSENCRequest = 80877104
	codeCancelRequest = 80877102
	protocolMajor3    = 3

	// maxStartupPacket mirrors PostgreSQL's MAX_STARTUP_PACKET_LENGTH
	// (src/include/libpq/pqcomm.h), the most a startup packet may carry
	// after its length word.
	maxStartupPacket = 10000
)

// errMessageTooLarge is returned by msgReader when a length field exceeds
// the configured limit.
var errMessageTooLarge = errors.New("proxy: message too large")

// errBadLength is returned for a length field below the protocol minimum.
var errBadLength = errors.New("proxy: invalid message length")

// msgReader frames protocol messages from a stream. pgproto3's Receive
// decodes every message into a struct; the relay needs to pass most
// messages through untouched, so it frames them here and uses pgproto3 only
// for the few it inspects.
//
// Its buffer adapts to the traffic, so that an idle session holds little
// memory: while messages stream in, it reads into a buffer of size bytes
// from a pool shared by all sessions; once everything buffered has been
// consumed and the last read did not fill the buffer (the peer has paused),
// it gives that buffer back and waits for the next bytes in a small one of
// its own.
type msgReader struct {
	src     io.Reader
	size    int    // the large buffer's size
	max     int    // largest body accepted
	buf     []byte // m.small[:] or the large buffer
	large   *[ioBufferSize]byte
	small   [smallBufferSize]byte
	r, w    int   // buf[r:w] is buffered and unread
	full    bool  // the last read filled all the room it was given
	err     error // from src, returned once the buffered bytes are used
	scratch []byte

	// budget is charged for the buffers of bodies larger than
	// largeBodyBytes; nil: they are not charged (the upstream's reader).
	budget  bodyBudget
	charged int64 // bytes charged for the last large body, until release
}

// largeBodyBytes is the largest body a reader holds without charging its
// budget: what every session may hold at once without harm.
const largeBodyBytes = 64 << 10

// bodyBudget is what a msgReader charges a large body's buffers to
// (a *MessageBudget, or a session's view of one).
type bodyBudget interface {
	// acquire takes n more bytes for a body that holds own already,
	// waiting if need be; past its wait, an error wrapping errNoBudget.
	acquire(n, own int64) error
	// release gives back n bytes.
	release(n int64)
}

// smallBufferSize is what a reader keeps while its peer is idle: enough for
// a short query or a ReadyForQuery.
const smallBufferSize = 2 << 10

// largeBuffers holds the large buffers that readers and relayWriters use
// while data flows.
var largeBuffers = sync.Pool{New: func() any { return new([ioBufferSize]byte) }}

func newMsgReader(r io.Reader, size, max int) *msgReader {
	m := &msgReader{src: r, size: size, max: max}
	m.buf = m.small[:min(size, smallBufferSize)]
	return m
}

func (m *msgReader) isLarge() bool { return len(m.buf) > smallBufferSize || m.large != nil }

// setBuffer moves the unread bytes to the start of b and reads into b from
// now on.
func (m *msgReader) setBuffer(b []byte) {
	m.w = copy(b, m.buf[m.r:m.w])
	m.r = 0
	m.buf = b
}

// peek returns the next n bytes (n <= the buffer's size) without consuming
// them; they are valid until the next read.
func (m *msgReader) peek(n int) ([]byte, error) {
	if err := m.fill(n); err != nil {
		return nil, err
	}
	return m.buf[m.r : m.r+n], nil
}

// unread returns the bytes read and not yet consumed, without reading;
// they are valid until the next call on m.
func (m *msgReader) unread() []byte { return m.buf[m.r:m.w] }

// fill reads until at least need bytes (need <= m.size) are buffered.
func (m *msgReader) fill(need int) error {
	for empty := 0; m.w-m.r < need; {
		if m.err != nil {
			return m.err
		}
		switch {
		case m.r == m.w && m.isLarge() && !m.full:
			// The peer has paused: wait for it with the small buffer.
			m.r, m.w = 0, 0
			if m.large != nil {
				largeBuffers.Put(m.large)
				m.large = nil
			}
			m.buf = m.small[:min(m.size, smallBufferSize)]
			if need <= len(m.buf) {
				break
			}
			fallthrough
		case !m.isLarge() && m.size > len(m.buf) && (need > len(m.buf) || m.full):
			// Data is streaming in, or a message needs more room.
			if m.size == ioBufferSize {
				m.large = largeBuffers.Get().(*[ioBufferSize]byte)
				m.setBuffer(m.large[:])
			} else {
				m.setBuffer(make([]byte, m.size))
			}
		case m.r > 0:
			m.setBuffer(m.buf)
		}
		n, err := m.src.Read(m.buf[m.w:])
		if n < 0 || n > len(m.buf)-m.w {
			return errors.New("proxy: invalid read count")
		}
		m.full = n == len(m.buf)-m.w
		m.w += n
		if err != nil && isTimeout(err) {
			// A deadline is not the end of the stream: the session sets
			// and lifts deadlines (startup, the upstream watch during
			// authentication), and a later read may succeed.
			if m.w-m.r >= need {
				return nil
			}
			return err
		}
		m.err = err
		if n == 0 && err == nil {
			if empty++; empty > 100 {
				m.err = io.ErrNoProgress
			}
		}
	}
	return nil
}

// header reads one message header and returns its type and body length.
func (m *msgReader) header() (byte, int, error) {
	m.release()
	if err := m.fill(5); err != nil {
		if m.w > m.r && errors.Is(err, io.EOF) {
			err = io.ErrUnexpectedEOF
		}
		return 0, 0, err
	}
	h := m.buf[m.r : m.r+5]
	typ := h[0]
	n := int(binary.BigEndian.Uint32(h[1:5]))
	if n < 4 {
		return typ, 0, fmt.Errorf("%w: %d for message type %q", errBadLength, n, typ)
	}
	if n-4 > m.max {
		return typ, n - 4, fmt.Errorf("%w: %d bytes for message type %q (limit %d)", errMessageTooLarge, n-4, typ, m.max)
	}
	m.r += 5
	return typ, n - 4, nil
}

// body reads a whole body of n bytes. The slice is valid until the next
// call on m, and for a body larger than largeBodyBytes until release.
//
// A large body fails with an error wrapping errNoBudget when its budget
// had no room for it in time: then the rest of it has been read and
// dropped, and the slice holds the bytes read before (at least the first
// largeBodyBytes).
func (m *msgReader) body(n int) ([]byte, error) {
	m.release()
	if n <= m.size {
		if err := m.fill(n); err != nil {
			return nil, unexpected(err)
		}
		b := m.buf[m.r : m.r+n : m.r+n]
		m.r += n
		return b, nil
	}
	if n > largeBodyBytes {
		return m.largeBody(n)
	}
	// A length field is only a claim: memory is allocated as the bytes
	// arrive (append grows the slice geometrically), never up front.
	b := m.scratch[:0]
	for len(b) < n {
		if m.r == m.w {
			if err := m.fill(1); err != nil {
				return nil, unexpected(err)
			}
		}
		chunk := min(m.w-m.r, n-len(b))
		b = append(b, m.buf[m.r:m.r+chunk]...)
		m.r += chunk
	}
	m.scratch = nil
	if cap(b) <= largeBodyBytes {
		m.scratch = b[:0]
	}
	return b, nil
}

// largeBody reads a body of n > largeBodyBytes bytes into a buffer of its
// own, charged to m.budget until release. A length field is only a
// claim: the buffer starts at largeBodyBytes and doubles as bytes arrive
// (each size allocated once, exactly, and charged before it is), until an
// eighth of the body has arrived; then it is sized once from the length
// field. So a body costs at most about 1.25 times its size, its
// outgrown buffers included, the budget is charged for at most ten times
// the bytes that arrived, and appending (which grows a large slice by a
// quarter at a time, leaving its old copies behind) never runs.
func (m *msgReader) largeBody(n int) ([]byte, error) {
	b := make([]byte, largeBodyBytes)
	have := 0
	for have < n {
		if have == len(b) {
			size := min(n, 2*len(b))
			if have >= n/8 {
				size = n
			}
			if err := m.charge(int64(size)); err != nil {
				// Keep the start (a Parse's name), drop the rest unheld.
				start := append([]byte(nil), b[:largeBodyBytes]...)
				b = nil
				m.release()
				if serr := m.skip(n - have); serr != nil {
					return nil, serr
				}
				return start, err
			}
			nb := make([]byte, size)
			copy(nb, b[:have])
			// The old buffer stays charged: it is garbage until a
			// collection frees it (MessageBudget.collect).
			b = nb
		}
		if m.r == m.w {
			if err := m.fill(1); err != nil {
				m.release()
				return nil, unexpected(err)
			}
		}
		chunk := copy(b[have:], m.buf[m.r:m.w])
		m.r += chunk
		have += chunk
	}
	return b, nil
}

// charge takes n more bytes from the budget for the current body (a new
// buffer, or what handling it costs), beside what it holds already.
func (m *msgReader) charge(n int64) error {
	if m.budget == nil {
		return nil
	}
	if err := m.budget.acquire(n, m.charged); err != nil {
		return err
	}
	m.charged += n
	return nil
}

// release gives back the budget of the last large body: the caller no
// longer refers to it. body calls it, and the session must once it has
// handled a large body.
func (m *msgReader) release() {
	if m.charged > 0 {
		m.budget.release(m.charged)
		m.charged = 0
	}
}

// writeError is a failed write in copyBody: the side written to failed,
// not the side read from.
type writeError struct{ err error }

func (e *writeError) Error() string { return e.err.Error() }
func (e *writeError) Unwrap() error { return e.err }

// copyBody streams a body of n bytes to w without holding all of it. A
// failed write is returned as a *writeError.
func (m *msgReader) copyBody(w io.Writer, n int) error {
	for n > 0 {
		if m.r == m.w {
			if err := m.fill(1); err != nil {
				return unexpected(err)
			}
		}
		chunk := min(m.w-m.r, n)
		if _, err := w.Write(m.buf[m.r : m.r+chunk]); err != nil {
			return &writeError{err}
		}
		m.r += chunk
		n -= chunk
	}
	return nil
}

// skip discards a body of n bytes.
func (m *msgReader) skip(n int) error {
	for n > 0 {
		if m.r == m.w {
			if err := m.fill(1); err != nil {
				return unexpected(err)
			}
		}
		chunk := min(m.w-m.r, n)
		m.r += chunk
		n -= chunk
	}
	return nil
}

// buffered reports whether more input is already buffered, i.e. whether the
// next header call will not block.
func (m *msgReader) buffered() bool { return m.w > m.r }

// relayWriter buffers the messages of one batch and writes them with as
// few writes as possible, like bufio.Writer, but holds its buffer (from
// largeBuffers) only while a batch is being written: Flush gives it back,
// so an idle session holds none.
type relayWriter struct {
	w     io.Writer
	large *[ioBufferSize]byte
	n     int // bytes buffered in large
	err   error
}

func newRelayWriter(w io.Writer) *relayWriter { return &relayWriter{w: w} }

func (b *relayWriter) Write(p []byte) (int, error) {
	if b.err != nil {
		return 0, b.err
	}
	total := 0
	for len(p) > 0 {
		if b.large == nil {
			if len(p) >= ioBufferSize {
				// Nothing buffered: write a large chunk as it is.
				n, err := b.w.Write(p)
				if err != nil {
					b.err = err
				}
				return total + n, err
			}
			b.large = largeBuffers.Get().(*[ioBufferSize]byte)
		}
		n := copy(b.large[b.n:], p)
		b.n += n
		total += n
		p = p[n:]
		if b.n == len(b.large) {
			if err := b.writeBuffered(); err != nil {
				return total, err
			}
		}
	}
	return total, nil
}

func (b *relayWriter) writeBuffered() error {
	if b.n == 0 {
		return nil
	}
	_, err := b.w.Write(b.large[:b.n])
	b.n = 0
	if err != nil {
		b.err = err
	}
	return err
}

// Flush writes what is buffered and gives the buffer back.
func (b *relayWriter) Flush() error {
	if b.err != nil {
		return b.err
	}
	if b.large == nil {
		return nil
	}
	err := b.writeBuffered()
	largeBuffers.Put(b.large)
	b.large = nil
	return err
}

// flushWriter is where the relay writes messages: a *bufio.Writer during
// startup, a *relayWriter after it.
type flushWriter interface {
	io.Writer
	Flush() error
}

func unexpected(err error) error {
	if errors.Is(err, io.EOF) {
		return io.ErrUnexpectedEOF
	}
	return err
}

// writeHeader writes a message header for a body of n bytes. Into the
// relay's own writer it writes without allocating (it is called for every
// relayed message).
func writeHeader(w io.Writer, typ byte, n int) error {
	if rw, ok := w.(*relayWriter); ok {
		return rw.writeHeader(typ, n)
	}
	h := make([]byte, 5) // startup only: w is a *bufio.Writer
	h[0] = typ
	binary.BigEndian.PutUint32(h[1:], uint32(n+4))
	_, err := w.Write(h)
	return err
}

// writeHeader buffers a message header.
func (b *relayWriter) writeHeader(typ byte, n int) error {
	if b.err != nil {
		return b.err
	}
	if b.large == nil {
		b.large = largeBuffers.Get().(*[ioBufferSize]byte)
	}
	if len(b.large)-b.n < 5 {
		if err := b.writeBuffered(); err != nil {
			return err
		}
	}
	b.large[b.n] = typ
	binary.BigEndian.PutUint32(b.large[b.n+1:b.n+5], uint32(n+4))
	b.n += 5
	if b.n == len(b.large) {
		return b.writeBuffered()
	}
	return nil
}

// writeString buffers s.
func (b *relayWriter) writeString(s string) error {
	for len(s) > 0 {
		if b.err != nil {
			return b.err
		}
		if b.large == nil {
			b.large = largeBuffers.Get().(*[ioBufferSize]byte)
		}
		n := copy(b.large[b.n:], s)
		b.n += n
		s = s[n:]
		if b.n == len(b.large) {
			if err := b.writeBuffered(); err != nil {
				return err
			}
		}
	}
	return nil
}

// writeQuery writes a Query message of sql. Into the relay's own writer
// it writes without allocating (every simple Query the relay rewrites
// goes through it); a text too long for a message is refused as
// pgproto3's encoder refuses it.
func writeQuery(w io.Writer, sql string) error {
	rw, ok := w.(*relayWriter)
	if !ok || len(sql)+1 > maxQueryBody {
		return writeMsg(w, &pgproto3.Query{String: sql})
	}
	if err := rw.writeHeader('Q', len(sql)+1); err != nil {
		return err
	}
	if err := rw.writeString(sql); err != nil {
		return err
	}
	return rw.writeString("\x00")
}

// maxQueryBody is the longest body writeQuery writes itself; a longer
// one goes to pgproto3's encoder, which refuses what PostgreSQL would.
const maxQueryBody = 1 << 29

// writeRaw writes a message given its type and body.
func writeRaw(w io.Writer, typ byte, body []byte) error {
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
func writeMsg(w io.Writer, msg encoder) error {
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
	if n < 8 || n-4 > maxStartupPacket {
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
