package rules_test

import (
	"strconv"
	"testing"

	"github.com/fenceproxy/fenceproxy/internal/rules"
)

func benchRules(b testing.TB, cacheSize int) *rules.Rules {
	return mustCompile(b, rules.Config{CacheSize: cacheSize, Tables: []rules.Table{
		{Table: "public.config"},
		{Table: "public.accounts", OnStale: "skip"},
	}})
}

const benchUpdate = "UPDATE config SET payload = $1, updated_at = now() WHERE id = $2"

// A statement that names no protected table: MayTouch only, no parse.
func BenchmarkPrecheckRead(b *testing.B) {
	r := benchRules(b, rules.DefaultCacheSize)
	sql := "SELECT o.id, o.total, c.name FROM orders o JOIN customers c ON c.id = o.customer_id WHERE o.status = $1 ORDER BY o.created_at DESC LIMIT 50"
	b.ReportAllocs()
	b.SetBytes(int64(len(sql)))
	for b.Loop() {
		if r.Decide(sql).Action != rules.Forward {
			b.Fatal("not forwarded")
		}
	}
}

// A read that names a protected table: parsed (cache off), then forwarded.
func BenchmarkReadProtectedFirstSeen(b *testing.B) {
	r := benchRules(b, -1)
	sql := "SELECT payload, last_fence FROM config WHERE id = $1"
	b.ReportAllocs()
	for b.Loop() {
		if r.Decide(sql).Action != rules.Forward {
			b.Fatal("not forwarded")
		}
	}
}

// A protected UPDATE seen for the first time: parse, rewrite, deparse and
// the round-trip check (cache disabled).
func BenchmarkRewriteFirstSeen(b *testing.B) {
	r := benchRules(b, -1)
	b.ReportAllocs()
	for b.Loop() {
		if r.Decide(benchUpdate).Action != rules.Rewrite {
			b.Fatal("not rewritten")
		}
	}
}

// The same in a database with the error raisers (Rules.ServerFunctions):
// the smaller fence expressions cost less to encode and check.
func BenchmarkRewriteFirstSeenRaisers(b *testing.B) {
	r := benchRules(b, -1).ServerFunctions()
	b.ReportAllocs()
	for b.Loop() {
		if r.Decide(benchUpdate).Action != rules.Rewrite {
			b.Fatal("not rewritten")
		}
	}
}

// Distinct statement texts through a cache that is too small to hold them:
// every call misses, evicts and inserts.
func BenchmarkRewriteCacheMiss(b *testing.B) {
	r := benchRules(b, 64)
	stmts := make([]string, 1024)
	for i := range stmts {
		stmts[i] = "UPDATE config SET payload = $1 WHERE id = " + strconv.Itoa(i)
	}
	b.ReportAllocs()
	i := 0
	for b.Loop() {
		if r.Decide(stmts[i%len(stmts)]).Action != rules.Rewrite {
			b.Fatal("not rewritten")
		}
		i++
	}
}

// The same protected UPDATE again: a cache hit.
func BenchmarkRewriteCached(b *testing.B) {
	r := benchRules(b, rules.DefaultCacheSize)
	r.Decide(benchUpdate)
	b.ReportAllocs()
	for b.Loop() {
		if r.Decide(benchUpdate).Action != rules.Rewrite {
			b.Fatal("not rewritten")
		}
	}
}

func BenchmarkRewriteCachedParallel(b *testing.B) {
	r := benchRules(b, rules.DefaultCacheSize)
	r.Decide(benchUpdate)
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			r.Decide(benchUpdate)
		}
	})
}

// Larger statements of each kind, first seen.
func BenchmarkRewriteFirstSeenForms(b *testing.B) {
	r := benchRules(b, -1)
	for name, sql := range map[string]string{
		"delete":   "DELETE FROM config c USING expired e WHERE e.id = c.id AND e.at < now() RETURNING c.id",
		"insert":   "INSERT INTO config (id, payload) VALUES ($1, $2) ON CONFLICT (id) DO UPDATE SET payload = excluded.payload",
		"merge":    "MERGE INTO config c USING src s ON c.id = s.id WHEN MATCHED AND s.gone THEN DELETE WHEN MATCHED THEN UPDATE SET payload = s.payload WHEN NOT MATCHED THEN INSERT (id, payload) VALUES (s.id, s.payload)",
		"skip-upd": "UPDATE accounts SET balance = balance - $1 WHERE id = $2",
	} {
		b.Run(name, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				if r.Decide(sql).Action != rules.Rewrite {
					b.Fatal("not rewritten")
				}
			}
		})
	}
}

// ForSession with scoped entries, for a session whose set is memoized: the
// per-statement cost of scopes.
func BenchmarkForSessionScoped(b *testing.B) {
	r := scopedRules(b)
	r.ForSession("prod", "app", "billing")
	b.ReportAllocs()
	for b.Loop() {
		if r.ForSession("prod", "app", "billing") == r {
			b.Fatal("root")
		}
	}
}

// A 5,000-row INSERT of narrow rows, first seen (too large for the cache
// anyway): the cost of a bulk load through the proxy. outbytes/inbytes is
// the size of the rewritten text relative to the client's.
func BenchmarkRewriteInsert5000(b *testing.B) { benchInsertRows(b, 5000) }

// The same with 1,000 rows: with BenchmarkRewriteInsert5000, how the cost
// grows with the rows.
func BenchmarkRewriteInsert1000(b *testing.B) { benchInsertRows(b, 1000) }

func benchInsertRows(b *testing.B, rows int) {
	r := benchRules(b, -1)
	sql := bulkInsert(rows)
	b.ReportAllocs()
	b.SetBytes(int64(len(sql)))
	var out int
	for b.Loop() {
		d := r.Decide(sql)
		if d.Action != rules.Rewrite {
			b.Fatal("not rewritten")
		}
		out = len(d.SQL)
	}
	b.ReportMetric(float64(out)/float64(len(sql)), "outbytes/inbytes")
}
