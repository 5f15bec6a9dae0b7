package rules

import (
	"strconv"
	"strings"
	"sync"
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

// TestDecisionCacheFront: the lock-free front slots never answer for
// another text or set, whatever collides in them, and concurrent hits and
// inserts agree with the decisions put (run with -race).
func TestDecisionCacheFront(t *testing.T) {
	c := newDecisionCache(64)
	// Texts that share length and sampled windows land in the same slot.
	a := "UPDATE config SET x = 1 WHERE id = 1 AND y = 'aaaaaaaaaaaaaaaa' -- end!"
	b := a[:12] + "G" + a[13:] // outside the windows at 0, len/2 and len-8
	if frontSlot(0, a) != frontSlot(0, b) {
		t.Fatalf("test texts do not collide: %d %d", frontSlot(0, a), frontSlot(0, b))
	}
	c.put(0, a, Decision{SQL: "A"})
	c.put(0, b, Decision{SQL: "B"})
	c.put(1, a, Decision{SQL: "A1"})
	for range 3 {
		for _, tc := range []struct {
			set       uint32
			sql, want string
		}{{0, a, "A"}, {0, b, "B"}, {1, a, "A1"}} {
			if d, ok := c.get(tc.set, tc.sql); !ok || d.SQL != tc.want {
				t.Fatalf("get(%d, %.20q) = %q %v, want %q", tc.set, tc.sql, d.SQL, ok, tc.want)
			}
		}
	}
	if _, ok := c.get(2, a); ok {
		t.Error("hit for a set never put")
	}

	// Many goroutines: every hit is the decision of its own key.
	c = newDecisionCache(32)
	var wg sync.WaitGroup
	for g := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 5000 {
				k := strconv.Itoa((i*7 + g) % 100)
				if d, ok := c.get(uint32(g%2), k); ok && d.SQL != k+"/"+strconv.Itoa(g%2) {
					t.Errorf("get(%d, %s) = %q", g%2, k, d.SQL)
					return
				}
				c.put(uint32(g%2), k, Decision{SQL: k + "/" + strconv.Itoa(g%2)})
			}
		}()
	}
	wg.Wait()
}
