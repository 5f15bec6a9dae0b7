package proxy

import (
	"fmt"
	"testing"

	"github.com/jackc/pgx/v5/pgproto3"

	"github.com/fenceproxy/fenceproxy/internal/rules"
)

// TestTakeRefusalAnyLanguage: the refusal marker is found whatever quotes
// the server's lc_messages puts around the value.
func TestTakeRefusalAnyLanguage(t *testing.T) {
	s := &session{tracker: tracker{nonce: "abc", refusals: map[uint64]*rules.Error{}}}
	for _, msg := range []string{
		`invalid input syntax for type bigint: "fenceproxy-refusal:abc:%d"`,
		`ungültige Eingabesyntax für Typ bigint: »fenceproxy-refusal:abc:%d«`,
		`syntaxe en entrée invalide pour le type bigint : « fenceproxy-refusal:abc:%d »`,
	} {
		want := &rules.Error{Code: "FP003", Message: fmt.Sprintf("refused %d", s.nextRef)}
		sql := s.refusalSQL(want)
		_ = sql
		id := s.nextRef
		got := s.takeRefusal(&pgproto3.ErrorResponse{Code: "22P02", Message: fmt.Sprintf(msg, id)})
		if got == nil || got.Code != want.Code || got.Message != want.Message || got.Severity != "ERROR" {
			t.Errorf("%q: refusal not found", msg)
		}
	}
	// Another session's nonce, or no digits, is not a refusal.
	if s.takeRefusal(&pgproto3.ErrorResponse{Code: "22P02", Message: `x: "fenceproxy-refusal:zzz:1"`}) != nil {
		t.Error("foreign nonce accepted")
	}
	if s.takeRefusal(&pgproto3.ErrorResponse{Code: "22P02", Message: `x: "fenceproxy-refusal:abc:"`}) != nil {
		t.Error("marker without digits accepted")
	}
}
