#!/usr/bin/env bash
# What the catalog watch costs writes and reads of an UNPROTECTED table
# through the proxy, in a database where a protected table is in mode
# enforce and not guarded (so every write-looking statement is checked
# against the catalog stamp). Two fenceproxy binaries side by side, each
# with its own database set up by its own `fenceproxy setup` (as the
# superuser, so the watch is installed): BASE, built from a commit
# (default: the one before the in-band check), and NEW, built from the
# working tree. pgbench one-row UPDATE and SELECT of pgbench_accounts,
# simple and prepared protocol, runs interleaved, median TPS and latency.
#   bench/catalogwatch.sh [-b COMMIT] [-T SECONDS] [-r REPS] [-c "1 4"] [-w]
# -w drops the base's event triggers after its setup: with -b HEAD, the
# two columns then differ by the catalog watch alone.
# Needs the PostgreSQL server binaries and pgbench; runs as root (the
# server runs as the postgres user) or as an ordinary user.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="/usr/local/go/bin:$PATH"

base=8336018^ secs=5 reps=3 clients="1 4" modes="simple prepared" nowatch=
while getopts b:T:r:c:m:w o; do
	case $o in
	b) base=$OPTARG ;; T) secs=$OPTARG ;; r) reps=$OPTARG ;; c) clients=$OPTARG ;; m) modes=$OPTARG ;;
	w) nowatch=1 ;;
	*) exit 2 ;;
	esac
done

work=$(mktemp -d /tmp/fenceproxy-catalogwatch-XXXXXX)
chmod 755 "$work"
pids=()
cleanup() {
	for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
	as_pg pg_ctl -D "$work/pg" -m fast stop >/dev/null 2>&1 || true
	rm -rf "$work"
}
as_pg() {
	if [ "$(id -u)" = 0 ]; then su postgres -s /bin/bash -c "$(printf '%q ' "$@")"; else "$@"; fi
}
trap cleanup EXIT

mkdir -p "$work/base-src"
git archive "$base" | tar -x -C "$work/base-src"
(cd "$work/base-src" && go build -o "$work/fenceproxy-base" ./cmd/fenceproxy)
go build -o "$work/fenceproxy-new" ./cmd/fenceproxy

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
pgport=$(free_port)
mkdir "$work/pg"
[ "$(id -u)" = 0 ] && chown postgres "$work/pg"
as_pg initdb -D "$work/pg" -U postgres -A trust >/dev/null
as_pg pg_ctl -D "$work/pg" -l "$work/pg/log" -o "-p $pgport -c listen_addresses=127.0.0.1 -c unix_socket_directories= -c synchronous_commit=off -c fsync=off" start >/dev/null
psql_() { psql -X -q -h 127.0.0.1 -p "$pgport" -U postgres -v ON_ERROR_STOP=1 "$@"; }

for v in base new; do
	psql_ -d postgres -c "CREATE DATABASE bench_$v"
	pgbench -q -i -s 1 -h 127.0.0.1 -p "$pgport" -U postgres "bench_$v" >/dev/null 2>&1
	psql_ -d "bench_$v" -c "CREATE TABLE acct (id bigint PRIMARY KEY, n int NOT NULL DEFAULT 0, last_fence bigint NOT NULL DEFAULT 0)"
	port=$(free_port)
	cat >"$work/$v.yaml" <<EOF
listen: 127.0.0.1:$port
upstream:
  address: 127.0.0.1:$pgport
audit:
  dsn: postgres://postgres@127.0.0.1:$pgport/bench_$v
log:
  level: warn
admin:
  listen: "off"
tables:
  - table: public.acct
