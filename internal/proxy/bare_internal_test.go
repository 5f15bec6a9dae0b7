package proxy

import (
	"testing"

	"github.com/jackc/pgx/v5/pgproto3"
)

// TestRunsAlone: a Bind's statement is alone in its implicit transaction
// only where the messages read after it reach a Sync through Describes,
// Flushes and Executes of its portal alone.
func TestRunsAlone(t *testing.T) {
	enc := func(msgs ...pgproto3.FrontendMessage) []byte {
		var b []byte
		for _, m := range msgs {
			var err error
			if b, err = m.Encode(b); err != nil {
				t.Fatal(err)
			}
		}
		return b
	}
	exec := func(p string) *pgproto3.Execute { return &pgproto3.Execute{Portal: p} }
	sync := &pgproto3.Sync{}
	full := enc(&pgproto3.Describe{ObjectType: 'P', Name: "p"}, &pgproto3.Flush{}, exec("p"), exec("p"), sync)
	for _, tc := range []struct {
		name string
		next []byte
		want bool
	}{
		{"Execute, Sync", enc(exec(""), sync), true},
		{"pgx's Describe, Execute, Sync", full, true},
		{"a second statement before the Sync", enc(exec("p"), &pgproto3.Bind{DestinationPortal: "q"}, exec("q"), sync), false},
		{"another portal's Execute", enc(exec("q"), sync), false},
		{"a Query", enc(exec("p"), &pgproto3.Query{String: "SELECT 1"}, sync), false},
		{"a Parse", enc(exec("p"), &pgproto3.Parse{Query: "SELECT 1"}, sync), false},
		{"a Close", enc(exec("p"), &pgproto3.Close{ObjectType: 'P', Name: "p"}, sync), false},
		{"no Sync yet", enc(exec("p")), false},
		{"nothing read", nil, false},
		{"a Sync cut short", full[:len(full)-1], false},
		{"a bad length", []byte{'S', 0, 0, 0, 3}, false},
	} {
		portal := "p"
		if tc.name == "Execute, Sync" {
			portal = ""
		}
		if got := runsAlone(tc.next, portal); got != tc.want {
			t.Errorf("%s: %v, want %v", tc.name, got, tc.want)
		}
	}
}
