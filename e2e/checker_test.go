package e2e_test

import (
	"cmp"
	"fmt"
	"maps"
	"slices"
	"strings"
)

// The torture checker: a pure function from what the workers reported and
// what the database holds to a report of anomalies.
//
// Three sources are compared:
//
//   - the workers' reports: every operation (one lock grant) with its key,
//     token and outcome — acknowledged (COMMIT succeeded), fenced (FP001),
//     failed (an error before COMMIT: nothing committed) or unknown (COMMIT
//     failed or never answered: may or may not be committed);
//   - public.history, one row per committed increment, inserted in the same
//     transaction as the counter update;
//   - public.counter_log, written by a trigger on public.counters for every
//     committed row update, stamps included. Updates of one row are
//     serialised by its row lock, so the log's sequence numbers give, per
//     row, the commit order of every accepted write;
//   - for lock-fenced runs, the lock watermarks in fenceproxy.locks.

// outcome is what a worker learnt about one operation.
type outcome string

const (
	pending  outcome = ""        // still running when the report was read
	acked    outcome = "ack"     // COMMIT succeeded
	fenced   outcome = "fenced"  // FP001 on the stamp or the write
	failed   outcome = "failed"  // error before COMMIT was sent
	unknown  outcome = "unknown" // COMMIT's outcome not known
	abnormal outcome = "odd"     // the worker saw something impossible
)

// opRecord is one operation as its worker reported it.
type opRecord struct {
	ID       string
	Key      int
	Token    int64
	NewValue int64 // set once the worker reached COMMIT ("try")
	Tried    bool  // COMMIT was (about to be) sent
	Outcome  outcome
	Detail   string // phase and error of fenced / failed / unknown / odd
}

// historyRow is a row of public.history.
type historyRow struct {
	OpID     string
	Key      int
	Token    int64
	NewValue int64
	Fence    int64 // last_fence, stamped by the proxy
}

// logRow is a row of public.counter_log.
type logRow struct {
	Seq                int64
	Key                int
	OldValue, NewValue int64
	OldFence, NewFence int64
}

// counterRow is a row of public.counters.
type counterRow struct {
	Key   int
	Value int64
	Fence int64
}

// checkInput is everything the checker looks at.
type checkInput struct {
	Ops      map[string]*opRecord
	History  []historyRow
	Log      []logRow
	Counters []counterRow
	// Fenced says writes went through fenceproxy, so history.last_fence
	// must equal the token the worker held.
	Fenced bool
	// HistoryUnfenced says history had no fence column in the proxy's
	// rules (lock fencing alone protected it): its last_fence is not
	// compared.
	HistoryUnfenced bool
	// Stampless says no worker stamped: every accepted update of a
	// counter must add one.
	Stampless bool
	// Watermarks, if not nil, are the lock watermarks of the run's locks
	// (fenceproxy.locks), by key.
	Watermarks map[int]int64
}

// keyReport summarises one counter row.
type keyReport struct {
	Key              int
	Final            int64
	Acked            int // acknowledged increments of this key
	UnknownCommitted int // unknown operations found in history
	Stamps           int // accepted stamps (counter_log entries that kept the value)
	LastToken        int64
}

// checkReport is the checker's verdict.
type checkReport struct {
	Attempted, Acked, Fenced, Failed, Unknown int
	UnknownCommitted                          int
	// FencedBy counts fenced operations by the phase that got FP001.
	FencedBy  map[string]int
	Keys      []keyReport
	Anomalies []string
}

func (r *checkReport) anomaly(format string, args ...any) {
	r.Anomalies = append(r.Anomalies, fmt.Sprintf(format, args...))
}

