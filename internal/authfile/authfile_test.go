package authfile_test

import (
	"maps"
	"strings"
	"testing"

	"github.com/fenceproxy/fenceproxy/internal/authfile"
)

func TestParse(t *testing.T) {
	cases := []struct {
		name, in string
		want     map[string]string
		wantErr  string
	}{
		{"lines", "\"alice\" \"s3cret\"\n;; comment\n\n\"bob\"\t\"md5d9a4b1ec8a3c9f1d1b7f8a6a4e7c2b13\" \"ignored\"\n",
			map[string]string{"alice": "s3cret", "bob": "md5d9a4b1ec8a3c9f1d1b7f8a6a4e7c2b13"}, ""},
		{"quotes", `"o""brien" "pa""ss word"`, map[string]string{`o"brien`: `pa"ss word`}, ""},
		{"empty-password", `"carol" ""`, map[string]string{"carol": ""}, ""},
		{"scram", `"dave" "SCRAM-SHA-256$4096:c2FsdA==$a2V5:a2V5"`, nil, "SCRAM secret"},
		{"unterminated", `"eve" "abc`, nil, "line 1"},
		{"no-password", `"frank"`, nil, "password"},
		{"twice", "\"g\" \"1\"\n\"g\" \"2\"\n", nil, "listed twice"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got, err := authfile.Parse(strings.NewReader(tc.in))
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("error %v, want one containing %q", err, tc.wantErr)
				}
				if strings.Contains(err.Error(), "abc") {
					t.Errorf("error %q repeats the password", err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if !maps.Equal(got, tc.want) {
				t.Errorf("got %q, want %q", got, tc.want)
			}
		})
	}
}
