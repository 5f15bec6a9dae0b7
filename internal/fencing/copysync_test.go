package fencing_test

// A Sync the server ignores during a COPY FROM STDIN (it reads only copy
// messages then) gets no ReadyForQuery. A copy a Query starts while a
// Sync was sent after that Query makes the session give up its
// bookkeeping, so that a later SET of a stale token cannot be missed; a
// Sync after a Query already answered, or an Execute's copy, does not.
// Each case checks the rows (or jobs and the lock's watermark).

import (
	"testing"

	"github.com/jackc/pgx/v5/pgproto3"
)

// csUntil sends msgs and reads until n messages of the wanted kind
// arrived: "G" CopyInResponse, "Z" ReadyForQuery, "C:<tag>", "E".
func (a *atkRaw) csUntil(want string, n int, msgs ...pgproto3.FrontendMessage) (errs []pgproto3.ErrorResponse, seen []string) {
	a.t.Helper()
	for _, m := range msgs {
		a.fe.Send(m)
	}
	if err := a.fe.Flush(); err != nil {
		a.t.Fatal(err)
	}
	for n > 0 {
		m, err := a.fe.Receive()
		if err != nil {
			a.t.Fatal(err)
		}
		k := "?"
		switch m := m.(type) {
		case *pgproto3.ErrorResponse:
			errs = append(errs, *m)
			k = "E"
		case *pgproto3.CopyInResponse:
			k = "G"
		case *pgproto3.CommandComplete:
			k = "C:" + string(m.CommandTag)
		case *pgproto3.ReadyForQuery:
			k = "Z"
		}
		seen = append(seen, k)
		if k == want {
			n--
		}
	}
	return errs, seen
}

func csData() *pgproto3.CopyData { return &pgproto3.CopyData{Data: []byte("x\n")} }

// csSequences are the message sequences of the tests, each with a stale
// SET of the token (tok) where the session is to give up, run on a with
// a temporary table src.
var csSequences = []struct {
	name string
	run  func(a *atkRaw, tok string)
	// stale: the sequence sets tok and the session must refuse the next
	// fenced write; otherwise it must write it with the token it has.
	stale bool
	tx    bool // it leaves a transaction block open, committed after
}{
	{"a Sync during a Query's copy", func(a *atkRaw, tok string) {
		a.tpPipe(3, &pgproto3.Query{String: "COPY src FROM STDIN"}, &pgproto3.Sync{}, csData(), &pgproto3.CopyDone{},
			&pgproto3.Query{String: "SET fence.token = '" + tok + "'"}, &pgproto3.Sync{})
	}, true, false},
	{"two copies in one Query, the Sync after the first's end", func(a *atkRaw, tok string) {
		a.csUntil("G", 2, &pgproto3.Query{String: "COPY src FROM STDIN; COPY src FROM STDIN"}, csData(), &pgproto3.CopyDone{}, &pgproto3.Sync{})
		a.csUntil("Z", 1, csData(), &pgproto3.CopyDone{})
		a.tpPipe(2, &pgproto3.Query{String: "SET fence.token = '" + tok + "'"}, &pgproto3.Sync{})
	}, true, false},
	{"two copies, pipelined, the SET extended", func(a *atkRaw, tok string) {
		a.tpPipe(2, &pgproto3.Query{String: "COPY src FROM STDIN; COPY src FROM STDIN"}, csData(), &pgproto3.CopyDone{}, &pgproto3.Sync{}, csData(), &pgproto3.CopyDone{},
			&pgproto3.Parse{Query: "SET fence.token = '" + tok + "'"}, &pgproto3.Bind{}, &pgproto3.Execute{}, &pgproto3.Sync{})
	}, true, false},
	{"two copies, pipelined, the SET a Query", func(a *atkRaw, tok string) {
		a.tpPipe(3, &pgproto3.Query{String: "COPY src FROM STDIN; COPY src FROM STDIN"}, csData(), &pgproto3.CopyDone{}, &pgproto3.Sync{}, csData(), &pgproto3.CopyDone{},
			&pgproto3.Query{String: "SET fence.token = '" + tok + "'"}, &pgproto3.Sync{})
	}, true, false},
	{"an Execute's copy after a Query", func(a *atkRaw, tok string) {
		a.tpPipe(3, &pgproto3.Query{String: "SELECT 1"}, &pgproto3.Parse{Query: "COPY src FROM STDIN"}, &pgproto3.Bind{}, &pgproto3.Execute{}, &pgproto3.Sync{}, csData(), &pgproto3.CopyDone{},
			&pgproto3.Query{String: "SET fence.token = '" + tok + "'"}, &pgproto3.Sync{})
	}, true, false},
	{"two copies in a transaction block", func(a *atkRaw, tok string) {
		a.csUntil("G", 2, &pgproto3.Query{String: "BEGIN; COPY src FROM STDIN; COPY src FROM STDIN"}, csData(), &pgproto3.CopyDone{}, &pgproto3.Sync{})
		a.csUntil("Z", 1, csData(), &pgproto3.CopyDone{})
		a.tpPipe(2, &pgproto3.Query{String: "SET fence.token = '" + tok + "'"}, &pgproto3.Sync{})
	}, true, true},
	// No false alarm: the Sync is not the copy's.
	{"a Sync after a Query, then a Query's copy", func(a *atkRaw, _ string) {
		a.tpPipe(3, &pgproto3.Query{String: "SELECT 1"}, &pgproto3.Sync{}, &pgproto3.Query{String: "COPY src FROM STDIN"}, csData(), &pgproto3.CopyDone{})
	}, false, false},
	{"a Sync after a Query, waited for, then a copy", func(a *atkRaw, _ string) {
		a.tpPipe(2, &pgproto3.Query{String: "SELECT 1"}, &pgproto3.Sync{})
		a.tpPipe(1, &pgproto3.Query{String: "COPY src FROM STDIN"}, csData(), &pgproto3.CopyDone{})
	}, false, false},
	{"a Sync after a Query, then an Execute's copy", func(a *atkRaw, _ string) {
		a.csUntil("G", 1, &pgproto3.Query{String: "SELECT 1"}, &pgproto3.Sync{}, &pgproto3.Parse{Query: "COPY src FROM STDIN"}, &pgproto3.Bind{}, &pgproto3.Execute{}, &pgproto3.Sync{})
		a.csUntil("Z", 1, csData(), &pgproto3.CopyDone{}, &pgproto3.Sync{})
	}, false, false},
}

