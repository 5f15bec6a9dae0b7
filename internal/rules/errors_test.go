package rules_test

import (
	"testing"

	"github.com/fenceproxy/fenceproxy/internal/rules"
)

const (
	staleDetail = "A newer lock holder has written this row; the write was rejected so that its data is not overwritten."
	staleHint   = "Acquire the lock again to get a new fencing token, read the row again, then retry the write."
)

func TestTranslateError(t *testing.T) {
	const hintToken = "Set it after acquiring the lock, e.g. SET fence.token = '42' (or SET LOCAL inside the transaction)."
	tests := []struct {
		name          string
		code, message string
		want          *rules.Error // nil: not translated
	}{
		{
			name:    "stale, as PostgreSQL 15 reports it",
			code:    "22P02",
			message: `invalid input syntax for type bigint: "fenceproxy:stale:41:42:13:public.config"`,
			want: &rules.Error{Code: rules.CodeStaleToken,
				Message: "fenceproxy: stale fencing token 41 for table public.config (stored watermark 42)", Table: "public.config"},
		},
		{
			name:    "stale from a boolean context, quoted table name",
			code:    "22P02",
			message: `invalid input syntax for type boolean: "fenceproxy:stale:7:9:19:"My Schema"."Cfg:x"""`,
			want: &rules.Error{Code: rules.CodeStaleToken,
				Message: `fenceproxy: stale fencing token 7 for table "My Schema"."Cfg:x" (stored watermark 9)`, Table: `"My Schema"."Cfg:x"`},
		},
		{
			name:    "stale with a NULL watermark",
			code:    "22P02",
			message: `invalid input syntax for type bigint: "fenceproxy:stale:41::13:public.config"`,
			want: &rules.Error{Code: rules.CodeStaleToken,
				Message: "fenceproxy: stale fencing token 41 for table public.config (stored watermark NULL)", Table: "public.config"},
		},
		{
			name:    "translated message (lc_messages=de)",
			code:    "22P02",
			message: `ungültige Eingabesyntax für Typ bigint: »fenceproxy:stale:41:42:13:public.config«`,
			want: &rules.Error{Code: rules.CodeStaleToken,
				Message: "fenceproxy: stale fencing token 41 for table public.config (stored watermark 42)", Table: "public.config"},
		},
		{
			name:    "mangled stale marker still reports a stale token",
			code:    "22P02",
			message: `invalid input syntax for type bigint: "fenceproxy:stale:41:42:99:public.config"`,
			want:    &rules.Error{Code: rules.CodeStaleToken, Message: "fenceproxy: stale fencing token"},
		},
		{
			name:    "token unset",
			code:    "22P02",
			message: `invalid input syntax for type boolean: "fenceproxy:token:13:public.config:11:fence.token:NULL"`,
			want: &rules.Error{Code: rules.CodeMissingToken,
				Message: "fenceproxy: write to protected table public.config needs a valid fence.token (a decimal integer 1..9223372036854775807)",
				Detail:  "fence.token is not set.", Hint: hintToken, Table: "public.config"},
		},
		{
			name:    "token empty",
			code:    "22P02",
			message: `invalid input syntax for type bigint: "fenceproxy:token:13:public.config:11:fence.token:''"`,
			want: &rules.Error{Code: rules.CodeMissingToken,
				Message: "fenceproxy: write to protected table public.config needs a valid fence.token (a decimal integer 1..9223372036854775807)",
				Detail:  "fence.token is not set (or empty).", Hint: hintToken, Table: "public.config"},
		},
		{
			name:    "token invalid, value quoted",
			code:    "22P02",
			message: "invalid input syntax for type boolean: \"fenceproxy:token:13:public.config:11:fence.token:'-1\n'\"",
			want: &rules.Error{Code: rules.CodeMissingToken,
				Message: "fenceproxy: write to protected table public.config needs a valid fence.token (a decimal integer 1..9223372036854775807)",
				Detail:  `fence.token is "-1\n".`, Hint: hintToken, Table: "public.config"},
		},
		{
			name:    "token truncated to 32 bytes",
			code:    "22P02",
			message: `invalid input syntax for type boolean: "fenceproxy:token:13:public.config:15:app.fence_token:'0123456789012345678901234567890x'"`,
			want: &rules.Error{Code: rules.CodeMissingToken,
				Message: "fenceproxy: write to protected table public.config needs a valid app.fence_token (a decimal integer 1..9223372036854775807)",
				Detail:  `app.fence_token starts with "0123456789012345678901234567890x".`,
				Hint:    "Set it after acquiring the lock, e.g. SET app.fence_token = '42' (or SET LOCAL inside the transaction).", Table: "public.config"},
		},
		{
			name:    "token with quotes and backslashes (E'' literal)",
			code:    "22P02",
			message: `invalid input syntax for type boolean: "fenceproxy:token:13:public.config:11:fence.token:E'it''s a \\ b'"`,
			want: &rules.Error{Code: rules.CodeMissingToken,
				Message: "fenceproxy: write to protected table public.config needs a valid fence.token (a decimal integer 1..9223372036854775807)",
				Detail:  `fence.token is "it's a \\ b".`, Hint: hintToken, Table: "public.config"},
		},
		{
			name:    "token marker mangled",
			code:    "22P02",
			message: `invalid input syntax for type boolean: "fenceproxy:token:x"`,
			want: &rules.Error{Code: rules.CodeMissingToken,
				Message: "fenceproxy: write to a protected table needs a valid fencing token (a decimal integer 1..9223372036854775807)"},
		},
		{name: "other code", code: "23505", message: `duplicate key value violates unique constraint "fenceproxy:stale:1:2:1:x"`},
		{name: "22P02 without marker", code: "22P02", message: `invalid input syntax for type bigint: "abc"`},
		{name: "unknown marker kind", code: "22P02", message: `invalid input syntax for type bigint: "fenceproxy:other:1"`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, ok := rules.TranslateError(tt.code, tt.message)
			if tt.want == nil {
				if ok || got != nil {
					t.Fatalf("translated to %+v, want no translation", got)
				}
				return
			}
			if !ok || got == nil {
				t.Fatal("not translated")
			}
			if tt.want.Code == rules.CodeStaleToken {
				tt.want.Detail, tt.want.Hint = staleDetail, staleHint
			}
			if *got != *tt.want {
				t.Fatalf("got  %+v\nwant %+v", *got, *tt.want)
			}
		})
	}
}

func TestErrorString(t *testing.T) {
	e := &rules.Error{Code: rules.CodeRefused, Message: "fenceproxy: TRUNCATE of protected table public.config is not allowed"}
	want := "fenceproxy: TRUNCATE of protected table public.config is not allowed (SQLSTATE FP003)"
	if e.Error() != want {
		t.Fatalf("Error() = %q", e.Error())
	}
}

func BenchmarkTranslateErrorMiss(b *testing.B) {
	b.ReportAllocs()
	for b.Loop() {
		rules.TranslateError("23505", `duplicate key value violates unique constraint "config_pkey"`)
		rules.TranslateError("22P02", `invalid input syntax for type integer: "abc"`)
	}
}
