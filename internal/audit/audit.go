// Package audit keeps the LISTEN connections on which rewritten statements
// report (rules.AuditChannel) and turns their notifications into log lines
// and metrics; the same connections hear the catalog watch
// (dbsetup.CatalogChannel). It is the proxy's only I/O on behalf of the rules apart from
// the relay itself; the decisions live in package policy.
package audit

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"go.uber.org/zap"

	"github.com/fenceproxy/fenceproxy/internal/dbsetup"
	"github.com/fenceproxy/fenceproxy/internal/metrics"
	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/rules"
)

// Options configure a Listener.
type Options struct {
	// Tag is this instance's rules.Config.AuditTag: events carrying another
	// tag were produced through another proxy instance and are ignored, so
	// that instances sharing a database do not count each other's events.
	Tag string
	// ConnConfig returns the connection settings for listening in a
	// database.
	ConnConfig func(database string) (*pgconn.Config, error)
	// Lookup attributes an event to a session by the notifying backend's
	// process ID.
	Lookup func(pid uint32) (proxy.SessionInfo, bool)
	// KnownTable reports whether a table name may be used as a metric label.
	KnownTable func(table string) bool
	Logger     *zap.Logger
	Metrics    *metrics.Metrics
	// ConnectTimeout bounds the first connection of a listener. Default 5s.
	ConnectTimeout time.Duration
	// CatalogChanged, when set, is called with the database whenever its
	// catalog watch notifies a change (dbsetup.CatalogChannel), and each
	// time a listener connects (changes before went unheard). It must
	// not block.
	CatalogChanged func(database string)
}

// Listener keeps one LISTEN connection on rules.AuditChannel per database
// in which audited statements run (in audit mode, every write enforce mode
// would have rejected; in enforce mode, every write let through without a
// token), and turns notifications into log lines and metrics. PostgreSQL
// delivers a notification only when its transaction commits.
type Listener struct {
	opts   Options
	log    *zap.Logger
	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup

	mu        sync.Mutex
	listeners map[string]*dbListener
}

type dbListener struct {
	ready chan struct{} // closed after the first connection attempt
	up    atomic.Bool   // LISTEN is in force now
}

// maxAuditDatabases bounds the listeners: database names come from clients
// (after they authenticated), so the map must not grow without limit.
const maxAuditDatabases = 256

// New returns a Listener; Close stops its connections.
func New(opts Options) *Listener {
	if opts.ConnectTimeout <= 0 {
		opts.ConnectTimeout = 5 * time.Second
	}
	log := opts.Logger
	if log == nil {
		log = zap.NewNop()
	}
	ctx, cancel := context.WithCancel(context.Background())
	return &Listener{opts: opts, log: log, ctx: ctx, cancel: cancel, listeners: make(map[string]*dbListener)}
}

// Ensure makes sure a listener runs in database and waits (up to the
// connect timeout) until its LISTEN is in force, so that the statement about
// to run cannot commit before the listener hears about it. Audit never
// blocks writes: on failure the error is logged and returned, and the
// caller forwards the statement anyway.
func (a *Listener) Ensure(database string) error {
	a.mu.Lock()
	l, ok := a.listeners[database]
	if !ok {
		if len(a.listeners) >= maxAuditDatabases || a.ctx.Err() != nil {
			a.mu.Unlock()
			return errors.New("policy: too many audited databases")
		}
		l = &dbListener{ready: make(chan struct{})}
		a.listeners[database] = l
		a.wg.Add(1)
		go a.listen(database, l)
	}
	a.mu.Unlock()
	select {
	case <-l.ready:
		if !l.up.Load() {
			return errors.New("policy: audit listener not connected")
		}
		return nil
	case <-time.After(a.opts.ConnectTimeout):
		return errors.New("policy: audit listener not ready")
	}
}

// Ready reports whether Ensure would return nil at once: database's
// listener is connected. It never waits.
func (a *Listener) Ready(database string) bool {
	a.mu.Lock()
	l, ok := a.listeners[database]
	a.mu.Unlock()
	if !ok {
		return false
	}
	select {
	case <-l.ready:
		return l.up.Load()
	default:
		return false
	}
}

// WatchCatalog starts a listener in database, if none runs, without
// waiting for it: it also hears the catalog watch's notifications
// (Options.CatalogChanged).
func (a *Listener) WatchCatalog(database string) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if _, ok := a.listeners[database]; ok || len(a.listeners) >= maxAuditDatabases || a.ctx.Err() != nil {
		return
	}
	l := &dbListener{ready: make(chan struct{})}
	a.listeners[database] = l
	a.wg.Add(1)
	go a.listen(database, l)
}

// Close stops every listener.
func (a *Listener) Close() {
	a.cancel()
	a.wg.Wait()
}

