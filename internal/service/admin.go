package service

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"sort"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	dto "github.com/prometheus/client_model/go"

	"github.com/fenceproxy/fenceproxy/internal/admin"
	"github.com/fenceproxy/fenceproxy/internal/rules"
)

// statusRefresh is how often the status page at / reloads itself.
const statusRefresh = 2 * time.Second

// adminOptions wires the admin endpoints to the instance.
func (in *Instance) adminOptions() admin.Options {
	in.mu.Lock()
	pprof := in.cfg.Admin.Pprof
	in.mu.Unlock()
	return admin.Options{
		Registry: in.metrics.Registry,
		Ready:    in.ready,
		Sessions: in.srv.Sessions,
		Rules:    in.rulesInForce,
		Status:   newStatusSource(in).status,
		Pprof:    pprof,
	}
}

// rulesInForce describes the running rules for /rules, with the defaults
// filled in as rules.Compile fills them.
func (in *Instance) rulesInForce() admin.Rules {
	in.mu.Lock()
	cfg, sum, at := in.cfg, in.cfgSHA256, in.loadedAt
	in.mu.Unlock()
	r := admin.Rules{
		ConfigFile: in.path, ConfigSHA256: sum, LoadedAt: at,
		TokenSetting: orDefault(cfg.TokenSetting, rules.DefaultTokenSetting),
		Tables:       make([]admin.Table, 0, len(cfg.Tables)),
	}
	for _, t := range cfg.Tables {
		r.Tables = append(r.Tables, admin.Table{
			Table:        t.Table,
			Column:       orDefault(t.Column, rules.DefaultColumn),
			Mode:         orDefault(t.Mode, rules.ModeEnforce),
			OnStale:      orDefault(t.OnStale, rules.OnStaleError),
			Strict:       t.Strict,
			MissingToken: orDefault(t.MissingToken, rules.MissingTokenReject),
			Scope:        t.Scope,
		})
	}
	return r
}

func orDefault(v, def string) string {
	if v == "" {
		return def
	}
	return v
}

func sha256Hex(data []byte) string {
	sum := sha256.Sum256(data)
	return hex.EncodeToString(sum[:])
}

// statusSource makes the status page's content from the instance: the
// rules and sessions as /rules and /sessions show them, the counts and
// check states from the metrics registry, and the lock watermarks read
// from each checked database's fenceproxy.locks.
type statusSource struct {
	in *Instance

	mu sync.Mutex
	// seen holds, per table or lock, the refusal count the page last saw
	// and when it first saw it rise: the metrics count refusals but do not
	// time them, so the page times them to within a refresh.
	seen map[string]refusalSeen
	// locks caches the watermarks read, for lockCacheFor, so that several
	// open pages cost one read per database.
	locks     []admin.LockStatus
	locksNote string
	locksAt   time.Time
}

type refusalSeen struct {
	count uint64
	at    time.Time
}

const (
	// lockCacheFor is how long watermarks read are reused.
	lockCacheFor = time.Second
	// maxLockDatabases and maxLocksPerDatabase bound the reads of
	// fenceproxy.locks and the page's length (lock names are per resource).
	maxLockDatabases    = 16
	maxLocksPerDatabase = 50
)

func newStatusSource(in *Instance) *statusSource {
	return &statusSource{in: in, seen: map[string]refusalSeen{}}
}

// sample is one series of a gathered metric family.
type sample struct {
	labels map[string]string
	value  float64
}

func gathered(fams []*dto.MetricFamily) map[string][]sample {
	out := map[string][]sample{}
	for _, f := range fams {
		for _, m := range f.GetMetric() {
			s := sample{labels: map[string]string{}}
			for _, l := range m.GetLabel() {
				s.labels[l.GetName()] = l.GetValue()
			}
			switch {
			case m.Counter != nil:
				s.value = m.GetCounter().GetValue()
			case m.Gauge != nil:
				s.value = m.GetGauge().GetValue()
			default:
				continue
			}
			out[f.GetName()] = append(out[f.GetName()], s)
		}
	}
	return out
}

