package e2e_test

import (
	"strings"
	"testing"
)

// TestChecker feeds the torture checker hand-made histories, so that a
// torture run with zero anomalies means something: each corruption the
// checker is meant to catch is caught, and a correct history passes.
func TestChecker(t *testing.T) {
	// good is a correct run on key 1: op a (token 10) stamps and writes 1,
	// op b (token 20) stamps and writes 2, op c (token 15) is fenced after
	// b's stamp, op d (token 30) commits with an unknown outcome, op e
	// (token 40) fails before COMMIT.
	good := func() checkInput {
		return checkInput{
			Fenced: true,
			Ops: map[string]*opRecord{
				"a": {ID: "a", Key: 1, Token: 10, NewValue: 1, Tried: true, Outcome: acked},
				"b": {ID: "b", Key: 1, Token: 20, NewValue: 2, Tried: true, Outcome: acked},
				"c": {ID: "c", Key: 1, Token: 15, Outcome: fenced, Detail: "write FP001"},
				"d": {ID: "d", Key: 1, Token: 30, NewValue: 3, Tried: true, Outcome: unknown},
				"e": {ID: "e", Key: 1, Token: 40, Outcome: failed},
			},
			History: []historyRow{
				{OpID: "a", Key: 1, Token: 10, NewValue: 1, Fence: 10},
				{OpID: "b", Key: 1, Token: 20, NewValue: 2, Fence: 20},
				{OpID: "d", Key: 1, Token: 30, NewValue: 3, Fence: 30},
			},
			Log: []logRow{
				{Seq: 1, Key: 1, OldValue: 0, NewValue: 0, OldFence: 0, NewFence: 10},
				{Seq: 2, Key: 1, OldValue: 0, NewValue: 1, OldFence: 10, NewFence: 10},
				{Seq: 3, Key: 1, OldValue: 1, NewValue: 1, OldFence: 10, NewFence: 20},
				{Seq: 4, Key: 1, OldValue: 1, NewValue: 2, OldFence: 20, NewFence: 20},
				{Seq: 5, Key: 1, OldValue: 2, NewValue: 2, OldFence: 20, NewFence: 30},
				{Seq: 6, Key: 1, OldValue: 2, NewValue: 3, OldFence: 30, NewFence: 30},
				{Seq: 7, Key: 1, OldValue: 3, NewValue: 3, OldFence: 30, NewFence: 40},
			},
			Counters: []counterRow{{Key: 1, Value: 3, Fence: 40}},
		}
	}

	// stampless is a correct lock-fenced run on key 1 (no stamps, history
	// without a fence column): op a (token 10) writes 1, op b (token 20)
	// writes 2, op c (token 15) is fenced at its read; the lock's
	// watermark is b's token.
	stampless := func() checkInput {
		return checkInput{
			Fenced:          true,
			HistoryUnfenced: true,
			Stampless:       true,
			Ops: map[string]*opRecord{
				"a": {ID: "a", Key: 1, Token: 10, NewValue: 1, Tried: true, Outcome: acked},
				"b": {ID: "b", Key: 1, Token: 20, NewValue: 2, Tried: true, Outcome: acked},
				"c": {ID: "c", Key: 1, Token: 15, Outcome: fenced, Detail: "read FP001"},
			},
			History: []historyRow{
				{OpID: "a", Key: 1, Token: 10, NewValue: 1},
				{OpID: "b", Key: 1, Token: 20, NewValue: 2},
			},
			Log: []logRow{
				{Seq: 1, Key: 1, OldValue: 0, NewValue: 1, OldFence: 0, NewFence: 10},
				{Seq: 2, Key: 1, OldValue: 1, NewValue: 2, OldFence: 10, NewFence: 20},
			},
			Counters:   []counterRow{{Key: 1, Value: 2, Fence: 20}},
			Watermarks: map[int]int64{1: 20},
		}
	}

	for _, tc := range []struct {
		name   string
		base   func() checkInput // nil: good
		mutate func(*checkInput)
		want   string // substring of an anomaly; "" for none
	}{
		{"correct history", nil, func(*checkInput) {}, ""},
		{"unknown op not committed", nil, func(in *checkInput) {
			in.History = in.History[:2]
			in.Log = in.Log[:5]
			in.Log = append(in.Log, logRow{Seq: 7, Key: 1, OldValue: 2, NewValue: 2, OldFence: 30, NewFence: 40})
			in.Counters[0].Value = 2
		}, ""},
		{"acknowledged write lost", nil, func(in *checkInput) {
			in.History = in.History[1:]
		}, "acknowledged op a"},
		{"fenced op committed", nil, func(in *checkInput) {
			in.Ops["c"].NewValue, in.Ops["c"].Tried = 4, true
			in.History = append(in.History, historyRow{OpID: "c", Key: 1, Token: 15, NewValue: 4, Fence: 15})
			in.Log = append(in.Log, logRow{Seq: 8, Key: 1, OldValue: 3, NewValue: 4, OldFence: 40, NewFence: 15})
			in.Counters[0] = counterRow{Key: 1, Value: 4, Fence: 15}
		}, "operation reported fenced"},
		{"stale write accepted", nil, func(in *checkInput) {
			in.Ops["c"] = &opRecord{ID: "c", Key: 1, Token: 15, NewValue: 3, Tried: true, Outcome: acked}
			in.History[2] = historyRow{OpID: "c", Key: 1, Token: 15, NewValue: 3, Fence: 15}
			in.Ops["d"].Outcome = failed
			in.Log[5] = logRow{Seq: 6, Key: 1, OldValue: 2, NewValue: 3, OldFence: 30, NewFence: 15}
			in.Log[6] = logRow{Seq: 7, Key: 1, OldValue: 3, NewValue: 3, OldFence: 15, NewFence: 40}
		}, "stale write accepted"},
		{"lost update", nil, func(in *checkInput) {
			// b read 0, as a did, and both wrote 1.
			in.Ops["b"].NewValue = 1
			in.History[1].NewValue = 1
			in.Ops["d"].NewValue = 2
			in.History[2].NewValue = 2
			in.Log[3].NewValue = 1
			in.Log[4] = logRow{Seq: 5, Key: 1, OldValue: 1, NewValue: 1, OldFence: 20, NewFence: 30}
			in.Log[5] = logRow{Seq: 6, Key: 1, OldValue: 1, NewValue: 2, OldFence: 30, NewFence: 30}
			in.Log[6] = logRow{Seq: 7, Key: 1, OldValue: 2, NewValue: 2, OldFence: 30, NewFence: 40}
			in.Counters[0].Value = 2
		}, "lost update"},
		{"watermark moved back by a stamp", nil, func(in *checkInput) {
			in.Log = append(in.Log, logRow{Seq: 8, Key: 1, OldValue: 3, NewValue: 3, OldFence: 40, NewFence: 12})
			in.Counters[0].Fence = 12
		}, "moved the watermark back"},
		{"final value differs", nil, func(in *checkInput) {
			in.Counters[0].Value = 5
		}, "final value 5"},
		{"history row of nobody", nil, func(in *checkInput) {
			in.History = append(in.History, historyRow{OpID: "zz", Key: 1, Token: 50, NewValue: 4, Fence: 50})
		}, "belongs to no reported operation"},
		{"proxy stamped another token", nil, func(in *checkInput) {
			in.History[0].Fence = 11
		}, "last_fence 11 stamped by the proxy"},
		{"write without history row", nil, func(in *checkInput) {
			in.Log = append(in.Log, logRow{Seq: 8, Key: 1, OldValue: 3, NewValue: 4, OldFence: 40, NewFence: 40})
			in.Counters[0].Value = 4
		}, "history has tokens [] for it"},
		{"worker saw something odd", nil, func(in *checkInput) {
			in.Ops["e"].Outcome, in.Ops["e"].Detail = abnormal, "stamp updated 0 rows, want 1"
		}, "stamp updated 0 rows"},
		{"token granted twice", nil, func(in *checkInput) {
			in.Ops["f"] = &opRecord{ID: "f", Key: 2, Token: 20, Outcome: failed}
		}, "both granted token 20"},
		{"correct lock-fenced history", stampless, func(*checkInput) {}, ""},
		{"lost update without stamps", stampless, func(in *checkInput) {
			// b read 0, as a did, and wrote 1 over a's 1.
			in.Ops["b"].NewValue = 1
			in.History[1].NewValue = 1
			in.Log[1] = logRow{Seq: 2, Key: 1, OldValue: 1, NewValue: 1, OldFence: 10, NewFence: 20}
			in.Counters[0].Value = 1
		}, "wrote value 1 over itself"},
		{"committed token above the lock's watermark", stampless, func(in *checkInput) {
			in.Watermarks[1] = 15
		}, "above the lock's watermark 15"},
		{"lock without a watermark", stampless, func(in *checkInput) {
			delete(in.Watermarks, 1)
		}, "the lock has no watermark"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			base := tc.base
			if base == nil {
				base = good
			}
			in := base()
			tc.mutate(&in)
			r := check(in)
			if tc.want == "" {
				if len(r.Anomalies) > 0 {
					t.Fatalf("anomalies in a correct history:\n%s", r.details(20))
				}
				return
			}
			for _, a := range r.Anomalies {
				if strings.Contains(a, tc.want) {
					return
				}
			}
			t.Fatalf("no anomaly mentions %q; got:\n%s", tc.want, r.details(20))
		})
	}

	t.Run("counts", func(t *testing.T) {
		if r := check(stampless()); r.Fenced != 1 || r.FencedBy["read"] != 1 || r.Keys[0].Stamps != 0 {
			t.Fatalf("lock-fenced counts: %s, fenced by %v, key %+v", r.summary(), r.FencedBy, r.Keys[0])
		}
		r := check(good())
		if r.Attempted != 5 || r.Acked != 2 || r.Fenced != 1 || r.Failed != 1 || r.Unknown != 1 || r.UnknownCommitted != 1 {
			t.Fatalf("counts: %s", r.summary())
		}
		if k := r.Keys[0]; k.Final != 3 || k.Acked != 2 || k.UnknownCommitted != 1 || k.Stamps != 4 {
			t.Fatalf("key report: %+v", k)
		}
	})
}