EOF
	"$work/fenceproxy-$v" setup -c "$work/$v.yaml" --database "bench_$v" >"$work/setup-$v.log" 2>&1 || {
		cat "$work/setup-$v.log"
		exit 1
	}
	if [ "$v" = base ] && [ -n "$nowatch" ]; then
		# -w: the base runs without the watch, so that with -b HEAD the
		# two columns differ by the watch alone.
		psql_ -d bench_base -c "DROP EVENT TRIGGER IF EXISTS fenceproxy_catalog_ddl" -c "DROP EVENT TRIGGER IF EXISTS fenceproxy_catalog_drop" >/dev/null
	fi
	"$work/fenceproxy-$v" serve -c "$work/$v.yaml" 2>"$work/serve-$v.log" &
	pids+=($!)
	eval "port_$v=$port"
done
for v in base new; do
	p=port_$v
	for _ in $(seq 50); do psql -X -h 127.0.0.1 -p "${!p}" -U postgres -d "bench_$v" -c 'SELECT 1' >/dev/null 2>&1 && break; sleep 0.2; done
done
psql_ -d bench_new -tAc "SELECT 'watch installed: ' || (to_regprocedure('fenceproxy.catalog_at(bigint)') IS NOT NULL)"

printf '\\set aid random(1, 100000)\nUPDATE pgbench_accounts SET abalance = abalance + 1 WHERE aid = :aid;\n' >"$work/write.sql"
printf '\\set aid random(1, 100000)\nSELECT abalance FROM pgbench_accounts WHERE aid = :aid;\n' >"$work/read.sql"

run() { # target workload mode clients -> "tps latency"
	local v=$1 w=$2 m=$3 c=$4 port db
	if [ "$v" = direct ]; then port=$pgport db=bench_new; else p=port_$v; port=${!p} db=bench_$v; fi
	pgbench -n -M "$m" -c "$c" -j "$(( c < 2 ? c : 2 ))" -T "$secs" -f "$work/$w.sql" -h 127.0.0.1 -p "$port" -U postgres "$db" 2>&1 |
		awk '/^latency average/ {l=$4} /^tps/ {t=$3} END {printf "%.0f %.3f\n", t, l}'
}
median() { sort -n | awk '{a[NR]=$0} END {print a[int((NR+1)/2)]}'; }

echo
echo "| workload | mode | -c | direct tps (ms) | base tps (ms) | new tps (ms) |"
echo "|---|---|---|---|---|---|"
for w in write read; do
	for m in $modes; do
		for c in $clients; do
			: >"$work/r-direct" && : >"$work/r-base" && : >"$work/r-new"
			for r in $(seq "$reps"); do
				order="direct base new"
				[ $((r % 2)) = 0 ] && order="new base direct"
				for v in $order; do run "$v" "$w" "$m" "$c" >>"$work/r-$v"; done
			done
			line="| $w | $m | $c |"
			for v in direct base new; do
				med=$(median <"$work/r-$v")
				line+=" $(awk '{printf "%s (%s)", $1, $2}' <<<"$med") |"
			done
			echo "$line"
		done
	done
done

# Server transactions per pgbench write (pg_stat_database.xact_commit of
# the database, which counts the proxy's own stamp reads too): a count that
# does not depend on the machine's load.
echo
echo "| target | server transactions per write (simple, -c 1) |"
echo "|---|---|"
xacts() { psql_ -d postgres -tAc "SELECT pg_stat_force_next_flush(); SELECT xact_commit FROM pg_stat_database WHERE datname = '$1'" | tail -1; }
for v in base new; do
	sleep 1.5
	x0=$(xacts "bench_$v")
	p=port_$v
	n=$(pgbench -n -M simple -c 1 -T "$secs" -f "$work/write.sql" -h 127.0.0.1 -p "${!p}" -U postgres "bench_$v" 2>&1 | awk '/number of transactions actually processed/ {print $NF}' | cut -d/ -f1)
	sleep 1.5
	x1=$(xacts "bench_$v")
	echo "| $v | $(awk -v a="$x0" -v b="$x1" -v n="$n" 'BEGIN {printf "%.2f", (b-a)/n}') |"
done
