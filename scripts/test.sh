#!/usr/bin/env bash
# The test command: every test against real PostgreSQL and etcd, started by
# the tests themselves. Extra arguments go to 'go test' (e.g. -short, -run).
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="/usr/local/go/bin:$PATH"
exec go test -count=1 -timeout 25m "$@" ./...
