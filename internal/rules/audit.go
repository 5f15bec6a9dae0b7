package rules

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
)

// Modes of a table entry (Table.Mode). Enforce and audit fence writes;
// they are also the "m" field of an AuditEvent.
const (
	ModeEnforce = "enforce"
	ModeAudit   = "audit"
	ModeOff     = "off"
)

// Values of Table.OnStale and Table.MissingToken.
const (
	OnStaleError       = "error"
	OnStaleSkip        = "skip"
	MissingTokenReject = "reject"
	MissingTokenAllow  = "allow"
)

// AuditChannel is the notification channel rewritten statements signal with
// pg_notify. PostgreSQL delivers a notification when (and only if) the
// sending transaction commits, to every session of the same database that
// LISTENs on the channel; identical payloads sent in one transaction are
// delivered once.
const AuditChannel = "fenceproxy_audit"

// AuditVersion is the payload format version ("v").
const AuditVersion = 1

// Reasons of an AuditEvent ("r").
const (
	// AuditStale: the write's token was older than the row's watermark
	// (or, with strict: true, not newer); enforce would have failed the
	// statement with FP001 (or skipped the row with on_stale: skip).
	AuditStale = "stale"
	// AuditMissingToken: the write ran without a valid token; enforce with
	// missing_token: reject would have failed it with FP002.
	AuditMissingToken = "missing_token"
	// AuditStaleLock: the session's token was older than its lock's
	// watermark (lock fencing); enforce would have failed the statement
	// with FP001. Sent by the lock registration, with Lock set.
	AuditStaleLock = "stale_lock"
	// AuditMissingLock: a statement on a table with lock: required ran in
	// a session without a lock name; enforce would have failed it with
	// FP002.
	AuditMissingLock = "missing_lock"
)

// AuditEvent is the payload of a notification on AuditChannel, a JSON
// object built by the server (json_build_object) when a rewritten
// statement meets a write that enforce mode rejects, or would reject:
//
//	{"v" : 1, "i" : "proxy-a", "m" : "audit", "r" : "stale", "t" : "public.config", "tok" : "41", "w" : 42}
//
// Anyone who can connect to the database can send a notification on any
// channel, so a listener must treat the fields as untrusted: use Table as a
// metric label only if it is one of the configured tables (Rules.Tables).
type AuditEvent struct {
	// Version is the payload format, AuditVersion.
	Version int `json:"v"`
	// Tag is Config.AuditTag of the proxy that rewrote the statement.
	Tag string `json:"i"`
	// Mode is ModeAudit for a write forwarded in audit mode, or
	// ModeEnforce for a write without a valid token let through by
	// missing_token: allow.
	Mode string `json:"m"`
	// Reason is AuditStale or AuditMissingToken.
	Reason string `json:"r"`
	// Table is the table's display name (schema.table, quoted where
	// needed), or the bare relation name when an unqualified reference
	// matched tables in several schemas that are fenced alike.
	Table string `json:"t"`
	// Token is the first 32 characters of the token setting, or nil when it
	// was not set.
	Token *string `json:"tok"`
	// Watermark is the row's stored fence value for AuditStale (nil if the
	// fence column was NULL), the lock's watermark for AuditStaleLock, nil
	// otherwise.
	Watermark *int64 `json:"w"`
	// Lock is the first 256 bytes of the session's lock name, for the
	// events of the lock registration (nil otherwise). For those, Table
	// lists the statement's lock-fenced tables, joined by ", ".
	Lock *string `json:"l,omitempty"`
}

// ParseAuditEvent decodes and validates a notification payload sent on
// AuditChannel.
func ParseAuditEvent(payload string) (AuditEvent, error) {
	var e AuditEvent
	d := json.NewDecoder(bytes.NewReader([]byte(payload)))
	d.DisallowUnknownFields()
	if err := d.Decode(&e); err != nil {
		return AuditEvent{}, fmt.Errorf("rules: audit payload: %w", err)
	}
	if d.More() {
		return AuditEvent{}, errors.New("rules: audit payload: trailing data")
	}
	switch {
	case e.Version != AuditVersion:
		return AuditEvent{}, fmt.Errorf("rules: audit payload: version %d, want %d", e.Version, AuditVersion)
	case e.Mode != ModeAudit && e.Mode != ModeEnforce:
		return AuditEvent{}, fmt.Errorf("rules: audit payload: unknown mode %q", e.Mode)
	case e.Reason != AuditStale && e.Reason != AuditMissingToken && e.Reason != AuditStaleLock && e.Reason != AuditMissingLock:
		return AuditEvent{}, fmt.Errorf("rules: audit payload: unknown reason %q", e.Reason)
	case e.Table == "":
		return AuditEvent{}, errors.New("rules: audit payload: no table")
	}
	return e, nil
}
