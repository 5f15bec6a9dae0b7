package rules

import (
	"container/list"
	"sync"
)

// maxCachedSQLLen keeps very large statements (bulk INSERTs, usually unique)
// out of the cache, so the cache's memory is bounded by entries × this.
const maxCachedSQLLen = 32 << 10

// decisionCache is a bounded LRU of decisions keyed by rule set and
// statement text. The sets ForSession derives share their root's cache, so
// the configured size bounds them all together.
// A single mutex is enough: the critical sections are a map lookup and a
// list move, far cheaper than the parse they save.
type decisionCache struct {
	mu  sync.Mutex
	max int
	ll  list.List // front = most recently used; values are *cacheEntry
	m   map[cacheKey]*list.Element
}

type cacheKey struct {
	set uint32 // Rules.cacheSet
	sql string
}

type cacheEntry struct {
	key cacheKey
	d   Decision
}

func newDecisionCache(max int) *decisionCache {
	return &decisionCache{max: max, m: make(map[cacheKey]*list.Element, max)}
}

func (c *decisionCache) get(set uint32, sql string) (Decision, bool) {
	if len(sql) > maxCachedSQLLen {
		return Decision{}, false // never cached; and hashing it under the lock would stall other sessions
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	e, ok := c.m[cacheKey{set, sql}]
	if !ok {
		return Decision{}, false
	}
	c.ll.MoveToFront(e)
	return e.Value.(*cacheEntry).d, true
}

func (c *decisionCache) put(set uint32, sql string, d Decision) {
	if len(sql) > maxCachedSQLLen {
		return
	}
	k := cacheKey{set, sql}
	c.mu.Lock()
	defer c.mu.Unlock()
	if e, ok := c.m[k]; ok {
		e.Value.(*cacheEntry).d = d
		c.ll.MoveToFront(e)
		return
	}
	if c.ll.Len() >= c.max {
		old := c.ll.Back()
		c.ll.Remove(old)
		delete(c.m, old.Value.(*cacheEntry).key)
	}
	c.m[k] = c.ll.PushFront(&cacheEntry{key: k, d: d})
}

func (c *decisionCache) len() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.ll.Len()
}
