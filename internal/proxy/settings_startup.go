package proxy

// The fence settings' defaults: the startup packet, read as the server
// reads it, and the role's and database's settings.

import (
	"strings"

	"github.com/fenceproxy/fenceproxy/internal/rules"
	"github.com/jackc/pgx/v5/pgproto3"
)

// startupFenceValues reads the fence settings from the startup packet's
// parameters as PostgreSQL does: first the options parameter (split as
// pg_split_opts does, then -c name=value and --name=value), then every
// other parameter named like a setting, which wins.
func startupFenceValues(params map[string]string, which func(string) uint8) (v fenceValues, tok, lk bool) {
	set := func(name, val string) {
		switch which(name) {
		case rules.SettingToken:
			v.token, tok = val, true
		case rules.SettingLock:
			v.lock, lk = val, true
		}
	}
	for _, o := range startupOptionSettings(params["options"]) {
		set(o[0], o[1])
	}
	for k, val := range params {
		switch k {
		case "user", "database", "options", "replication", "application_name":
			continue
		}
		set(k, val)
	}
	return v, tok, lk
}

// splitOptions splits libpq's options string as the server's
// pg_split_opts does: white space separates arguments, a backslash makes
// the next byte literal.
func splitOptions(s string) []string {
	var out []string
	i := 0
	for i < len(s) {
		for i < len(s) && isCSpace(s[i]) {
			i++
		}
		if i >= len(s) {
			break
		}
		var b strings.Builder
		escaped := false
		for ; i < len(s); i++ {
			c := s[i]
			if isCSpace(c) && !escaped {
				break
			}
			if !escaped && c == '\\' {
				escaped = true
				continue
			}
			escaped = false
			b.WriteByte(c)
		}
		out = append(out, b.String())
	}
	return out
}

func isCSpace(c byte) bool {
	return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'
}

// startupOptionSettings returns the name=value pairs that the server's
// command-line parsing of options sets (getopt with the postgres
// switches: -c and -- take name=value, in which '-' in the name reads as
// '_').
func startupOptionSettings(options string) [][2]string {
	const withArg = "BcCDdfhkNprStvW-"
	args := splitOptions(options)
	var out [][2]string
	for i := 0; i < len(args); i++ {
		a := args[i]
		if len(a) < 2 || a[0] != '-' {
			break // getopt stops at the first non-option
		}
		if a == "--" {
			break
		}
		for j := 1; j < len(a); j++ {
			c := a[j]
			if !strings.ContainsRune(withArg, rune(c)) {
				continue
			}
			arg := a[j+1:]
			if arg == "" {
				if i+1 >= len(args) {
					return out
				}
				i++
				arg = args[i]
			}
			if c == 'c' || c == '-' {
				if name, val, ok := strings.Cut(arg, "="); ok {
					out = append(out, [2]string{strings.ReplaceAll(name, "-", "_"), val})
				}
			}
			break
		}
	}
	return out
}

// defaultsQuery reads the role's and database's settings (ALTER ROLE …
// SET, ALTER DATABASE … SET) from the catalog, not from the server
// connection's current values, which a transaction pooler may have left
// from another client.
const defaultsQuery = `SELECT s.setdatabase <> 0, s.setrole <> 0, c FROM pg_catalog.pg_db_role_setting s, pg_catalog.unnest(s.setconfig) c ` +
	`WHERE s.setrole IN (0, (SELECT r.oid FROM pg_catalog.pg_roles r WHERE r.rolname = pg_catalog.session_user())) ` +
	`AND s.setdatabase IN (0, (SELECT d.oid FROM pg_catalog.pg_database d WHERE d.datname = pg_catalog.current_database()))`

// readFenceDefaults runs defaultsQuery on the upstream before the relay
// starts (after the startup's ReadyForQuery, which the caller holds back)
// and applies what it finds below the startup packet's values, with
// PostgreSQL's precedence: database and role, role, database, all.
func (s *session) readFenceDefaults() error {
	f := &s.fence
	if err := writeMsg(s.uw, &pgproto3.Query{String: defaultsQuery}); err != nil {
		return upstreamErr(err)
	}
	if err := s.uw.Flush(); err != nil {
		return upstreamErr(err)
	}
	type found struct {
		rank int
		val  string
	}
	var best [2]*found
	for {
		typ, n, err := s.ur.header()
		if err != nil {
			return upstreamErr(err)
		}
		body, err := s.ur.body(n)
		if err != nil {
			return upstreamErr(err)
		}
		switch typ {
		case 'D':
			var row pgproto3.DataRow
			if row.Decode(body) != nil || len(row.Values) != 3 {
				continue
			}
			cols := [3]string{string(row.Values[0]), string(row.Values[1]), string(row.Values[2])}
			rank := 3
			switch {
			case cols[0] == "t" && cols[1] == "t":
				rank = 0
			case cols[1] == "t":
				rank = 1
			case cols[0] == "t":
				rank = 2
			}
			name, val, ok := strings.Cut(cols[2], "=")
			if !ok {
				continue
			}
			w := s.whichSetting(name)
			for k, bit := range []uint8{rules.SettingToken, rules.SettingLock} {
				if w == bit && (best[k] == nil || rank < best[k].rank) {
					best[k] = &found{rank, val}
				}
			}
		case 'Z':
			if best[0] != nil && !f.startupTok {
				f.defaults.token = best[0].val
			}
			if best[1] != nil && !f.startupLk {
				f.defaults.lock = best[1].val
			}
			f.sess, f.pend, f.cur = f.defaults, f.defaults, f.defaults
			return nil
		case 'E':
			// Unknown defaults read as unset: fenced writes are refused
			// for a missing token, never run with a guessed one.
		}
	}
}

func (t *tracker) whichSetting(name string) uint8 {
	switch {
	case strings.EqualFold(name, t.fence.tokenName):
		return rules.SettingToken
	case strings.EqualFold(name, t.fence.lockName):
		return rules.SettingLock
	}
	return 0
}
