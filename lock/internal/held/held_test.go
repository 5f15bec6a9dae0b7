package held_test

import (
	"context"
	"errors"
	"testing"

	"github.com/fenceproxy/fenceproxy/lock"
	"github.com/fenceproxy/fenceproxy/lock/internal/held"
)

// TestEnd: a grant is held until it ends; the first cause wins, Done is
// closed and the grant's context cancelled once.
func TestEnd(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	s := held.New("L", 7, cancel)
	if s.Err() != nil || s.Key() != "L" || s.Token() != 7 {
		t.Fatalf("new grant: key %q token %d err %v", s.Key(), s.Token(), s.Err())
	}
	select {
	case <-s.Done():
		t.Fatal("Done closed while held")
	default:
	}
	held.Lost(s, "lease expired after %v", "5s")
	held.End(s, lock.ErrReleased) // too late: the first cause wins
	<-s.Done()
	if ctx.Err() == nil {
		t.Error("the grant's context is not cancelled")
	}
	var lost *lock.LostError
	if err := s.Err(); !errors.As(err, &lost) || !errors.Is(err, lock.ErrLost) || lost.Key != "L" || lost.Token != 7 || lost.Reason != "lease expired after 5s" {
		t.Errorf("Err() = %#v, want the LostError of the first cause", err)
	}
	if f := s.Fence(lock.Settings{}); f.Token != 7 || f.Lock != "L" {
		t.Errorf("Fence() = %+v", f)
	}
}