// sum adds the samples of name whose labels include match.
func sum(g map[string][]sample, name string, match map[string]string) uint64 {
	var total float64
	for _, s := range g[name] {
		ok := true
		for k, v := range match {
			if s.labels[k] != v {
				ok = false
				break
			}
		}
		if ok {
			total += s.value
		}
	}
	return uint64(total)
}

// lastRefusal records count for key and returns when it was first seen
// at its current value, if it is not zero.
func (s *statusSource) lastRefusal(key string, count uint64, now time.Time) time.Time {
	prev, ok := s.seen[key]
	if !ok || count != prev.count {
		prev = refusalSeen{count: count, at: now}
		s.seen[key] = prev
	}
	if count == 0 {
		return time.Time{}
	}
	return prev.at
}

func (s *statusSource) status(ctx context.Context) admin.Status {
	in := s.in
	now := time.Now()
	st := admin.Status{Now: now, Refresh: statusRefresh, Rules: in.rulesInForce(), Sessions: in.srv.Sessions()}
	fams, _ := in.metrics.Registry.Gather() // a partial result is still shown
	g := gathered(fams)
	for _, b := range g["fenceproxy_build_info"] {
		st.Version = b.labels["version"]
		if r := b.labels["revision"]; r != "unknown" && len(r) >= 12 {
			st.Version += " (" + r[:12] + ")"
		}
	}

	in.mu.Lock()
	cfg := in.cfg
	in.mu.Unlock()
	specs, _ := rules.Specs(cfg.RulesConfig()) // validated when loaded

	s.mu.Lock()
	defer s.mu.Unlock()
	for _, sp := range specs {
		t := admin.TableStatus{Table: sp.Display, Mode: sp.Mode, Lock: sp.Lock,
			OnStale: orDefault(cfg.Tables[sp.Index].OnStale, rules.OnStaleError)}
		t.Fenced = sum(g, "fenceproxy_table_statements_total", map[string]string{"table": sp.Display, "action": "rewritten"})
		t.Refused = sum(g, "fenceproxy_table_statements_total", map[string]string{"table": sp.Display, "action": "refused"})
		t.Stale = sum(g, "fenceproxy_stale_rejections_total", map[string]string{"table": sp.Display})
		t.MissingToken = sum(g, "fenceproxy_missing_tokens_total", map[string]string{"table": sp.Display})
		rejected := sum(g, "fenceproxy_missing_tokens_total", map[string]string{"table": sp.Display, "outcome": "rejected"})
		t.LastRefusal = s.lastRefusal("table\x00"+sp.Display, t.Refused+t.Stale+rejected, now)
		st.Tables = append(st.Tables, t)
	}

	listeners := map[string]string{}
	for _, a := range g["fenceproxy_audit_listener_up"] {
		listeners[a.labels["database"]] = map[bool]string{true: "up", false: "down"}[a.value == 1]
	}
	var dbs []string
	for _, c := range g["fenceproxy_check_problems"] {
		db := c.labels["database"]
		dbs = append(dbs, db)
		d := admin.DatabaseStatus{Name: db, Checked: c.value >= 0, AuditListener: listeners[db]}
		if r, known := in.checker.Result(db); known {
			for table, ps := range r.Problems {
				for _, p := range ps {
					if table == "" {
						d.Problems = append(d.Problems, p.Description)
					} else {
						d.Problems = append(d.Problems, table+": "+p.Description)
					}
				}
			}
			sort.Strings(d.Problems)
		} else if c.value > 0 {
			d.Problems = []string{fmt.Sprintf("%d problem(s); run fenceproxy check", int(c.value))}
		}
		st.Databases = append(st.Databases, d)
	}
	sort.Slice(st.Databases, func(i, j int) bool { return st.Databases[i].Name < st.Databases[j].Name })
	sort.Strings(dbs)

	st.Locks, st.LocksNote = s.lockStates(ctx, cfg.AuditConnConfig, dbs, now)
	// The refusals the lock registration counted, by lock label.
	refusals := map[string]map[string]uint64{}
	for _, r := range g["fenceproxy_lock_rejections_total"] {
		name := r.labels["lock"]
		if refusals[name] == nil {
			refusals[name] = map[string]uint64{}
		}
		refusals[name][r.labels["reason"]] += uint64(r.value)
	}
	named := map[string]bool{}
	for i := range st.Locks {
		l := &st.Locks[i]
		named[l.Name] = true
		l.Refusals = refusals[l.Name]
	}
	for name, rs := range refusals {
		if !named[name] {
			st.Locks = append(st.Locks, admin.LockStatus{Name: name, Refusals: rs})
		}
	}
	sort.SliceStable(st.Locks, func(i, j int) bool {
		if st.Locks[i].Database != st.Locks[j].Database {
			return st.Locks[i].Database < st.Locks[j].Database
		}
		return st.Locks[i].Name < st.Locks[j].Name
	})
	for i := range st.Locks {
		l := &st.Locks[i]
		var n uint64
		for _, c := range l.Refusals {
			n += c
		}
		l.LastRefusal = s.lastRefusal("lock\x00"+l.Name, n, now)
	}
	return st
}

