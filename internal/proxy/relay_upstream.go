package proxy

import (
	"bytes"
	"errors"
	"io"

	"github.com/jackc/pgx/v5/pgproto3"
	"go.uber.org/zap"
)

// copyUpstreamToClient relays server messages, translating fenceproxy
// errors and tracking ReadyForQuery.
func (s *session) copyUpstreamToClient() error {
	locked := false
	defer func() {
		if locked {
			s.cwMu.Unlock()
		}
	}()
	for {
		if !s.ur.buffered() && locked {
			err := s.cw.Flush()
			s.cwMu.Unlock()
			locked = false
			if err != nil {
				return clientErr(err)
			}
			if s.finishing() {
				return errSessionDone
			}
		}
		typ, n, err := s.ur.header()
		if err != nil {
			if errors.Is(err, io.EOF) {
				if s.finishing() {
					return errSessionDone
				}
				return upstreamErr(io.ErrUnexpectedEOF)
			}
			return upstreamErr(err)
		}
		if !locked {
			s.lockCW()
			locked = true
		}
		if s.ps != nil && (typ == 'E' || isCompletion(typ)) && s.preparedResponse(typ, 0) {
			// The response to a message the proxy injected.
			if err := s.ur.skip(n); err != nil {
				return upstreamErr(err)
			}
			continue
		}
		switch {
		case typ == 'E' && n <= maxServerMessage:
			s.copyInEnded()
			body, err := s.ur.body(n)
			if err != nil {
				return upstreamErr(err)
			}
			if err := s.relayError(body); err != nil {
				return err
			}
		case typ == 'S' && n <= maxServerMessage:
			body, err := s.ur.body(n)
			if err != nil {
				return upstreamErr(err)
			}
			s.parameterStatus(body)
			if err := writeRaw(s.cw, typ, body); err != nil {
				return clientErr(err)
			}
		case typ == 't' && s.ps != nil && n <= maxServerMessage && s.trimsDescription():
			body, err := s.ur.body(n)
			if err != nil {
				return upstreamErr(err)
			}
			if out, ok := trimDescription(body); ok {
				body = out
			} else {
				s.logger().Warn("a statement's parameter description does not end with the token's parameter; relayed as it is")
			}
			if err := writeRaw(s.cw, typ, body); err != nil {
				return clientErr(err)
			}
		case typ == 'G' || typ == 'W':
			s.copyInStarted()
			if err := writeHeader(s.cw, typ, n); err != nil {
				return clientErr(err)
			}
			if err := s.ur.copyBody(s.cw, n); err != nil {
				return blame(err, upstreamErr, clientErr)
			}
		case typ == 'Z':
			body, err := s.ur.body(n)
			if err != nil {
				return upstreamErr(err)
			}
			if err := writeRaw(s.cw, typ, body); err != nil {
				return clientErr(err)
			}
			if s.ps != nil && len(body) == 1 {
				s.preparedResponse(typ, body[0])
			}
			if len(body) == 1 && s.readyForQuery(body[0]) {
				err := s.cw.Flush()
				s.cwMu.Unlock()
				locked = false
				s.terminate(fatal("57P01", "terminating connection due to administrator command"), "shutdown")
				return errors.Join(errSessionDone, clientErr(err))
			}
		default:
			if err := writeHeader(s.cw, typ, n); err != nil {
				return clientErr(err)
			}
			if err := s.ur.copyBody(s.cw, n); err != nil {
				return blame(err, upstreamErr, clientErr)
			}
		}
	}
}

// parameterStatus records the settings that change how the server reads
// SQL text.
func (t *tracker) parameterStatus(body []byte) {
	var ps pgproto3.ParameterStatus
	if ps.Decode(body) != nil {
		return
	}
	switch ps.Name {
	case "standard_conforming_strings":
		t.mu.Lock()
		t.lex.StandardConformingStrings = ps.Value == "on"
		t.forgetOnSetting()
		t.mu.Unlock()
	case "client_encoding":
		t.mu.Lock()
		t.lex.ClientEncoding = ps.Value
		t.forgetOnSetting()
		t.mu.Unlock()
	case "TimeZone", "DateStyle", "IntervalStyle":
		t.mu.Lock()
		t.forgetOnSetting()
		t.mu.Unlock()
	}
}

