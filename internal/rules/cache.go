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
	// front is a small direct-mapped cache in front of m, read without a
	// lock: a slot chosen by a cheap hash of a few bytes of the text holds
	// the entry last found there. A hit compares the whole key, so a
	// collision only costs the lookup in m. An entry m has evicted may
	// stay in a slot; it is still the right decision (decisions are a pure
	// function of the text and the rule set, and a reload makes a new
	// cache), so the cache holds at most frontSlots entries beyond max.
	front [frontSlots]atomic.Pointer[cacheEntry]
}

const frontSlots = 256

// frontSlot picks key's slot in front from its length and three 8-byte
// windows of the text (start, middle, end).
func frontSlot(set uint32, sql string) int {
	n := len(sql)
	h := uint64(n)*0x9E3779B97F4A7C15 ^ uint64(set)
	h = (h ^ window(sql, 0)) * 0xBF58476D1CE4E5B9
	h = (h ^ window(sql, n/2)) * 0x94D049BB133111EB
	h = (h ^ window(sql, n-8)) * 0x9E3779B97F4A7C15
	return int(h >> 56) // frontSlots = 256
}

// window returns the up to 8 bytes of s from i (clamped to s), packed.
func window(s string, i int) uint64 {
	if i < 0 {
		i = 0
	}
	var w uint64
	for j := i; j < len(s) && j < i+8; j++ {
		w = w<<8 | uint64(s[j])
	}
	return w
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
	slot := &c.front[frontSlot(set, sql)]
	e := slot.Load()
	if e == nil || e.key.set != set || e.key.sql != sql {
		c.mu.RLock()
		e = c.m[cacheKey{set, sql}]
		c.mu.RUnlock()
		if e == nil {
			return Decision{}, false
		}
		slot.Store(e)
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
