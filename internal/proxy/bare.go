package proxy

import (
	"encoding/binary"
	"unsafe"

	"github.com/fenceproxy/fenceproxy/internal/sqllex"
)

// A Bind without the session's values (docs/design.md, "The session's
// fence settings").
//
// Before a Bind of a statement on a protected table the relay applies the
// session's fence settings transaction-locally, for whatever on the server
// reads them. A statement in the parameter form (tokenparam.go) gets its
// token from the Bind: where nothing else that runs before the next Sync
// reads a setting, the values are left out, as they are before a simple
// Query whose fences carry the token. What the form still reads is the
// token setting for its stale-row error's message (fenceproxy.stale):
// there the server connection's value, which behind a transaction pooler
// may be another client's, so the relay puts the token it bound in its
// place (completeStale).

// bareToken is the token of the Bind that went without the session's
// values, and the segment (sentSeg) of the responses it is for; tok ""
// for none. Guarded by mu.
type bareToken struct {
	seg uint64
	tok string
}

// goesBare reports whether a Bind of portal, of a statement in the
// parameter form that reads no setting but for its stale-row error
// (stmtDef.settingFree), with tok bound, may go without the session's
// values, and if so records tok for its error (completeStale). body is
// the client's Bind. It may where nothing else can read them: no
// database guard, no code of the database that may
// (Policy.CodeReadsSettings), no bound value that may name a setting or
// hold SQL that reads one (a function given the name, query_to_xml given
// a query: the values are read as the text is, sqllex.MayName), and the
// statement alone in its implicit transaction: none is open, nothing was
// sent since the last Sync, and the client's messages already read after
// the Bind are, up to a Sync, only Describes, Flushes and Executes of the
// portal (runsAlone). A value set transaction-locally would last until
// the Sync, where a later statement could read it.
func (r *requests) goesBare(portal, tok string, body []byte) bool {
	pol := r.srv.opts.Policy
	if len(body) == 0 || pol.SettingsEverywhere(&r.info) || pol.CodeReadsSettings(&r.info) ||
		sqllex.MayName(unsafe.String(&body[0], len(body)), r.fence.readWords) || !runsAlone(r.cr.unread(), portal) {
		return false
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if !r.state.idle() || r.state.desync || r.ps == nil || r.ps.sentIdx != 0 || r.ps.lost {
		return false
	}
	r.bare = bareToken{seg: r.ps.sentSeg, tok: tok}
	// What runs is a rewritten form, though nothing of the proxy's may go
	// before it (no catalog check where the watch is not installed): its
	// errors' positions are not the client's (relayError).
	r.state.rewrote = true
	return true
}

// runsAlone reports whether next, client messages read after a Bind of
// portal, hold a Sync, and before it only Describes, Flushes and Executes
// of portal, each complete.
func runsAlone(next []byte, portal string) bool {
	for len(next) >= 5 {
		n := int(binary.BigEndian.Uint32(next[1:5]))
		if n < 4 || n > len(next)-1 {
			return false
		}
		body := next[5 : 1+n]
		switch next[0] {
		case 'S':
			return true
		case 'D', 'H':
		case 'E':
			if name, _, ok := cstringView(body); !ok || name != portal {
				return false
			}
		default:
			return false
		}
		next = next[1+n:]
	}
	return false
}
