package demo_test

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"

	"github.com/fenceproxy/fenceproxy/internal/demo"
	"github.com/fenceproxy/fenceproxy/rules"
)

// TestDemoRunsToTheEnd plays the whole narration non-interactively and
// checks what it observed: A fenced with FP001, B's data intact.
func TestDemoRunsToTheEnd(t *testing.T) {
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
