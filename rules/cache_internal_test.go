package rules

import (
	"strconv"
	"strings"
	"testing"
)

func TestDecisionCacheBoundedLRU(t *testing.T) {
	c := newDecisionCache(3)
	for i := range 3 {
		c.put(0, strconv.Itoa(i), Decision{SQL: strconv.Itoa(i)})
	}
	if _, ok := c.get(0, "0"); !ok { // 0 becomes most recently used
		t.Fatal("0 missing")
	}
	c.put(0, "3", Decision{SQL: "3"}) // evicts 1, the least recently used
	if _, ok := c.get(0, "1"); ok {
		t.Error("1 not evicted")
	}
	for _, k := range []string{"0", "2", "3"} {
		if d, ok := c.get(0, k); !ok || d.SQL != k {
			t.Errorf("%s: got %v %v", k, d, ok)
		}
	}
	if c.len() != 3 {
		t.Errorf("len %d", c.len())
	}
	c.put(0, strings.Repeat("x", maxCachedSQLLen+1), Decision{})
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

func TestDecisionCacheKeepsSetsApart(t *testing.T) {
	c := newDecisionCache(4)
	c.put(1, "q", Decision{SQL: "one"})
	c.put(2, "q", Decision{SQL: "two"})
	if d, ok := c.get(1, "q"); !ok || d.SQL != "one" {
		t.Errorf("set 1: %v %v", d, ok)
	}
	if d, ok := c.get(2, "q"); !ok || d.SQL != "two" {
		t.Errorf("set 2: %v %v", d, ok)
	}
	if _, ok := c.get(0, "q"); ok {
		t.Error("set 0 found another set's decision")
	}
}
