package lock_test

import (
	"testing"

	"github.com/fenceproxy/fenceproxy/lock"
)

func TestAppendPGOptions(t *testing.T) {
	t.Parallel()
	const ours = `-c fence.token=7 -c fence.lock=a\ b`
	for _, tc := range []struct {
		existing, want string
	}{
		{"", ours},
		{"  ", ours},
		{"-c work_mem=64MB", "-c work_mem=64MB " + ours},
		{`-c app.x=a\\`, `-c app.x=a\\ ` + ours},
		// An unpaired trailing backslash must not escape the separator.
		{`-c app.x=a\`, `-c app.x=a ` + ours},
	} {
		if got := lock.AppendPGOptions(tc.existing, ours); got != tc.want {
			t.Errorf("AppendPGOptions(%q) = %q, want %q", tc.existing, got, tc.want)
		}
	}
}

func TestSettingsValidate(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		s  lock.Settings
		ok bool
	}{
		{lock.Settings{}, true},
		{lock.Settings{Token: "app.token", Lock: "app.lock_name$2"}, true},
		{lock.Settings{Token: "token"}, false},
		{lock.Settings{Token: "app.to ken"}, false},
		{lock.Settings{Lock: "app..lock"}, false},
		{lock.Settings{Lock: "app.1lock"}, false},
		{lock.Settings{Lock: "app.lock-name"}, false},
		{lock.Settings{Token: "a.b", Lock: "a.b"}, false},
	} {
		if err := tc.s.Validate(); (err == nil) != tc.ok {
			t.Errorf("%+v: Validate() = %v, want ok %v", tc.s, err, tc.ok)
		}
	}
}