// listen keeps a LISTEN connection to database until the Auditor closes,
// reconnecting with backoff.
func (a *Listener) listen(database string, l *dbListener) {
	defer a.wg.Done()
	log := a.log.With(zap.String("database", database))
	first := true
	backoff := 100 * time.Millisecond
	for a.ctx.Err() == nil {
		conn, err := a.connect(database)
		a.setUp(database, l, err == nil)
		if first {
			close(l.ready)
			first = false
		}
		if err != nil {
			log.Error("audit listener cannot connect; audit events are lost until it does", zap.Error(err))
			select {
			case <-a.ctx.Done():
				return
			case <-time.After(backoff):
			}
			backoff = min(2*backoff, 10*time.Second)
			continue
		}
		backoff = 100 * time.Millisecond
		log.Info("audit listener connected")
		if a.opts.CatalogChanged != nil {
			// Changes committed while it was not listening were not
			// notified: after a lost connection, and before the first
			// one (the database's check, which started it, read the
			// catalog before it listened). The check runs again.
			a.opts.CatalogChanged(database)
		}
		for {
			// Notifications arrive through the OnNotification callback
			// set in connect.
			if err := conn.WaitForNotification(a.ctx); err != nil {
				if a.ctx.Err() == nil {
					log.Error("audit listener lost its connection; reconnecting", zap.Error(err))
				}
				break
			}
		}
		a.setUp(database, l, false)
		_ = conn.Close(context.Background())
	}
}

// setUp records whether the listener of database has its LISTEN in force.
func (a *Listener) setUp(database string, l *dbListener, up bool) {
	l.up.Store(up)
	if a.opts.Metrics != nil {
		v := 0.0
		if up {
			v = 1
		}
		a.opts.Metrics.AuditListenerUp.WithLabelValues(database).Set(v)
	}
}

func (a *Listener) connect(database string) (*pgconn.PgConn, error) {
	cfg, err := a.opts.ConnConfig(database)
	if err != nil {
		return nil, err
	}
	cfg.OnNotification = func(_ *pgconn.PgConn, n *pgconn.Notification) {
		switch {
		case n.Channel == rules.AuditChannel:
			a.handle(n.PID, n.Payload)
		case n.Channel == dbsetup.CatalogChannel && a.opts.CatalogChanged != nil:
			a.opts.CatalogChanged(database)
		}
	}
	ctx, cancel := context.WithTimeout(a.ctx, a.opts.ConnectTimeout)
	defer cancel()
	conn, err := pgconn.ConnectConfig(ctx, cfg)
	if err != nil {
		return nil, err
	}
	if _, err := conn.Exec(ctx, "LISTEN "+rules.AuditChannel+"; LISTEN "+dbsetup.CatalogChannel).ReadAll(); err != nil {
		_ = conn.Close(context.Background())
		return nil, fmt.Errorf("LISTEN: %w", err)
	}
	return conn, nil
}

// handle records one notification.
func (a *Listener) handle(pid uint32, payload string) {
	ev, err := rules.ParseAuditEvent(payload)
	if err != nil {
		a.log.Warn("audit notification not understood", zap.Uint32("backend-pid", pid), zap.Error(err))
		return
	}
	if ev.Tag != a.opts.Tag {
		return // another proxy instance's statement
	}
	table := ev.Table
	if ev.Lock != nil || ev.Reason == rules.AuditMissingLock {
		// The lock registration lists the statement's tables.
		table, _, _ = strings.Cut(table, ", ")
	}
	if a.opts.KnownTable != nil && !a.opts.KnownTable(table) {
		table = "unknown"
	}
	fields := []zap.Field{
		zap.String("table", ev.Table), zap.String("reason", ev.Reason), zap.String("mode", ev.Mode),
		zap.Uint32("backend-pid", pid),
	}
	if ev.Token != nil {
		fields = append(fields, zap.String("token", *ev.Token))
	}
	if ev.Watermark != nil {
		fields = append(fields, zap.Int64("watermark", *ev.Watermark))
	}
	if ev.Lock != nil {
		fields = append(fields, zap.String("lock", *ev.Lock))
	}
	if a.opts.Lookup != nil {
		if info, ok := a.opts.Lookup(pid); ok {
			fields = append(fields, zap.Uint64("conn-id", info.ID), zap.String("user", info.User),
				zap.String("database", info.Database), zap.String("application-name", info.ApplicationName),
				zap.String("remote-addr", info.RemoteAddr))
		}
	}
	switch {
	case ev.Mode == rules.ModeAudit:
		a.log.Warn("audit: enforce mode would have rejected this write", fields...)
		if a.opts.Metrics != nil {
			a.opts.Metrics.AuditWouldReject.WithLabelValues(table, ev.Reason).Inc()
		}
	case ev.Reason == rules.AuditMissingToken:
		a.log.Info("write without a fencing token let through (missing_token: allow)", fields...)
		if a.opts.Metrics != nil {
			a.opts.Metrics.MissingTokens.WithLabelValues(table, "allowed").Inc()
		}
	default:
		a.log.Warn("audit notification with an unexpected kind", fields...)
	}
}
