package rules

import (
	"strconv"
	"strings"
	"testing"
)

func TestDecisionCacheBoundedLRU(t *testing.T) {
	c := newDecisionCache(3)
	for i := range 3 {
		c.put(strconv.Itoa(i), Decision{SQL: strconv.Itoa(i)})
	}
	if _, ok := c.get("0"); !ok { // 0 becomes most recently used
		t.Fatal("0 missing")
	}
	c.put("3", Decision{SQL: "3"}) // evicts 1, the least recently used
	if _, ok := c.get("1"); ok {
		t.Error("1 not evicted")
	}
	for _, k := range []string{"0", "2", "3"} {
		if d, ok := c.get(k); !ok || d.SQL != k {
			t.Errorf("%s: got %v %v", k, d, ok)
		}
	}
	if c.len() != 3 {
		t.Errorf("len %d", c.len())
	}
	c.put(strings.Repeat("x", maxCachedSQLLen+1), Decision{})
	if c.len() != 3 {
		t.Error("oversized statement cached")
	}
}

func TestRulesCacheSize(t *testing.T) {
	r, err := Compile(Config{CacheSize: 8, Tables: []Table{{Table: "public.config"}}})
	if err != nil {
		t.Fatal(err)
	}
	for i := range 100 {
		r.Decide("UPDATE config SET a = " + strconv.Itoa(i))
	}
	if n := r.cache.len(); n != 8 {
		t.Errorf("cache holds %d entries, want 8", n)
	}
	r, _ = Compile(Config{CacheSize: -1, Tables: []Table{{Table: "public.config"}}})
	if r.cache != nil {
		t.Error("negative CacheSize did not disable the cache")
	}
}
