package policy

import (
	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/rules"
)

// lastForward is a session's memory of the last text decide forwarded as
// sent with nothing in front of it, and of what it was decided under: the
// rule set and the database's check results in force (both replaced, never
// changed, when they change: a reload, every check's results), and the
// server's lexing. The same text under the same three is forwarded again
// without being decided again: a session that sends one statement over and
// over (a pooler's health check, a driver's Parse of the unnamed statement
// for each execution) then pays a comparison of the text instead of the
// decision's scans of it.
//
// Only decisions that read nothing else are kept: not those that read the
// catalog stamp or may (a write or DDL where the catalog watch runs),
// judge a migration, record an audit event or need a lock registration or
// a catalog check in front of them (remember).
type lastForward struct {
	set    *ruleSet
	st     *dbChecks
	lex    proxy.Lexing
	text   []byte // the text, copied (the caller's may alias a read buffer)
	tables []string
}

// maxRememberedText bounds the text a session keeps: longer texts are
// decided each time (their decision's cost is charged to the message's
// budget anyway).
const maxRememberedText = 4 << 10

// remembered returns the session's memory, or nil.
func remembered(info *proxy.SessionInfo) *lastForward {
	if info.Memo == nil {
		return nil
	}
	m, _ := info.Memo.V.(*lastForward)
	return m
}

// keptState returns the check results of the session's memory, or nil.
func keptState(info *proxy.SessionInfo) *dbChecks {
	if m := remembered(info); m != nil {
		return m.st
	}
	return nil
}

// recall reports whether sql, under set, st and lex, is the text the
// session last had forwarded as sent, and with which tables.
func recall(info *proxy.SessionInfo, set *ruleSet, st *dbChecks, lex proxy.Lexing, sql string) ([]string, bool) {
	m := remembered(info)
	if m == nil || m.set != set || m.st != st || m.lex != lex || string(m.text) != sql {
		return nil, false
	}
	return m.tables, true
}

// remember keeps d, forwarded as sent, for the session's next decision of
// the same text; it forgets the last one where d may not be kept.
//
// Volatile: the decision depended on more than the three (the running
// migrations judged the text, or it was decided with a stamp read or may
// be: migration, stampCheck.stamped).
func (p *Policy) remember(info *proxy.SessionInfo, set *ruleSet, st *dbChecks, lex proxy.Lexing, sql string, d *rules.Decision, volatile bool) {
	if info.Memo == nil {
		return
	}
	m := remembered(info)
	if volatile || d.Action != rules.Forward || d.Lock != nil || d.AuditRefusal != nil || len(sql) > maxRememberedText {
		if m != nil {
			m.set, m.st = nil, nil
		}
		return
	}
	if m == nil {
		m = new(lastForward)
		info.Memo.V = m
	}
	m.set, m.st, m.lex, m.tables = set, st, lex, d.Tables
	m.text = append(m.text[:0], sql...)
}
