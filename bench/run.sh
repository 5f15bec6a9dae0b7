#!/usr/bin/env bash
# Side-by-side benchmark: direct PostgreSQL vs fenceproxy vs PgBouncer, and
# fenced writes through the proxy vs the hand-written conditional UPDATE,
# with the performance targets and whether each holds.
# Installs PgBouncer (Debian package) if missing. Arguments go to bench:
#   bench/run.sh -duration 10s -clients 1,8
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="/usr/local/go/bin:$PATH"
./scripts/install-deps.sh --bench
exec go run ./bench "$@"
