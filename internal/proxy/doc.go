// Package proxy relays the PostgreSQL wire protocol between clients and one
// upstream server, one upstream connection per client session.
//
// The relay is transparent: startup parameters, authentication exchanges,
// BackendKeyData, notices, notifications and COPY data pass through byte for
// byte. Only the messages that carry SQL text (Query and Parse) are decoded,
// and each is handed to a Policy (policy.go) for a decision: forward unchanged,
// forward rewritten SQL, or refuse. A refusal is delivered by replacing the
// statement with one that fails in the upstream's parser with a per-session
// marker, then translating that error back into the fenceproxy error; so the
// client sees the error in the right place of a pipeline and PostgreSQL's own
// protocol rules (ReadyForQuery after a simple Query, skip-until-Sync in the
// extended protocol, transaction abort) apply unchanged.
//
// Errors the server raises on behalf of a rewritten statement (stale or
// missing fencing tokens) are translated the same way, by Policy.TranslateError.
//
// When the Policy's rules can change (Policy.Generation), the relay also reads
// the names in Bind, Describe, Execute and Close, and keeps for each prepared
// statement and portal the rules generation it was decided under, so that
// none runs under rules that a reload replaced (prepared.go, prepared_relay.go).
//
// Messages are framed by msgReader, which never trusts a length field beyond
// the configured limit, and allocates a large body only as its bytes arrive.
// Its buffer, and the writers', come from a shared pool while data flows and
// go back when the peer pauses, so an idle session holds little memory. Decoding and encoding of the messages that are looked
// at uses the pgproto3 package of pgx; everything else is copied without
// decoding, and writes are buffered and flushed only when the reading side
// has nothing more buffered, so pipelines stay pipelines.
package proxy