// TestCopySync: row fencing, the session's token 60, rows at 55; the
// stale token is 50.
func TestCopySync(t *testing.T) {
	t.Parallel()
	for _, tc := range csSequences {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			c, d := atkSetup(t)
			a := atkHijack(t, c)
			a.q("CREATE TEMP TABLE src (v text)")
			tc.run(a, "50")
			errs, tags := a.rt(&pgproto3.Query{String: "UPDATE acct SET n = n + 1 WHERE id = 1"})
			if tc.tx {
				a.rt(&pgproto3.Query{String: "COMMIT"})
			}
			switch {
			case tc.stale:
				if len(errs) != 1 || (errs[0].Code != "FP003" && errs[0].Code != "FP001") {
					t.Errorf("UPDATE after the sequence: %s %v; want a refusal", atkErrs(errs), tags)
				}
				atkWantRows(t, d, map[int64][2]int64{1: {0, 55}, 2: {0, 55}, 3: {0, 55}})
			default:
				if len(errs) > 0 {
					t.Errorf("UPDATE at token 60 refused: %s %v", atkErrs(errs), tags)
				}
				atkWantRows(t, d, map[int64][2]int64{1: {1, 60}, 2: {0, 55}, 3: {0, 55}})
			}
		})
	}
}

// TestCopySyncLock: a holder of tenant/7 at 11 sets the stale token 10
// after each sequence that must give up: it cannot write jobs.
func TestCopySyncLock(t *testing.T) {
	t.Parallel()
	for _, tc := range csSequences {
		if !tc.stale {
			continue
		}
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			_, _, d, nw := tpNewHolder(t)
			mustExec(t, nw, "CREATE TEMP TABLE src (v text)")
			a := atkHijack(t, nw)
			tc.run(a, "10")
			errs, tags := a.rt(&pgproto3.Query{String: "UPDATE jobs SET state = 'by10' WHERE id = 1"})
			if len(errs) != 1 {
				t.Errorf("the holder's UPDATE at token 10: %s %v; want a refusal", atkErrs(errs), tags)
			}
			tpWantJobs(t, d, "by11")
		})
	}
}