// lockStates reads the lock watermarks of the databases (at most
// maxLockDatabases, maxLocksPerDatabase locks each, the most recently
// registered), reusing a read younger than lockCacheFor. The note says
// which databases could not be read, by SQLSTATE or a short reason (an
// error's text may name hosts and users; never a password).
func (s *statusSource) lockStates(ctx context.Context, connConfig func(string) (*pgconn.Config, error), dbs []string, now time.Time) ([]admin.LockStatus, string) {
	if now.Sub(s.locksAt) < lockCacheFor {
		return append([]admin.LockStatus(nil), s.locks...), s.locksNote
	}
	var locks []admin.LockStatus
	var notes []string
	if len(dbs) > maxLockDatabases {
		notes = append(notes, fmt.Sprintf("watermarks read in the first %d of %d databases", maxLockDatabases, len(dbs)))
		dbs = dbs[:maxLockDatabases]
	}
	for _, db := range dbs {
		ls, err := readLocks(ctx, connConfig, db)
		if err != nil {
			notes = append(notes, "watermarks of database "+db+" unavailable: "+statusErr(err))
			continue
		}
		locks = append(locks, ls...)
	}
	note := ""
	for i, n := range notes {
		if i > 0 {
			note += "; "
		}
		note += n
	}
	s.locks, s.locksNote, s.locksAt = locks, note, now
	return append([]admin.LockStatus(nil), locks...), note
}

func readLocks(ctx context.Context, connConfig func(string) (*pgconn.Config, error), db string) ([]admin.LockStatus, error) {
	pc, err := connConfig(db)
	if err != nil {
		return nil, err
	}
	cc, err := pgx.ParseConfig("")
	if err != nil {
		return nil, err
	}
	cc.Config = *pc
	cc.RuntimeParams["application_name"] = "fenceproxy-status"
	ctx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	conn, err := pgx.ConnectConfig(ctx, cc)
	if err != nil {
		return nil, err
	}
	defer conn.Close(context.Background())
	rows, err := conn.Query(ctx, "SELECT name, token, registered FROM fenceproxy.locks ORDER BY registered DESC, name LIMIT $1", maxLocksPerDatabase)
	if err != nil {
		return nil, err
	}
	var out []admin.LockStatus
	for rows.Next() {
		l := admin.LockStatus{Database: db}
		if err := rows.Scan(&l.Name, &l.Watermark, &l.Registered); err != nil {
			return nil, err
		}
		out = append(out, l)
	}
	return out, rows.Err()
}

// statusErr describes err for the page without its text, which may carry
// a connection's host and user.
func statusErr(err error) string {
	var pe *pgconn.PgError
	switch {
	case errors.As(err, &pe) && (pe.Code == "42P01" || pe.Code == "3F000"):
		return "no fenceproxy objects (run fenceproxy setup)"
	case errors.As(err, &pe):
		return "SQLSTATE " + pe.Code
	case errors.Is(err, context.DeadlineExceeded):
		return "timed out"
	default:
		return "could not connect"
	}
}