// check compares the reports with the database. Every rule it applies
// follows from the protocol being correct; see the comments inline.
func check(in checkInput) *checkReport {
	r := &checkReport{FencedBy: make(map[string]int)}
	// A token is a holder key's creation revision: no two grants share
	// one. A repeated token means two holders at once, or an etcd that
	// moved its revisions backwards.
	tokenOwner := make(map[int64]string)
	for _, id := range slices.Sorted(maps.Keys(in.Ops)) {
		op := in.Ops[id]
		r.Attempted++
		if other, dup := tokenOwner[op.Token]; dup {
			r.anomaly("ops %s (key %d) and %s (key %d) were both granted token %d", other, in.Ops[other].Key, id, op.Key, op.Token)
		}
		tokenOwner[op.Token] = id
		switch op.Outcome {
		case acked:
			r.Acked++
		case fenced:
			r.Fenced++
			phase, _, _ := strings.Cut(op.Detail, " ")
			r.FencedBy[phase]++
		case failed:
			r.Failed++
		case unknown:
			r.Unknown++
		case abnormal:
			r.anomaly("op %s (key %d, token %d): worker saw: %s", id, op.Key, op.Token, op.Detail)
		default:
			r.anomaly("op %s: outcome %q never settled", id, op.Outcome)
		}
	}

	// Every history row belongs to an operation that may have committed,
	// and matches what its worker reported.
	histByOp := make(map[string]historyRow, len(in.History))
	histByKey := make(map[int][]historyRow)
	for _, h := range in.History {
		histByOp[h.OpID] = h
		histByKey[h.Key] = append(histByKey[h.Key], h)
		op, ok := in.Ops[h.OpID]
		switch {
		case !ok:
			r.anomaly("history row %s (key %d, token %d, value %d) belongs to no reported operation", h.OpID, h.Key, h.Token, h.NewValue)
			continue
		case op.Outcome == unknown || op.Outcome == acked:
			if op.Outcome == unknown {
				r.UnknownCommitted++
			}
		default:
			// A fenced or failed operation never sent COMMIT (its
			// transaction was aborted or its connection gone), so it
			// cannot have committed.
			r.anomaly("history row %s exists but its operation reported %s (%s)", h.OpID, op.Outcome, op.Detail)
		}
		if h.Key != op.Key || h.Token != op.Token || (op.Tried && h.NewValue != op.NewValue) {
			r.anomaly("history row %s = (key %d, token %d, value %d), worker reported (key %d, token %d, value %d)",
				h.OpID, h.Key, h.Token, h.NewValue, op.Key, op.Token, op.NewValue)
		}
		if in.Fenced && !in.HistoryUnfenced && h.Fence != h.Token {
			r.anomaly("history row %s: last_fence %d stamped by the proxy differs from the worker's token %d", h.OpID, h.Fence, h.Token)
		}
	}
	// No acknowledged write is lost.
	for _, id := range slices.Sorted(maps.Keys(in.Ops)) {
		if op := in.Ops[id]; op.Outcome == acked {
			if _, ok := histByOp[id]; !ok {
				r.anomaly("acknowledged op %s (key %d, token %d, value %d) is not in history", id, op.Key, op.Token, op.NewValue)
			}
		}
	}

	logByKey := make(map[int][]logRow)
	for _, l := range in.Log {
		logByKey[l.Key] = append(logByKey[l.Key], l)
	}
	for _, c := range in.Counters {
		kr := keyReport{Key: c.Key, Final: c.Value, LastToken: c.Fence}
		for _, op := range in.Ops {
			if op.Key == c.Key && op.Outcome == acked {
				kr.Acked++
			}
		}
		hist := histByKey[c.Key]
		for _, h := range hist {
			if op, ok := in.Ops[h.OpID]; ok && op.Outcome == unknown {
				kr.UnknownCommitted++
			}
		}
		checkHistory(r, c, hist)
		kr.Stamps = checkLog(r, c, logByKey[c.Key], hist, in.Fenced, in.Stampless)
		if in.Watermarks != nil {
			checkWatermark(r, c.Key, in.Watermarks, hist)
		}
		// The final value is exactly the number of committed increments:
		// the acknowledged ones plus those unknown ones that did commit.
		if c.Value != int64(kr.Acked+kr.UnknownCommitted) {
			r.anomaly("key %d: final value %d, but %d acknowledged + %d unknown-but-committed increments", c.Key, c.Value, kr.Acked, kr.UnknownCommitted)
		}
		r.Keys = append(r.Keys, kr)
	}
	for k := range histByKey {
		if !slices.ContainsFunc(in.Counters, func(c counterRow) bool { return c.Key == k }) {
			r.anomaly("history has rows for key %d, which has no counter row", k)
		}
	}
	return r
}

// checkHistory checks one key's history: value k+1 follows value k, once
// each (a duplicate is a lost update: two writers computed the same new
// value from the same old one), up to the final value; and the tokens, in
// that order — which is commit order — never decrease (a decrease is a stale
// write accepted after a newer one).
func checkHistory(r *checkReport, c counterRow, hist []historyRow) {
	hist = slices.Clone(hist)
	slices.SortFunc(hist, func(a, b historyRow) int {
		return cmp.Or(cmp.Compare(a.NewValue, b.NewValue), cmp.Compare(a.Token, b.Token))
	})
	for i, h := range hist {
		if want := int64(i + 1); h.NewValue != want {
			if i > 0 && h.NewValue == hist[i-1].NewValue {
				r.anomaly("key %d: lost update: ops %s (token %d) and %s (token %d) both wrote value %d",
					c.Key, hist[i-1].OpID, hist[i-1].Token, h.OpID, h.Token, h.NewValue)
			} else {
				r.anomaly("key %d: history value %d (op %s) where %d was expected", c.Key, h.NewValue, h.OpID, want)
			}
			return // later positions are all off by the same cause
		}
		if i > 0 && h.Token < hist[i-1].Token {
			r.anomaly("key %d: stale write accepted: value %d has token %d (op %s) after value %d with token %d (op %s)",
				c.Key, h.NewValue, h.Token, h.OpID, hist[i-1].NewValue, hist[i-1].Token, hist[i-1].OpID)
		}
	}
	if int64(len(hist)) != c.Value {
		r.anomaly("key %d: final value %d but %d history rows", c.Key, c.Value, len(hist))
	}
	if n := len(hist); n > 0 && hist[n-1].NewValue != c.Value {
		r.anomaly("key %d: final value %d but max(history.new_value) = %d", c.Key, c.Value, hist[n-1].NewValue)
	}
}

