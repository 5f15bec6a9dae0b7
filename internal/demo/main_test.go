package demo_test

import (
	"os"
	"testing"

	"github.com/fenceproxy/fenceproxy/internal/testutil"
)

// TestMain reports, under -short, the system tests skipped.
func TestMain(m *testing.M) {
	os.Exit(testutil.Run(m))
}