// trimsDescription is preparedState.trimsDescription, taking t.mu.
func (t *tracker) trimsDescription() bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.ps.trimsDescription()
}

func (t *tracker) finishing() bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.state.finishing
}

// readyForQuery records a ReadyForQuery and reports whether the session
// should now be closed because the proxy is draining.
func (s *session) readyForQuery(status byte) bool {
	idle := false
	defer func() {
		if idle {
			s.pol.Idle(&s.info) // after the unlock below
		}
	}()
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.state.inFlight > 0 {
		s.state.inFlight--
	} else {
		s.state.desync = true
		s.losePreparedTrack()
	}
	// The server is not in copy-in mode when it is ready for a query.
	s.state.copyIn = false
	s.state.txStatus = status
	if s.fence.on {
		s.fence.ready(status)
	}
	if s.state.inFlight == 0 && !s.state.unsynced {
		// Every refused or rewritten statement sent so far has been
		// answered; one pipelined behind this Sync would still be pending
		// otherwise.
		if len(s.refusals) > 0 { // once a refusal was deleted, clear walks the map even when empty
			clear(s.refusals)
		}
		s.state.rewrote = false
		s.fence.mayEnd = false
		s.state.execsSinceIdle = 0
		idle = status == 'I'
	}
	s.idleCond.Broadcast()
	s.wakeIdleLocked()
	if s.state.draining && s.state.idle() && !s.state.finishing {
		s.state.finishing = true
		return true
	}
	return false
}

// relayError forwards an ErrorResponse, replacing it when it is the
// upstream's report of a refusal, or when the policy translates it (the
// error a rewritten statement raised for a stale or missing token).
func (s *session) relayError(body []byte) error {
	// Cheap filter: only errors that mention fenceproxy, or that may point
	// into a rewritten statement, are looked at.
	if !bytes.Contains(body, []byte("fenceproxy")) {
		s.mu.Lock()
		rewrote := s.state.rewrote
		s.mu.Unlock()
		if rewrote {
			return s.relayErrorWithoutPosition(body)
		}
		return clientErr(writeRaw(s.cw, 'E', body))
	}
	var e pgproto3.ErrorResponse
	if err := e.Decode(body); err != nil {
		return clientErr(writeRaw(s.cw, 'E', body))
	}
	if r := s.takeRefusal(&e); r != nil {
		out := *r
		out.Severity, out.SeverityUnlocalized = e.Severity, e.SeverityUnlocalized
		return clientErr(writeMsg(s.cw, &out))
	}
	s.completeStale(&e)
	if !s.srv.opts.Policy.TranslateError(&s.info, &e) {
		return clientErr(writeRaw(s.cw, 'E', body))
	}
	// Positions and context refer to the rewritten SQL, not the client's.
	e.Position, e.InternalPosition, e.InternalQuery, e.Where = 0, 0, "", ""
	s.logger().Info("write fenced", zap.String("sqlstate", e.Code), zap.String("reason", e.Message))
	return clientErr(writeMsg(s.cw, &e))
}

// relayErrorWithoutPosition forwards a server error while a rewritten
// statement is in flight: a position in it would point into the SQL the
// proxy sent, not into the client's, so it is dropped.
func (s *session) relayErrorWithoutPosition(body []byte) error {
	var e pgproto3.ErrorResponse
	if err := e.Decode(body); err != nil || (e.Position == 0 && e.InternalPosition == 0) {
		return clientErr(writeRaw(s.cw, 'E', body))
	}
	e.Position, e.InternalPosition, e.InternalQuery = 0, 0, ""
	return clientErr(writeMsg(s.cw, &e))
}
