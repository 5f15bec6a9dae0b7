package service_test

import (
	"context"
	"net/http"
	"os"
	"os/exec"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"

	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// chromium returns the path of Debian's chromium; without it the test is
// skipped, except under CI, which installs it (scripts/install-deps.sh).
func chromium(t *testing.T) string {
	t.Helper()
	for _, name := range []string{"chromium", "chromium-browser", "google-chrome"} {
		if p, err := exec.LookPath(name); err == nil {
			return p
		}
	}
	if os.Getenv("CI") != "" {
		t.Fatal("chromium is not installed (scripts/install-deps.sh installs it)")
	}
	t.Skip("chromium is not installed (apt-get install chromium)")
	return ""
}

// TestStatusPageInChromium: the status page at / of the admin port,
// rendered by a real headless Chromium, shows the rules with their
// source, the database's check, the lock with its watermark and refusal,
// the sessions; a stale write refused after the page was opened appears
// within a refresh, without the test reloading the page (the page
// reloads itself); the HTML loads nothing from elsewhere and shows no
// token, DSN or password. With FENCEPROXY_UPDATE_SCREENSHOT=1 it writes
// docs/status-page.png.
func TestStatusPageInChromium(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL")
	browser := chromium(t)
	o := startObserved(t)
	o.traffic(t)
	url := "http://" + o.in.AdminAddr() + "/"

	// The HTML as served: self-contained, nothing secret.
	html := get(t, url, http.StatusOK)
	for _, bad := range []*regexp.Regexp{
		regexp.MustCompile(`(?i)<script`), regexp.MustCompile(`(?i)\ssrc=`),
		regexp.MustCompile(`(?i)href="(https?:)?//`), regexp.MustCompile(`(?i)<link`), regexp.MustCompile(`(?i)@import`),
		regexp.MustCompile(`postgres(ql)?://`), regexp.MustCompile(`(?i)password`), regexp.MustCompile(`fence\.token\s*=`),
	} {
		if loc := bad.FindStringIndex(html); loc != nil {
			t.Errorf("status page contains %q: %s", bad, html[max(0, loc[0]-80):min(len(html), loc[1]+80)])
		}
	}

	opts := append(chromedp.DefaultExecAllocatorOptions[:],
		chromedp.ExecPath(browser),
		chromedp.NoSandbox, // root in CI
		chromedp.DisableGPU,
		chromedp.WindowSize(1280, 1000),
		chromedp.Flag("no-proxy-server", true),
	)
	actx, cancelA := chromedp.NewExecAllocator(context.Background(), opts...)
	defer cancelA()
	bctx, cancelB := chromedp.NewContext(actx, chromedp.WithLogf(t.Logf))
	defer cancelB()
	ctx, cancel := context.WithTimeout(bctx, 90*time.Second)
	defer cancel()

	if err := chromedp.Do(ctx, chromedp.Navigate(url), chromedp.WaitVisible(chromedp.CSS("#tables"))); err != nil {
		t.Fatal(err)
	}
	text, err := chromedp.Run(ctx, chromedp.Text(chromedp.CSS("body")))
	if err != nil {
		t.Fatal(err)
	}
	loadedAt, err := chromedp.Run(ctx, chromedp.Evaluate[float64](`performance.timeOrigin`))
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		"Rules in force", o.path, "public.obs_row", "public.obs_audit", "public.obs_lock",
		"Databases", o.db, "job/7", "stale: 1", "Sessions",
	} {
		if !strings.Contains(text, want) {
			t.Errorf("the rendered page lacks %q:\n%s", want, text)
		}
	}
	// The page may be reloading: a query then waits for the new one, but
	// a node found just before the old page goes is gone when it is read
	// ("No node with given id found"): that read is tried again.
	text1 := func(sel string) string {
		for try := 0; ; try++ {
			s, err := chromedp.Run(ctx, chromedp.Text(chromedp.CSS(sel)))
			if err == nil {
				return s
			}
			if try == 4 || !strings.Contains(err.Error(), "No node with given id") {
				t.Fatal(err)
			}
		}
	}
	staleCell := func() string { return strings.TrimSpace(text1(`tr[data-table="public.obs_row"] td.stale`)) }
	lockRow := func() string { return text1(`tr[data-lock="job/7"]`) }
	if got := staleCell(); got != "1" {
		t.Fatalf("stale-token count of public.obs_row = %q, want 1", got)
	}
	// The watermark of job/7 is 7 (the newer holder's token).
	if lr := lockRow(); !regexp.MustCompile(`\b7\b`).MatchString(lr) || !strings.Contains(lr, o.db) {
		t.Errorf("lock row = %q, want database %s and watermark 7", lr, o.db)
	}

	// A stale write now: the open page shows it at its next refresh.
	wrote := time.Now()
	o.staleRowWrite(t, 3)
	deadline := wrote.Add(3 * 2 * time.Second)
	for staleCell() != "2" {
		if time.Now().After(deadline) {
			t.Fatalf("the page still shows %q stale writes 3 refreshes after the second one", staleCell())
		}
		time.Sleep(100 * time.Millisecond)
	}
	reloadedAt, err := chromedp.Run(ctx, chromedp.Evaluate[float64](`performance.timeOrigin`))
	if err != nil {
		t.Fatal(err)
	}
	last, err := chromedp.Run(ctx, chromedp.Text(chromedp.CSS(`tr[data-table="public.obs_row"] td.last`)))
	if err != nil {
		t.Fatal(err)
	}
	if reloadedAt <= loadedAt {
		t.Errorf("the page shows the new count without having reloaded (time origin %v, first %v)", reloadedAt, loadedAt)
	}
	if !regexp.MustCompile(`\d\d:\d\d:\d\d`).MatchString(last) {
		t.Errorf("last refusal of public.obs_row = %q, want a time", last)
	}
	t.Logf("the stale write showed after %v", time.Since(wrote).Round(10*time.Millisecond))

	png, err := chromedp.Run(ctx, chromedp.FullScreenshot(100))
	if err != nil {
		t.Fatal(err)
	}
	out := t.TempDir() + "/status-page.png"
	if os.Getenv("FENCEPROXY_UPDATE_SCREENSHOT") == "1" {
		out = "../../docs/status-page.png"
	}
	if err := os.WriteFile(out, png, 0o644); err != nil {
		t.Fatal(err)
	}
	t.Logf("screenshot: %s (update docs/status-page.png with FENCEPROXY_UPDATE_SCREENSHOT=1 go test ./internal/service -run TestStatusPageInChromium)", out)
}
