package admin

import (
	"context"
	"html/template"
	"net/http"
	"time"

	"github.com/fenceproxy/fenceproxy/internal/proxy"
)

// Status is what the status page at / shows: the rules in force, the
// sessions, each database's check and the locks seen. It holds nothing
// secret: no session's token, no connection string, no password.
type Status struct {
	// Now is when the page was made.
	Now time.Time
	// Version is the build's version.
	Version string
	// Refresh is how often the page reloads itself.
	Refresh time.Duration
	Rules   Rules
	// Tables has a row per entry of Rules.Tables, with its counts.
	Tables    []TableStatus
	Sessions  []proxy.SessionSnapshot
	Databases []DatabaseStatus
	Locks     []LockStatus
	// LocksNote says why locks may be missing ("" when none are).
	LocksNote string
}

// TableStatus is one protected table's line on the status page: its rule
// and what the proxy did to statements on it since it started.
type TableStatus struct {
	Table   string // display form, as the metrics name it
	Mode    string
	Lock    string
	OnStale string
	// Fenced and Refused count the statements on the table the proxy
	// rewrote and refused itself; Stale the writes PostgreSQL refused for
	// a stale token; MissingToken the writes without a valid token
	// (refused or let through, as missing_token says).
	Fenced, Refused, Stale, MissingToken uint64
	// LastRefusal is when the status page first saw one of the refusal
	// counts rise: the refusal happened at most one refresh before it.
	// Zero: none seen.
	LastRefusal time.Time
}

// DatabaseStatus is the state of the proxy's check of one database.
type DatabaseStatus struct {
	Name string
	// Checked: the last check ran; Problems is then what it found.
	Checked  bool
	Problems []string
	// AuditListener is "up", "down" or "" (no listener in the database).
	AuditListener string
}

// LockStatus is one lock: its watermark in a database (the highest token
// registered for it, from fenceproxy.locks) and the refusals of stale
// holders the proxy saw.
type LockStatus struct {
	Database   string
	Name       string
	Watermark  int64
	Registered time.Time
	// Refusals counts the statements refused by the lock registration,
	// by reason (stale, missing_lock, missing_token).
	Refusals map[string]uint64
	// LastRefusal: as TableStatus.LastRefusal.
	LastRefusal time.Time
}

// StatusFunc makes the status page's content.
type StatusFunc func(ctx context.Context) Status

// statusHandler serves the status page: server-rendered HTML that
// reloads itself (meta refresh: no script, no external assets).
func statusHandler(f StatusFunc) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		ctx, cancel := context.WithTimeout(r.Context(), 3*time.Second)
		defer cancel()
		st := f(ctx)
		if st.Refresh <= 0 {
			st.Refresh = 2 * time.Second
		}
		w.Header().Set("Content-Type", "text/html; charset=utf-8")
		w.Header().Set("Cache-Control", "no-store")
		// Nothing is loaded from anywhere; the page's own style only.
		w.Header().Set("Content-Security-Policy", "default-src 'none'; style-src 'unsafe-inline'")
		w.Header().Set("X-Content-Type-Options", "nosniff")
		if err := statusPage.Execute(w, st); err != nil {
			// The header is out; all that is left is to stop.
			return
		}
	}
}

var statusPage = template.Must(template.New("status").Funcs(template.FuncMap{
	"secs": func(d time.Duration) int { return int(d.Round(time.Second) / time.Second) },
	"clock": func(t time.Time) string {
		if t.IsZero() {
			return "—"
		}
		return t.Local().Format("15:04:05")
	},
	"stamp": func(t time.Time) string {
		if t.IsZero() {
			return "—"
		}
		return t.Local().Format("2006-01-02 15:04:05")
	},
	"ago": func(now, t time.Time) string {
		if t.IsZero() {
			return ""
		}
		return now.Sub(t).Round(time.Second).String() + " ago"
	},
	"short": func(s string) string {
		if len(s) > 12 {
			return s[:12]
		}
		return s
	},
}).Parse(statusHTML))

