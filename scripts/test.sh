#!/usr/bin/env bash
# The test command: installs what is missing (scripts/install-deps.sh, a
# no-op when everything is there; with PgBouncer and valgrind, which the
# benchmark's own test runs), then runs every test against real PostgreSQL
# and etcd, which the tests start themselves. Extra arguments go to 'go
# test' (e.g. -short, -run X).
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="/usr/local/go/bin:$PATH"
./scripts/install-deps.sh --bench
exec go test -count=1 -timeout 45m "$@" ./...
