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

	for _, tc := range []struct {
		name   string
		mutate func(*checkInput)
		want   string // substring of an anomaly; "" for none
	}{
		{"correct history", func(*checkInput) {}, ""},
		{"unknown op not committed", func(in *checkInput) {
			in.History = in.History[:2]
			in.Log = in.Log[:5]
			in.Log = append(in.Log, logRow{Seq: 7, Key: 1, OldValue: 2, NewValue: 2, OldFence: 30, NewFence: 40})
			in.Counters[0].Value = 2
		}, ""},
		{"acknowledged write lost", func(in *checkInput) {
			in.History = in.History[1:]
		}, "acknowledged op a"},
		{"fenced op committed", func(in *checkInput) {
			in.Ops["c"].NewValue, in.Ops["c"].Tried = 4, true
			in.History = append(in.History, historyRow{OpID: "c", Key: 1, Token: 15, NewValue: 4, Fence: 15})
			in.Log = append(in.Log, logRow{Seq: 8, Key: 1, OldValue: 3, NewValue: 4, OldFence: 40, NewFence: 15})
			in.Counters[0] = counterRow{Key: 1, Value: 4, Fence: 15}
		}, "operation reported fenced"},
		{"stale write accepted", func(in *checkInput) {
			in.Ops["c"] = &opRecord{ID: "c", Key: 1, Token: 15, NewValue: 3, Tried: true, Outcome: acked}
			in.History[2] = historyRow{OpID: "c", Key: 1, Token: 15, NewValue: 3, Fence: 15}
			in.Ops["d"].Outcome = failed
			in.Log[5] = logRow{Seq: 6, Key: 1, OldValue: 2, NewValue: 3, OldFence: 30, NewFence: 15}
			in.Log[6] = logRow{Seq: 7, Key: 1, OldValue: 3, NewValue: 3, OldFence: 15, NewFence: 40}
		}, "stale write accepted"},
		{"lost update", func(in *checkInput) {
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
		{"watermark moved back by a stamp", func(in *checkInput) {
			in.Log = append(in.Log, logRow{Seq: 8, Key: 1, OldValue: 3, NewValue: 3, OldFence: 40, NewFence: 12})
			in.Counters[0].Fence = 12
		}, "moved the watermark back"},
		{"final value differs", func(in *checkInput) {
			in.Counters[0].Value = 5
		}, "final value 5"},
		{"history row of nobody", func(in *checkInput) {
			in.History = append(in.History, historyRow{OpID: "zz", Key: 1, Token: 50, NewValue: 4, Fence: 50})
		}, "belongs to no reported operation"},
		{"proxy stamped another token", func(in *checkInput) {
			in.History[0].Fence = 11
		}, "last_fence 11 stamped by the proxy"},
		{"write without history row", func(in *checkInput) {
			in.Log = append(in.Log, logRow{Seq: 8, Key: 1, OldValue: 3, NewValue: 4, OldFence: 40, NewFence: 40})
			in.Counters[0].Value = 4
		}, "history has tokens [] for it"},
		{"worker saw something odd", func(in *checkInput) {
			in.Ops["e"].Outcome, in.Ops["e"].Detail = abnormal, "stamp updated 0 rows, want 1"
		}, "stamp updated 0 rows"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			in := good()
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
		r := check(good())
		if r.Attempted != 5 || r.Acked != 2 || r.Fenced != 1 || r.Failed != 1 || r.Unknown != 1 || r.UnknownCommitted != 1 {
			t.Fatalf("counts: %s", r.summary())
		}
		if k := r.Keys[0]; k.Final != 3 || k.Acked != 2 || k.UnknownCommitted != 1 || k.Stamps != 4 {
			t.Fatalf("key report: %+v", k)
		}
	})
}
