package policy

import (
	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/rules"
)

// FenceSettings implements proxy.Policy: the rules' token and lock
// settings, when rules are in force.
func (p *Policy) FenceSettings() (token, lock string) {
	rs := p.current.Load().rules
	if rs == nil {
		return "", ""
	}
	return rs.TokenSetting(), rs.LockSetting()
}

// SettingOps implements proxy.Policy.
func (p *Policy) SettingOps(sql string) (rules.SettingText, error) {
	rs := p.current.Load().rules
	if rs == nil {
		return rules.SettingText{}, nil
	}
	return rs.SettingOps(sql)
}

// SettingsEverywhere implements proxy.Policy: in a database where
// the guard protects a table, its triggers read the settings for writes
// the proxy cannot see (a function called in a SELECT, a cascade), so
// every statement that may write gets the session's values.
//
// It is asked before statements of unprotected tables too: it reads the
// results the policy keeps (no lock), and the checker's only once they
// expired.
func (p *Policy) SettingsEverywhere(info *proxy.SessionInfo) bool {
	if p.checks == nil {
		return false
	}
	if st, ok := p.dbStateNow(info.Database); ok {
		return st != nil && st.guarded
	}
	r, ok := p.checks.Result(info.Database)
	return ok && r.Guarded
}

// CodeReadsSettings implements proxy.Policy: code of the session's
// database may read the fence settings on the server (a trigger, a
// default, a function the statement calls: dbsetup.Result.SettingsRead),
// or the check has not told yet. Where it does not, a statement whose
// fences carry the token reads no setting, and the session's values need
// not be applied before it.
func (p *Policy) CodeReadsSettings(info *proxy.SessionInfo) bool {
	if p.checks == nil {
		return true
	}
	if st, ok := p.dbStateNow(info.Database); ok {
		return st == nil || st.settingsRead
	}
	r, ok := p.checks.Result(info.Database)
	return !ok || r.SettingsRead
}
