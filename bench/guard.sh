#!/usr/bin/env bash
# What the database guard (fenceproxy setup --guard) costs a fenced
# single-row UPDATE sent directly to PostgreSQL: pgbench with and without
# the guard on one throwaway server (see bench/guard/main.go). Arguments go
# to the program:
#   bench/guard.sh -duration 5s -clients 1,4 -reps 3 -sync off,on [-callgrind]
# (-callgrind also counts instructions per UPDATE; it needs valgrind)
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="/usr/local/go/bin:$PATH"
./scripts/install-deps.sh
exec go run ./bench/guard "$@"