// checkLog checks one key's counter_log, the database's own record of every
// accepted row update in commit order: each entry continues from the
// previous one; the watermark never moves backwards (no write, stamp or
// increment, was accepted with a token older than one accepted before);
// each update either keeps the value (a stamp) or adds one (an increment
// with a history row for that value, carrying the same token when the
// writes were fenced); the last entry is the final row. It returns the
// number of stamps. Without stamps (stampless) an update that keeps the
// value is a lost update: a write of the value the previous one wrote,
// computed from the read before it.
func checkLog(r *checkReport, c counterRow, log []logRow, hist []historyRow, fenced, stampless bool) (stamps int) {
	tokenOfValue := make(map[int64][]int64)
	for _, h := range hist {
		tokenOfValue[h.NewValue] = append(tokenOfValue[h.NewValue], h.Token)
	}
	prevValue, prevFence := int64(0), int64(0)
	increments := 0
	for _, l := range log {
		if l.OldValue != prevValue || l.OldFence != prevFence {
			r.anomaly("key %d: counter_log #%d starts from (value %d, fence %d), previous entry ended at (%d, %d)",
				c.Key, l.Seq, l.OldValue, l.OldFence, prevValue, prevFence)
		}
		if l.NewFence < l.OldFence {
			r.anomaly("key %d: stale write accepted: counter_log #%d moved the watermark back from %d to %d",
				c.Key, l.Seq, l.OldFence, l.NewFence)
		}
		switch l.NewValue - l.OldValue {
		case 0:
			stamps++
			if stampless {
				r.anomaly("key %d: lost update: counter_log #%d wrote value %d over itself, and no worker stamps", c.Key, l.Seq, l.NewValue)
			}
		case 1:
			increments++
			tokens, ok := tokenOfValue[l.NewValue]
			if !ok || (fenced && !slices.Contains(tokens, l.NewFence)) {
				r.anomaly("key %d: counter_log #%d wrote value %d with token %d, history has tokens %v for it",
					c.Key, l.Seq, l.NewValue, l.NewFence, tokens)
			}
		default:
			r.anomaly("key %d: counter_log #%d changed the value from %d to %d: a write computed from an outdated read (lost update)", c.Key, l.Seq, l.OldValue, l.NewValue)
		}
		prevValue, prevFence = l.NewValue, l.NewFence
	}
	if prevValue != c.Value || prevFence != c.Fence {
		r.anomaly("key %d: counter_log ends at (value %d, fence %d), the row is (%d, %d)", c.Key, prevValue, prevFence, c.Value, c.Fence)
	}
	if increments != len(hist) {
		r.anomaly("key %d: counter_log has %d increments, history %d rows", c.Key, increments, len(hist))
	}
	return stamps
}

// checkWatermark checks that the lock of key has a watermark no older than
// any committed token: every committed write registered its token for the
// lock first (the read before it did too), and a watermark never moves
// back.
func checkWatermark(r *checkReport, key int, watermarks map[int]int64, hist []historyRow) {
	w, ok := watermarks[key]
	for _, h := range hist {
		switch {
		case !ok:
			r.anomaly("key %d: op %s committed with token %d, but the lock has no watermark", key, h.OpID, h.Token)
			return
		case h.Token > w:
			r.anomaly("key %d: op %s committed with token %d, above the lock's watermark %d", key, h.OpID, h.Token, w)
		}
	}
}

// summary is the one-line result.
func (r *checkReport) summary() string {
	return fmt.Sprintf("ops=%d acked=%d fenced=%d failed=%d unknown=%d (committed %d) anomalies=%d",
		r.Attempted, r.Acked, r.Fenced, r.Failed, r.Unknown, r.UnknownCommitted, len(r.Anomalies))
}

// details lists the anomalies, at most max of them.
func (r *checkReport) details(max int) string {
	var b strings.Builder
	for i, a := range r.Anomalies {
		if i == max {
			fmt.Fprintf(&b, "  … and %d more\n", len(r.Anomalies)-max)
			break
		}
		fmt.Fprintf(&b, "  %s\n", a)
	}
	return b.String()
}