const statusHTML = `<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta http-equiv="refresh" content="{{secs .Refresh}}">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>fenceproxy status</title>
<style>
body { font: 14px/1.4 system-ui, sans-serif; margin: 1.5em; color: #222; background: #fafafa; }
h1 { font-size: 1.4em; margin: 0 0 .2em; }
h2 { font-size: 1.1em; margin: 1.4em 0 .4em; border-bottom: 1px solid #ccc; }
.meta { color: #666; }
table { border-collapse: collapse; background: #fff; }
th, td { border: 1px solid #ddd; padding: .25em .6em; text-align: left; vertical-align: top; }
th { background: #eee; }
td.n { text-align: right; font-variant-numeric: tabular-nums; }
.bad { color: #b00; font-weight: bold; }
.ok { color: #070; }
.none { color: #888; }
code { font-size: 90%; }
</style>
</head>
<body>
<h1>fenceproxy</h1>
<div class="meta">version {{.Version}} · page made {{stamp .Now}} · refreshes every {{secs .Refresh}}s</div>

<h2>Rules in force</h2>
<p>From {{if .Rules.ConfigFile}}<code>{{.Rules.ConfigFile}}</code> (sha256 <code>{{short .Rules.ConfigSHA256}}</code>){{else}}the configuration given at start{{end}}, loaded {{stamp .Rules.LoadedAt}}; token setting <code>{{.Rules.TokenSetting}}</code>.</p>
{{if .Tables}}<table id="tables">
<tr><th>table</th><th>mode</th><th>lock</th><th>on stale</th><th>fenced</th><th>refused by the proxy</th><th>stale token</th><th>missing token</th><th>last refusal</th></tr>
{{range .Tables}}<tr data-table="{{.Table}}"><td><code>{{.Table}}</code></td><td>{{.Mode}}</td><td>{{.Lock}}</td><td>{{.OnStale}}</td><td class="n">{{.Fenced}}</td><td class="n">{{.Refused}}</td><td class="n stale{{if .Stale}} bad{{end}}">{{.Stale}}</td><td class="n">{{.MissingToken}}</td><td class="last">{{clock .LastRefusal}} {{ago $.Now .LastRefusal}}</td></tr>
{{end}}</table>{{else}}<p class="none">No protected tables: the proxy relays every statement unchanged.</p>{{end}}

<h2>Databases</h2>
{{if .Databases}}<table id="databases">
<tr><th>database</th><th>check</th><th>problems</th><th>audit listener</th></tr>
{{range .Databases}}<tr data-database="{{.Name}}"><td><code>{{.Name}}</code></td><td>{{if not .Checked}}<span class="bad">could not run</span>{{else if .Problems}}<span class="bad">{{len .Problems}} problem(s)</span>{{else}}<span class="ok">ok</span>{{end}}</td><td>{{range .Problems}}<div>{{.}}</div>{{end}}</td><td>{{if eq .AuditListener "up"}}<span class="ok">up</span>{{else if eq .AuditListener "down"}}<span class="bad">down</span>{{else}}<span class="none">none</span>{{end}}</td></tr>
{{end}}</table>{{else}}<p class="none">No database checked yet: a database is checked when the first session uses it.</p>{{end}}

<h2>Locks</h2>
{{if .Locks}}<table id="locks">
<tr><th>database</th><th>lock</th><th>watermark</th><th>registered</th><th>refusals</th><th>last refusal</th></tr>
{{range .Locks}}<tr data-lock="{{.Name}}"><td><code>{{.Database}}</code></td><td><code>{{.Name}}</code></td><td class="n">{{if .Watermark}}{{.Watermark}}{{else}}—{{end}}</td><td>{{stamp .Registered}}</td><td>{{range $reason, $n := .Refusals}}<div>{{$reason}}: <span class="bad">{{$n}}</span></div>{{else}}<span class="none">none</span>{{end}}</td><td class="last">{{clock .LastRefusal}} {{ago $.Now .LastRefusal}}</td></tr>
{{end}}</table>{{else}}<p class="none">No locks seen.</p>{{end}}
{{if .LocksNote}}<p class="meta">{{.LocksNote}}</p>{{end}}

<h2>Sessions ({{len .Sessions}})</h2>
{{if .Sessions}}<table id="sessions">
<tr><th>id</th><th>client</th><th>since</th><th>state</th><th>user</th><th>database</th><th>application</th><th>fenced</th><th>refused</th></tr>
{{range .Sessions}}<tr><td class="n">{{.ID}}</td><td>{{.RemoteAddr}}</td><td>{{clock .Since}}</td><td>{{.State}}</td><td>{{.User}}</td><td>{{.Database}}</td><td>{{.ApplicationName}}</td><td class="n">{{.StatementsFenced}}</td><td class="n">{{if .StatementsRefused}}<span class="bad">{{.StatementsRefused}}</span>{{else}}0{{end}}</td></tr>
{{end}}</table>{{else}}<p class="none">No client sessions.</p>{{end}}

<p class="meta">JSON: <a href="/sessions">/sessions</a> · <a href="/rules">/rules</a> · <a href="/metrics">/metrics</a> · <a href="/readyz">/readyz</a></p>
</body>
</html>
`
