package dbsetup

import (
	"context"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
)

// stampTimeout bounds one read of a catalog stamp, connecting included.
const stampTimeout = 5 * time.Second

// Stamp returns the catalog stamp of database (see Result.Stamp) as a
// read that began after the call did sees it: a change committed before
// the call is counted in it. Concurrent calls share reads; a call that
// arrives while a read is under way waits for the next one, whose snapshot
// is younger than the call.
func (c *Checker) Stamp(ctx context.Context, database string) (int64, error) {
	c.mu.Lock()
	d, ok := c.dbs[database]
	if !ok || c.ctx.Err() != nil {
		c.mu.Unlock()
		return 0, ErrNotChecked
	}
	if d.stamps == nil {
		d.stamps = &stampReader{c: c, database: database}
	}
	r := d.stamps
	c.mu.Unlock()
	return r.read(ctx)
}

// CatalogChanged checks database again as soon as the run under way, if
// any, ends: its catalog has changed (a notification on CatalogChannel).
// Unlike Recheck it does not wait for minRecheckInterval: the changes that
// call for it are committed DDL, and runs never overlap.
func (c *Checker) CatalogChanged(database string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if d, ok := c.dbs[database]; ok && c.ctx.Err() == nil {
		c.askLocked(database, d)
	}
}

// WaitFresh checks database again and waits until a run that started after
// the call has ended (its Result is then in place), or until ctx ends.
func (c *Checker) WaitFresh(ctx context.Context, database string) error {
	return c.wait(ctx, database, true)
}

// WaitAsked waits until the runs of database asked for so far (by
// CatalogChanged, say) have ended, or until ctx ends. It asks for none.
func (c *Checker) WaitAsked(ctx context.Context, database string) error {
	return c.wait(ctx, database, false)
}

// wait is WaitFresh (ask) and WaitAsked.
func (c *Checker) wait(ctx context.Context, database string, ask bool) error {
	c.mu.Lock()
	d, ok := c.dbs[database]
	if !ok || c.ctx.Err() != nil {
		c.mu.Unlock()
		return ErrNotChecked
	}
	want := d.asked
	if ask {
		want = c.askLocked(database, d)
	}
	for d.ran < want {
		ended := d.ended
		c.mu.Unlock()
		select {
		case <-ended:
		case <-ctx.Done():
			return ctx.Err()
		case <-c.ctx.Done():
			return ErrNotChecked // closed: no run will end
		}
		c.mu.Lock()
	}
	c.mu.Unlock()
	return nil
}

// askLocked asks for a run of database that starts after now and returns
// the request's number (see checkedDB.asked).
func (c *Checker) askLocked(database string, d *checkedDB) uint64 {
	d.asked++
	if d.running {
		d.again = true
	} else {
		c.startLocked(database, d)
	}
	return d.asked
}

// closeStamps closes the connections the stamp readers keep, once Close
// has waited for them to stop.
func (c *Checker) closeStamps() {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, d := range c.dbs {
		if d.stamps != nil && d.stamps.conn != nil {
			ctx, cancel := context.WithTimeout(context.Background(), time.Second)
			_ = d.stamps.conn.Close(ctx)
			cancel()
			d.stamps.conn = nil
		}
	}
}

// stampReader reads one database's stamp for Stamp, on a connection it
// keeps, one read at a time.
type stampReader struct {
	c        *Checker
	database string

	mu      sync.Mutex
	running bool // a goroutine reads
	waiting []chan stampResult
	// conn is used by the reading goroutine only, and by closeStamps once
	// none runs.
	conn *pgx.Conn
}

type stampResult struct {
	stamp int64
	err   error
}

func (r *stampReader) read(ctx context.Context) (int64, error) {
	ch := make(chan stampResult, 1)
	r.mu.Lock()
	r.waiting = append(r.waiting, ch)
	if !r.running {
		// Under the Checker's mu, as every start: see Close.
		r.c.mu.Lock()
		if r.c.ctx.Err() != nil {
			r.c.mu.Unlock()
			r.waiting = r.waiting[:len(r.waiting)-1]
			r.mu.Unlock()
			return 0, ErrNotChecked
		}
		r.c.wg.Add(1)
		r.c.mu.Unlock()
		r.running = true
		go r.loop()
	}
	r.mu.Unlock()
	select {
	case res := <-ch:
		return res.stamp, res.err
	case <-ctx.Done():
		return 0, ctx.Err()
	}
}

// loop reads for the callers waiting when each read starts, until none
// waits.
func (r *stampReader) loop() {
	defer r.c.wg.Done()
	for {
		r.mu.Lock()
		batch := r.waiting
		r.waiting = nil
		if len(batch) == 0 {
			r.running = false
			r.mu.Unlock()
			return
		}
		r.mu.Unlock()
		s, err := r.readOnce()
		for _, ch := range batch {
			ch <- stampResult{s, err}
		}
	}
}

// readOnce reads the stamp, connecting first if needed; a connection that
// failed is closed, and the next read connects again.
func (r *stampReader) readOnce() (int64, error) {
	ctx, cancel := context.WithTimeout(r.c.ctx, stampTimeout)
	defer cancel()
	if r.conn == nil {
		conn, err := r.c.connect(ctx, r.database)
		if err != nil {
			return 0, err
		}
		r.conn = conn
	}
	s, err := ReadStamp(ctx, r.conn)
	if err != nil {
		closeCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Second)
		_ = r.conn.Close(closeCtx)
		cancel()
		r.conn = nil
	}
	return s, err
}
