package proxy

import (
	"encoding/binary"
	"slices"
	"testing"

	"github.com/jackc/pgx/v5/pgproto3"
)

// TestWithTokenParam: the token goes last, in the format the Bind's codes
// give it, and the rest of the Bind is the client's.
func TestWithTokenParam(t *testing.T) {
	bin := func(v int64) []byte { return binary.BigEndian.AppendUint64(nil, uint64(v)) }
	for _, tc := range []struct {
		name      string
		in        pgproto3.Bind
		wantCodes []int16
		wantTok   []byte
	}{
		{"no codes", pgproto3.Bind{DestinationPortal: "p", PreparedStatement: "s", Parameters: [][]byte{[]byte("1"), nil}}, nil, []byte("42")},
		{"no parameters", pgproto3.Bind{PreparedStatement: "s"}, nil, []byte("42")},
		{"one text code", pgproto3.Bind{PreparedStatement: "s", ParameterFormatCodes: []int16{0}, Parameters: [][]byte{[]byte("1"), []byte("x")}}, []int16{0}, []byte("42")},
		{"one binary code", pgproto3.Bind{PreparedStatement: "s", ParameterFormatCodes: []int16{1}, Parameters: [][]byte{bin(1)}, ResultFormatCodes: []int16{1, 0}}, []int16{1}, bin(42)},
		{"a rejected code", pgproto3.Bind{PreparedStatement: "s", ParameterFormatCodes: []int16{2}, Parameters: [][]byte{[]byte("1"), nil}}, []int16{2, 2, 0}, []byte("42")},
		{"a rejected code, no parameters", pgproto3.Bind{PreparedStatement: "s", ParameterFormatCodes: []int16{7}}, []int16{0}, []byte("42")},
		{"a code each", pgproto3.Bind{PreparedStatement: "s", ParameterFormatCodes: []int16{1, 0}, Parameters: [][]byte{bin(1), []byte("x")}, ResultFormatCodes: []int16{1}}, []int16{1, 0, 0}, []byte("42")},
	} {
		body, err := tc.in.Encode(nil)
		if err != nil {
			t.Fatal(err)
		}
		body = body[5:]
		out, ok := withTokenParam(nil, body, "42")
		if !ok {
			t.Errorf("%s: not taken", tc.name)
			continue
		}
		var got pgproto3.Bind
		if err := got.Decode(out); err != nil {
			t.Errorf("%s: %v", tc.name, err)
			continue
		}
		n := len(tc.in.Parameters)
		if got.DestinationPortal != tc.in.DestinationPortal || got.PreparedStatement != tc.in.PreparedStatement ||
			len(got.Parameters) != n+1 || !slices.Equal(got.ResultFormatCodes, tc.in.ResultFormatCodes) ||
			!slices.Equal(got.ParameterFormatCodes, tc.wantCodes) || !slices.Equal(got.Parameters[n], tc.wantTok) {
			t.Errorf("%s: %+v", tc.name, got)
			continue
		}
		for i := range n {
			if !slices.Equal(got.Parameters[i], tc.in.Parameters[i]) || (got.Parameters[i] == nil) != (tc.in.Parameters[i] == nil) {
				t.Errorf("%s: parameter %d %q, want %q", tc.name, i, got.Parameters[i], tc.in.Parameters[i])
			}
		}
	}
	// Codes that match no count, a short body: not taken (tokenBind
	// answers the first with PostgreSQL's error before).
	for _, in := range []pgproto3.Bind{
		{PreparedStatement: "s", ParameterFormatCodes: []int16{0, 0}, Parameters: [][]byte{[]byte("1"), []byte("2"), []byte("3")}},
	} {
		body, _ := in.Encode(nil)
		if _, ok := withTokenParam(nil, body[5:], "42"); ok {
			t.Errorf("%+v: taken", in)
		}
	}
	body, _ := (&pgproto3.Bind{PreparedStatement: "s", Parameters: [][]byte{[]byte("12345")}}).Encode(nil)
	if _, ok := withTokenParam(nil, body[5:len(body)-4], "42"); ok {
		t.Error("a truncated Bind: taken")
	}
}

// TestTrimDescription: the token's bigint goes, nothing else does.
func TestTrimDescription(t *testing.T) {
	enc := func(oids ...uint32) []byte {
		b, _ := (&pgproto3.ParameterDescription{ParameterOIDs: oids}).Encode(nil)
		return b[5:]
	}
	out, ok := trimDescription(enc(23, 25, 20))
	var got pgproto3.ParameterDescription
	if !ok || got.Decode(out) != nil || !slices.Equal(got.ParameterOIDs, []uint32{23, 25}) {
		t.Errorf("trimmed: %v %v", got.ParameterOIDs, ok)
	}
	if out, ok := trimDescription(enc(20)); !ok || len(out) != 2 || binary.BigEndian.Uint16(out) != 0 {
		t.Errorf("the token alone: %v %v", out, ok)
	}
	for _, b := range [][]byte{enc(), enc(20, 23), enc(20)[:5]} {
		if _, ok := trimDescription(b); ok {
			t.Errorf("%v: trimmed", b)
		}
	}
}
