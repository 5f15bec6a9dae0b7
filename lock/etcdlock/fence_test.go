package etcdlock_test

import (
	"testing"

	"github.com/fenceproxy/fenceproxy/lock"
)

// TestGrantFence: a grant's Fence carries its token and name.
func TestGrantFence(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	l := mustAcquire(t, ctx, newClient(t), "locks/fence", lock.Options{})
	defer mustRelease(t, ctx, l)
	f := l.Fence(lock.Settings{})
	if f.Token != l.Token() || f.Lock != "locks/fence" {
		t.Errorf("Fence() = %+v", f)
	}
	if got, want := f.PGOptions(), l.PGOptions(lock.Settings{}); got != want {
		t.Errorf("Fence.PGOptions %q, Lease.PGOptions %q", got, want)
	}
}
