package demo_test

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"

	"github.com/fenceproxy/fenceproxy/internal/demo"
	"github.com/fenceproxy/fenceproxy/internal/rules"
	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// TestDemoRunsToTheEnd plays the whole narration non-interactively and
// checks what it observed: A fenced with FP001, B's data intact.
func TestDemoRunsToTheEnd(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL, etcd")
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var out bytes.Buffer
	res, err := demo.Run(ctx, demo.Options{Out: &out, Listen: "127.0.0.1:0", Exit: true})
	t.Log(out.String())
	if err != nil {
		t.Fatalf("demo: %v", err)
	}
	if res.TokenB <= res.TokenA || res.TokenA <= 0 {
		t.Errorf("tokens A=%d B=%d, want 0 < A < B", res.TokenA, res.TokenB)
	}
	if res.StaleErr == nil || res.StaleErr.Code != rules.CodeStaleToken {
		t.Fatalf("A's stale write got %v, want SQLSTATE %s", res.StaleErr, rules.CodeStaleToken)
	}
	if res.InsertErr == nil || res.InsertErr.Code != rules.CodeStaleToken {
		t.Fatalf("A's stale insert got %v, want SQLSTATE %s", res.InsertErr, rules.CodeStaleToken)
	}
	if res.Watermark != res.TokenB {
		t.Errorf("lock watermark %d, want %d", res.Watermark, res.TokenB)
	}
	if res.Payload != "written by B" || res.Fence != res.TokenB {
		t.Errorf("final row (%q, %d), want (\"written by B\", %d)", res.Payload, res.Fence, res.TokenB)
	}
	for _, want := range []string{"A takes the lock", "lease expires", "B takes the lock", "fenceproxy refused it", "B's data is intact", "psql \"host=127.0.0.1"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("narration lacks %q", want)
		}
	}
}

// TestDemoRedis plays the narration with the locks from a throwaway
// redis-server (fenceproxy-demo --redis): the same outcome, tokens from
// the Redis lock's counter.
func TestDemoRedis(t *testing.T) {
	testutil.SkipSystem(t, "PostgreSQL, redis-server")
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var out bytes.Buffer
	res, err := demo.Run(ctx, demo.Options{Out: &out, Listen: "127.0.0.1:0", Exit: true, Redis: demo.RedisStart})
	t.Log(out.String())
	if err != nil {
		t.Fatalf("demo --redis: %v", err)
	}
	if res.TokenA != 1 || res.TokenB != 2 {
		t.Errorf("tokens A=%d B=%d, want 1 and 2 from a fresh Redis counter", res.TokenA, res.TokenB)
	}
	if res.StaleErr == nil || res.StaleErr.Code != rules.CodeStaleToken || res.InsertErr == nil || res.InsertErr.Code != rules.CodeStaleToken {
		t.Fatalf("A's stale write and insert got %v and %v, want SQLSTATE %s", res.StaleErr, res.InsertErr, rules.CodeStaleToken)
	}
	if res.Watermark != res.TokenB || res.Payload != "written by B" || res.Fence != res.TokenB {
		t.Errorf("final (%q, %d), watermark %d, want (\"written by B\", %d), %d", res.Payload, res.Fence, res.Watermark, res.TokenB, res.TokenB)
	}
	for _, want := range []string{"redis-server", "Redis deleted A's lock key", "fenceproxy lock --redis redis://127.0.0.1:", "B's data is intact"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("narration lacks %q", want)
		}
	}
	if strings.Contains(out.String(), "etcd") {
		t.Errorf("the Redis narration mentions etcd")
	}
}
