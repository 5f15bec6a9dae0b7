package proxy

import (
	"slices"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgproto3"
)

// FuzzDecodeParse checks decodeParse against pgx's Parse.Decode: the same
// name, text and parameter types where Decode accepts the body, an error
// where it refuses it, and a name that does not alias the body.
func FuzzDecodeParse(f *testing.F) {
	enc := func(p pgproto3.Parse) []byte {
		b, err := p.Encode(nil)
		if err != nil {
			f.Fatal(err)
		}
		return b[5:] // the body
	}
	f.Add(enc(pgproto3.Parse{Query: "SELECT 1"}))
	f.Add(enc(pgproto3.Parse{Name: "s1", Query: "UPDATE t SET v = $1", ParameterOIDs: []uint32{23, 25}}))
	f.Add([]byte("s1\x00SELECT 1\x00\x00"))             // a short count
	f.Add([]byte("s1\x00SELECT 1\x00\x00\x02\x00\x00")) // short types
	f.Add([]byte("s1\x00SELECT 1"))                     // unterminated text
	f.Add([]byte("noterm"))
	f.Add([]byte{})
	f.Add([]byte("\x00\x00\x00\x00extra"))
	f.Fuzz(func(t *testing.T, body []byte) {
		var want pgproto3.Parse
		wantErr := want.Decode(slices.Clone(body))
		got, err := decodeParse(body, nil)
		if (err != nil) != (wantErr != nil) {
			t.Fatalf("decodeParse error %v, Decode error %v", err, wantErr)
		}
		if err != nil {
			return
		}
		if got.Name != want.Name || got.Query != want.Query || !slices.Equal(got.ParameterOIDs, want.ParameterOIDs) {
			t.Fatalf("decodeParse %q %q %v, Decode %q %q %v", got.Name, got.Query, got.ParameterOIDs, want.Name, want.Query, want.ParameterOIDs)
		}
		name := strings.Clone(got.Name)
		clear(body)
		if got.Name != name {
			t.Fatal("the name aliases the message")
		}
	})
}
