package main

import (
	"strings"
	"testing"
)

// goBenchOutput is what `go test -bench -benchmem -count 3` prints, in
// the shapes the table reads: a GOMAXPROCS suffix, custom metrics before
// and after the memory ones, a log line that starts like a result.
const goBenchOutput = `goos: linux
goarch: amd64
pkg: github.com/fenceproxy/fenceproxy/internal/rules
BenchmarkPrecheckRead-2   	 6000000	       190.0 ns/op	 731.58 MB/s	       0 B/op	       0 allocs/op
BenchmarkPrecheckRead-2   	 6000000	       150.0 ns/op	 731.58 MB/s	       0 B/op	       0 allocs/op
BenchmarkPrecheckRead-2   	 6000000	       170.0 ns/op	 731.58 MB/s	       0 B/op	       0 allocs/op
BenchmarkRewriteCached-2  	17000000	        64.00 ns/op	       0 B/op	       0 allocs/op
BenchmarkRewriteFirstSeen-2 	   10000	    111000 ns/op	   60000 B/op	     549 allocs/op
BenchmarkRewriteFirstSeenRaisers-2 	   10000	     95000 ns/op	   30000 B/op	     280 allocs/op
BenchmarkRewriteInsert1000-2	     740	   1600000 ns/op	   6.55 MB/s	         6.462 outbytes/inbytes	  620941 B/op	     416 allocs/op
BenchmarkRewriteInsert5000-2	     138	  10000000 ns/op	   5.77 MB/s	         6.018 outbytes/inbytes	 3214068 B/op	     475 allocs/op
BenchmarkRewriteInsert5000 is slow: a log line, not a result
PASS
pkg: github.com/fenceproxy/fenceproxy/internal/proxy
BenchmarkRelaySimpleQuery-2 	  100000	     31000 ns/op	      2200 ns/message	       0 B/op	       0 allocs/op
BenchmarkRelayExtended-2    	  100000	     35000 ns/op	      2200 ns/message	       0 B/op	       0 allocs/op
BenchmarkRelayNoPolicy-2    	  100000	     30000 ns/op	      2100 ns/message	      16 B/op	       1 allocs/op
ok  	github.com/fenceproxy/fenceproxy/internal/proxy	12.3s
`

func TestParseGoBench(t *testing.T) {
	runs := parseGoBench(goBenchOutput)
	if n := len(runs["PrecheckRead"]); n != 3 {
		t.Fatalf("PrecheckRead: %d runs, want 3 (%v)", n, runs)
	}
	if v, ok := median(runs["PrecheckRead"], "ns/op"); !ok || v != 170 {
		t.Errorf("PrecheckRead median ns/op = %v, %v; want 170", v, ok)
	}
	if n := len(runs["RewriteInsert5000"]); n != 1 {
		t.Errorf("RewriteInsert5000: %d runs, want 1 (the log line is not one)", n)
	}
	r := runs["RewriteInsert5000"][0]
	if r["outbytes/inbytes"] != 6.018 || r["allocs/op"] != 475 || r["B/op"] != 3214068 {
		t.Errorf("RewriteInsert5000 figures %v", r)
	}
	if r := runs["RelaySimpleQuery"][0]; r["ns/message"] != 2200 || r["allocs/op"] != 0 {
		t.Errorf("RelaySimpleQuery figures %v", r)
	}
	if _, ok := median(runs["RewriteCached"], "ns/message"); ok {
		t.Error("median of a unit the runs lack reported ok")
	}
}

func TestGoBenchRows(t *testing.T) {
	rows, err := goBenchRows(parseGoBench(goBenchOutput))
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]string{
		"PrecheckRead":            "holds",  // 170 ns ≤ 200, no allocation
		"RewriteCached":           "holds",  // 64 ns ≤ 100
		"RewriteFirstSeen":        "missed", // 111 µs > 100
		"RewriteFirstSeenRaisers": "holds",  // 95 µs
		"RewriteInsert1000":       "",       // no target of its own
		"RewriteInsert5000":       "holds",  // 2.0 µs per row ≤ 1.5 × 1.6
		"RelaySimpleQuery":        "holds",
		"RelayExtended":           "holds",
		"RelayNoPolicy":           "missed", // one allocation
	}
	if len(rows) != len(want) {
		t.Fatalf("%d rows, want %d", len(rows), len(want))
	}
	for _, r := range rows {
		if r.verdict != want[r.c.bench] {
			t.Errorf("%s: %q, want %q", r.c.bench, r.verdict, want[r.c.bench])
		}
	}
	if rows[5].note != " (2.00 µs per row)" {
		t.Errorf("5,000-row note %q", rows[5].note)
	}

	// Quadratic: five times the rows, 25 times the time.
	quadratic := strings.Replace(goBenchOutput, "  10000000 ns/op", "  40000000 ns/op", 1)
	if rows, err = goBenchRows(parseGoBench(quadratic)); err != nil || rows[5].verdict != "missed" {
		t.Errorf("a 5,000-row INSERT at 8 µs per row: %+v, %v; want missed", rows[5], err)
	}
	// A benchmark renamed or gone is an error, not a blank row.
	gone := strings.ReplaceAll(goBenchOutput, "BenchmarkRewriteCached-2", "BenchmarkRewriteCachedX-2")
	if _, err := goBenchRows(parseGoBench(gone)); err == nil || !strings.Contains(err.Error(), "RewriteCached") {
		t.Errorf("missing benchmark: %v", err)
	}
}

// TestGoBenchesExist runs each benchmark of the table once: they exist
// under these names and report what the table reads.
func TestGoBenchesExist(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs the rules and proxy benchmarks")
	}
	var b strings.Builder
	if err := goBenchTable(&b, "..", 1, "1x"); err != nil {
		t.Fatal(err)
	}
	out := b.String()
	for _, c := range goBenchCases {
		if !strings.Contains(out, "(`Benchmark"+c.bench+"`) | ") {
			t.Errorf("no row for %s in:\n%s", c.bench, out)
		}
	}
}
