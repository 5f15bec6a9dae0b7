package rules

import (
	"sync"
	"sync/atomic"
)

// maxCachedSQLLen keeps very large statements (bulk INSERTs, usually unique)
// out of the cache, so the cache's memory is bounded by entries × this.
const maxCachedSQLLen = 32 << 10

// decisionCache is a bounded cache of decisions keyed by rule set and
// statement text, evicting with the CLOCK approximation of LRU: a hit only
// sets a flag under a read lock, so hits from many sessions do not
// serialise on a mutex, and a miss that inserts sweeps the ring for an
// entry not used since the hand last passed it. The sets ForSession
// derives share their root's cache, so the configured size bounds them all
// together. Entries are never modified once in the map (put replaces
// them), so a reader needs no lock after the lookup.
type decisionCache struct {
	mu   sync.RWMutex
	max  int
	m    map[cacheKey]*cacheEntry
	ring []*cacheEntry
	hand int
}

type cacheKey struct {
	set uint32 // Rules.cacheSet
	sql string
}

type cacheEntry struct {
	key  cacheKey
	d    Decision
	slot int         // index in ring
	used atomic.Bool // hit since the hand last passed
}

func newDecisionCache(max int) *decisionCache {
	return &decisionCache{max: max, m: make(map[cacheKey]*cacheEntry, max), ring: make([]*cacheEntry, 0, max)}
}

func (c *decisionCache) get(set uint32, sql string) (Decision, bool) {
	if len(sql) > maxCachedSQLLen {
		return Decision{}, false // never cached; and hashing it under the lock would stall other sessions
	}
	c.mu.RLock()
	e := c.m[cacheKey{set, sql}]
	c.mu.RUnlock()
	if e == nil {
		return Decision{}, false
	}
	if !e.used.Load() {
		e.used.Store(true)
	}
	return e.d, true
}

func (c *decisionCache) put(set uint32, sql string, d Decision) {
	if len(sql) > maxCachedSQLLen {
		return
	}
	k := cacheKey{set, sql}
	c.mu.Lock()
	defer c.mu.Unlock()
	e := &cacheEntry{key: k, d: d}
	if old, ok := c.m[k]; ok {
		e.slot = old.slot
		e.used.Store(true)
		c.ring[e.slot] = e
		c.m[k] = e
		return
	}
	if len(c.ring) < c.max {
		e.slot = len(c.ring)
		c.ring = append(c.ring, e)
		c.m[k] = e
		return
	}
	for {
		victim := c.ring[c.hand]
		if victim.used.Load() {
			victim.used.Store(false)
			c.hand = (c.hand + 1) % len(c.ring)
			continue
		}
		delete(c.m, victim.key)
		e.slot = c.hand
		c.ring[c.hand] = e
		c.m[k] = e
		c.hand = (c.hand + 1) % len(c.ring)
		return
	}
}

func (c *decisionCache) len() int {
	c.mu.RLock()
	defer c.mu.RUnlock()
	return len(c.m)
}
