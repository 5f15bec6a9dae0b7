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
