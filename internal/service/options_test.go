package service_test

import (
	"strconv"
	"testing"

	"github.com/fenceproxy/fenceproxy/internal/config"
	"github.com/fenceproxy/fenceproxy/internal/service"
)

// TestProxyOptionsRelayLoops checks that limits.relay_loops reaches the
// relay, 0 leaving the relay's default.
func TestProxyOptionsRelayLoops(t *testing.T) {
	for _, n := range []int{0, 3} {
		cfg, err := config.Parse([]byte("upstream: {address: '127.0.0.1:5432'}\nlimits: {relay_loops: " + strconv.Itoa(n) + "}"))
		if err != nil {
			t.Fatal(err)
		}
		opts, err := service.ProxyOptions(cfg)
		if err != nil {
			t.Fatal(err)
		}
		if opts.RelayLoops != n {
			t.Errorf("relay_loops %d: proxy.Options.RelayLoops = %d", n, opts.RelayLoops)
		}
	}
}

// TestProxyOptionsAutoPrepare checks that auto_prepare reaches the relay,
// off unless the file turns it on.
func TestProxyOptionsAutoPrepare(t *testing.T) {
	for _, tc := range []struct {
		yaml string
		want int
	}{
		{"", 0},
		{"auto_prepare: 0", 0},
		{"auto_prepare: 2", 2},
	} {
		cfg, err := config.Parse([]byte("upstream: {address: '127.0.0.1:5432'}\n" + tc.yaml))
		if err != nil {
			t.Fatal(err)
		}
		opts, err := service.ProxyOptions(cfg)
		if err != nil {
			t.Fatal(err)
		}
		if opts.AutoPrepare != tc.want {
			t.Errorf("%q: proxy.Options.AutoPrepare = %d, want %d", tc.yaml, opts.AutoPrepare, tc.want)
		}
	}
}
