package main

import "testing"

func TestVerdicts(t *testing.T) {
	for _, c := range []struct {
		got, want string
	}{
		{atLeast(0.951, 0.95, 2, ""), "holds"},
		{atLeast(0.9496, 0.95, 2, ""), "holds"}, // printed 0.95
		{atLeast(0.9449, 0.95, 2, ""), "misses by 0.01"},
		{atLeast(0.80, 0.90, 2, ""), "misses by 0.10"},
		{atMost(1.10, 1.10, 2, ""), "holds"},
		{atMost(1.234, 1.10, 2, ""), "misses by 0.13"},
		{atMost(15.26, 14.9, 1, " µs"), "misses by 0.4 µs"},
		{atMost(14.94, 14.9, 1, " µs"), "holds"},
	} {
		if c.got != c.want {
			t.Errorf("got %q, want %q", c.got, c.want)
		}
	}
}
