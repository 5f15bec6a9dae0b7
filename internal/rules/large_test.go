package rules_test

import (
	"runtime"
	"strconv"
	"strings"
	"testing"

	"github.com/fenceproxy/fenceproxy/internal/rules"
)

// bulkInsert returns an INSERT of n narrow rows, (1, 'x'), (2, 'x'), ...,
// into the protected table public.config.
func bulkInsert(n int) string {
	var b strings.Builder
	b.WriteString("INSERT INTO config (id, payload) VALUES ")
	for i := 1; i <= n; i++ {
		if i > 1 {
			b.WriteString(",")
		}
		b.WriteString("(")
		b.WriteString(strconv.Itoa(i))
		b.WriteString(", 'x')")
	}
	return b.String()
}

// rewriteOnce rewrites sql with a fresh rule set (so no cache can answer)
// and returns the rewritten text and the bytes the heap grew by during the
// one Decide call.
func rewriteOnce(t testing.TB, sql string) (string, uint64) {
	t.Helper()
	r := benchRules(t, -1)
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	d := r.Decide(sql)
	runtime.ReadMemStats(&after)
	if d.Action != rules.Rewrite {
		t.Fatalf("%d-byte INSERT: %v %v, want REWRITE", len(sql), d.Action, d.Err)
	}
	return d.SQL, after.TotalAlloc - before.TotalAlloc
}

// TestLargeInsertSize: the rewrite of a multi-row INSERT stays within a
// small constant of the client's text and grows linearly with the rows
// (every row after the first gets only the bare token), and one rewrite
// allocates a bounded multiple of the statement's size.
func TestLargeInsertSize(t *testing.T) {
	in1k, in5k := bulkInsert(1000), bulkInsert(5000)
	out1k, alloc1k := rewriteOnce(t, in1k)
	out5k, alloc5k := rewriteOnce(t, in5k)
	ratio := float64(len(out5k)) / float64(len(in5k))
	t.Logf("1000 rows: in %d B, out %d B (%.2fx), allocated %d B (%.1fx in)",
		len(in1k), len(out1k), float64(len(out1k))/float64(len(in1k)), alloc1k, float64(alloc1k)/float64(len(in1k)))
	t.Logf("5000 rows: in %d B, out %d B (%.2fx), allocated %d B (%.1fx in)",
		len(in5k), len(out5k), ratio, alloc5k, float64(alloc5k)/float64(len(in5k)))
	if ratio > 8 {
		t.Errorf("5000-row INSERT rewritten to %.2fx its size, want at most 8x", ratio)
	}
	if g := float64(len(out5k)) / float64(len(out1k)); g < 4.5 || g > 5.5 {
		t.Errorf("rewritten size grows %.2fx from 1000 to 5000 rows, want about 5x", g)
	}
	// The client's rows reach the server unchanged, in order.
	if strings.Count(out5k, ", 'x', (") != 5000 {
		t.Errorf("the rewritten INSERT does not keep the client's 5000 rows")
	}
	// Measured with this rewriter: about 470x the statement's size at 5000
	// rows (parse tree, its protobuf encoding and the reparse of the
	// spliced text), so the bound asserted here is what it meets with
	// margin, not the 4x one might hope for.
	const maxAllocRatio = 800
	if a := float64(alloc5k) / float64(len(in5k)); a > maxAllocRatio {
		t.Errorf("one rewrite of a %d-byte INSERT allocated %d B (%.0fx), want at most %dx", len(in5k), alloc5k, a, maxAllocRatio)
	}
	if g := float64(alloc5k) / float64(alloc1k); g > 7 {
		t.Errorf("allocation grows %.2fx from 1000 to 5000 rows, want about 5x", g)
	}
}

// TestMaxCheckBytes: a statement over the limit that may touch a
// protected table is refused (only recorded for audit-mode tables), and
// one that cannot is forwarded unparsed.
func TestMaxCheckBytes(t *testing.T) {
	r, err := rules.Compile(rules.Config{MaxCheckBytes: 4096, Tables: []rules.Table{
		{Table: "public.config"}, {Table: "public.audited", Mode: "audit"},
	}})
	if err != nil {
		t.Fatal(err)
	}
	pad := " /*" + strings.Repeat("x", 5000) + "*/"
	if d := r.Decide("UPDATE config SET a = 1" + pad); d.Action != rules.Refuse || d.Err.Code != rules.CodeRefused ||
		!strings.Contains(d.Err.Message, "too large") || strings.Join(d.Tables, ",") != "public.config" {
		t.Errorf("protected: %+v %+v", d, d.Err)
	}
	if d := r.Decide("UPDATE other SET a = 1" + pad); d.Action != rules.Forward || d.AuditRefusal != nil {
		t.Errorf("unprotected: %+v", d)
	}
	if d := r.Decide("UPDATE audited SET a = 1" + pad); d.Action != rules.Forward || d.AuditRefusal == nil {
		t.Errorf("audit: %+v", d)
	}
	if d := r.Decide("UPDATE U&\"\\0063onfig\" SET a = 1" + pad); d.Action != rules.Refuse {
		t.Errorf("disguised: %+v", d)
	}
	if d := r.Decide("UPDATE config SET a = 1"); d.Action != rules.Rewrite {
		t.Errorf("small: %+v", d)
	}
	if _, err := rules.Compile(rules.Config{MaxCheckBytes: -1}); err == nil {
		t.Error("negative max_check_bytes accepted")
	}
}
