package proxy

import (
	"strconv"
	"strings"

	"github.com/fenceproxy/fenceproxy/internal/rules"
	"github.com/jackc/pgx/v5/pgproto3"
)

// refusalMarkerPrefix starts the text of every refusal statement.
const refusalMarkerPrefix = "fenceproxy-refusal:"

// refusalSQL registers a refusal and returns a statement that fails in the
// upstream's parser (the cast of an unknown literal is evaluated during
// parse analysis) and executes nothing. The error comes back in the right
// place of the response stream and is replaced by e there.
func (t *tracker) refusalSQL(e *rules.Error) string {
	t.mu.Lock()
	t.nextRef++
	id := t.nextRef
	// Bound the map: refusals are forgotten at each ReadyForQuery, so only
	// a client pipelining thousands of refused statements reaches this.
	if len(t.refusals) < 10000 {
		t.refusals[id] = e
	}
	t.mu.Unlock()
	return "SELECT '" + refusalMarkerPrefix + t.nonce + ":" + strconv.FormatUint(id, 10) + "'::pg_catalog.int8"
}

// takeRefusal returns the refusal whose marker appears in an upstream error.
func (t *tracker) takeRefusal(e *pgproto3.ErrorResponse) *pgproto3.ErrorResponse {
	if e.Code != "22P02" {
		return nil
	}
	i := strings.Index(e.Message, refusalMarkerPrefix+t.nonce+":")
	if i < 0 {
		return nil
	}
	rest := e.Message[i+len(refusalMarkerPrefix)+len(t.nonce)+1:]
	// Only the digits are read: what quotes the value depends on
	// lc_messages (" in English, » « in German, « » in French).
	j := 0
	for j < len(rest) && rest[j] >= '0' && rest[j] <= '9' {
		j++
	}
	if j == 0 {
		return nil
	}
	id, err := strconv.ParseUint(rest[:j], 10, 64)
	if err != nil {
		return nil
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	r := t.refusals[id]
	delete(t.refusals, id)
	if r == nil {
		return nil
	}
	return errorResponse(r)
}

// errorResponse is the ErrorResponse a client gets for a refusal.
func errorResponse(e *rules.Error) *pgproto3.ErrorResponse {
	return &pgproto3.ErrorResponse{
		Severity: "ERROR", SeverityUnlocalized: "ERROR",
		Code: e.Code, Message: e.Message, Detail: e.Detail, Hint: e.Hint,
	}
}

func (s *session) protocolViolation(err error) error {
	s.terminate(fatal("08P01", "fenceproxy: invalid message from client"), "protocol violation")
	return clientErr(err)
}
