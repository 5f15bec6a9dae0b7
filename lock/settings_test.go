package lock_test

import (
	"context"
	"strconv"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/fenceproxy/fenceproxy/internal/pgcluster"
	"github.com/fenceproxy/fenceproxy/internal/pgcluster/pgtest"
	"github.com/fenceproxy/fenceproxy/lock"
)

// startPG starts a throwaway PostgreSQL cluster for t.
func startPG(t *testing.T) *pgcluster.Cluster {
	t.Helper()
	return pgtest.Start(t, pgcluster.Options{})
}

func show(t *testing.T, ctx context.Context, conn *pgx.Conn, setting string) string {
	t.Helper()
	var v string
	if err := conn.QueryRow(ctx, "SELECT current_setting($1)", setting).Scan(&v); err != nil {
		t.Fatalf("current_setting(%q): %v", setting, err)
	}
	return v
}

// TestConfigurePgx connects with pgx after ConfigurePgx, and with the
// PGOptions string as the options startup parameter, and reads both
// settings back from PostgreSQL, for lock names with spaces and
// backslashes and for custom setting names.
func TestConfigurePgx(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	cli := newClient(t)
	pg := startPG(t)

	for _, tc := range []struct {
		name     string
		lock     string
		settings lock.Settings
	}{
		{"plain", "locks/report", lock.Settings{}},
		{"space", "locks/tenant 7 config", lock.Settings{}},
		{"backslash", `locks\a\\b\ c\`, lock.Settings{}},
		{"quotes and tab", "locks/'x\"\ty=z", lock.Settings{}},
		{"custom names", "locks/custom", lock.Settings{Token: "app.fence_token", Lock: "app.fence_lock"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l := mustAcquire(t, ctx, cli, tc.lock, lock.Options{KeepAlive: true})
			defer mustRelease(t, ctx, l)
			token, lockSetting := tc.settings.Token, tc.settings.Lock
			if token == "" {
				token, lockSetting = lock.DefaultTokenSetting, lock.DefaultLockSetting
			}

			for _, via := range []string{"RuntimeParams", "options"} {
				cfg, err := pgx.ParseConfig(pg.SuperuserDSN("postgres"))
				if err != nil {
					t.Fatal(err)
				}
				if via == "RuntimeParams" {
					l.ConfigurePgx(cfg, tc.settings)
				} else {
					cfg.RuntimeParams["options"] = l.PGOptions(tc.settings)
				}
				conn, err := pgx.ConnectConfig(ctx, cfg)
				if err != nil {
					t.Fatalf("%s: connect: %v", via, err)
				}
				if got := show(t, ctx, conn, token); got != strconv.FormatInt(l.Token(), 10) {
					t.Errorf("%s: %s = %q, want %d", via, token, got, l.Token())
				}
				if got := show(t, ctx, conn, lockSetting); got != tc.lock {
					t.Errorf("%s: %s = %q, want %q", via, lockSetting, got, tc.lock)
				}
				conn.Close(ctx)
			}
		})
	}
}

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
