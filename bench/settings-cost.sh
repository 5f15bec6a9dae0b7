#!/usr/bin/env bash
# What carrying each session's fence settings costs (issue: the token and
# the lock travel with every transaction). Builds fenceproxy at two
# revisions (BASE, default the commit before the settings record, and
# NEW, default HEAD), runs each in front of one throwaway PostgreSQL, and prints
# pgbench's throughput through each, the runs of the two interleaved, for:
#   read:  SELECT of an unprotected table
#   row:   an UPDATE of a row-fenced table (token set in the session)
#   lock:  the same UPDATE with a lock name (the lock registration runs)
# in the simple and the prepared protocol, at -c 1 and -c 8, with
# synchronous_commit off (so that the commit does not hide CPU). Ratios are
# NEW / BASE; a shared machine makes single runs noisy (ROUNDS runs
# each, the median is printed).
#
#   bench/settings-cost.sh [SECONDS per run, default 5] [ROUNDS, default 3]
#
# NOWATCH=1 drops the catalog watch's event triggers after setup, so that
# both builds fence the same way and the ratio is the settings' own cost.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="/usr/local/go/bin:$PATH"
secs=${1:-5}
rounds=${2:-3}
base=${BASE:-28cc327}
new=${NEW:-HEAD}
bindir=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -1)
work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null; su postgres -c "$bindir/pg_ctl -D $work/pg -m immediate stop" >/dev/null 2>&1 || true; rm -rf "$work"' EXIT
chown postgres "$work" 2>/dev/null || true

echo "building fenceproxy at $base and at $new"
for r in base new; do
	rev=$base
	[ $r = new ] && rev=$new
	git worktree add -q --detach "$work/src-$r" "$rev"
	(cd "$work/src-$r" && go build -o "$work/fp-$r" ./cmd/fenceproxy)
	git worktree remove --force "$work/src-$r"
done

pgport=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
su postgres -c "$bindir/initdb -D $work/pg -A trust -U postgres >/dev/null"
su postgres -c "$bindir/pg_ctl -D $work/pg -l $work/pg.log -o '-p $pgport -k $work -c listen_addresses=127.0.0.1 -c max_connections=50 -c synchronous_commit=off' start >/dev/null"
psql() { command psql -X -q -h 127.0.0.1 -p "$pgport" -U postgres "$@"; }
psql -c "CREATE TABLE plain (id int PRIMARY KEY, n int NOT NULL DEFAULT 0)" \
	-c "CREATE TABLE fenced (id int PRIMARY KEY, n int NOT NULL DEFAULT 0, last_fence bigint NOT NULL DEFAULT 0)" \
	-c "INSERT INTO plain SELECT g FROM generate_series(1, 8) g" \
	-c "INSERT INTO fenced SELECT g FROM generate_series(1, 8) g"

start() { # binary port admin-port
	cat >"$work/fp-$2.yaml" <<EOF
listen: 127.0.0.1:$2
upstream: {address: 127.0.0.1:$pgport}
admin: {listen: 127.0.0.1:$3}
log: {level: error}
tables:
  - {table: public.fenced, lock: optional}
EOF
	"$1" setup -c "$work/fp-$2.yaml" --database postgres >/dev/null
	if [ "${NOWATCH:-}" = 1 ]; then
		psql -c "DROP EVENT TRIGGER IF EXISTS fenceproxy_catalog_ddl" -c "DROP EVENT TRIGGER IF EXISTS fenceproxy_catalog_drop" >/dev/null
	fi
	"$1" serve -c "$work/fp-$2.yaml" >"$work/fp-$2.log" 2>&1 &
	for _ in $(seq 50); do command psql -X -h 127.0.0.1 -p "$2" -U postgres -c 'SELECT 1' >/dev/null 2>&1 && return; sleep 0.1; done
	echo "fenceproxy on $2 did not start" >&2; cat "$work/fp-$2.log" >&2; exit 1
}
freeport() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
pb=$(freeport); pn=$(freeport)
start "$work/fp-base" "$pb" "$(freeport)"
start "$work/fp-new" "$pn" "$(freeport)"

cat >"$work/read.sql" <<'EOF'
\set id random(1, 8)
SELECT n FROM plain WHERE id = :id;
EOF
cat >"$work/row.sql" <<'EOF'
\set id random(1, 8)
UPDATE fenced SET n = n + 1 WHERE id = :id;
EOF
cp "$work/row.sql" "$work/lock.sql"

tps() { # port script mode clients
	local opts="-c fence.token=100"
	[ "$2" = lock ] && opts="$opts -c fence.lock=L"
	PGOPTIONS="$opts" pgbench -n -h 127.0.0.1 -p "$1" -U postgres -M "$3" -c "$4" -j "$4" -T "$secs" -f "$work/$2.sql" postgres 2>/dev/null |
		awk '/^tps/ {print int($3)}'
}
median() { sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }

printf '%-6s %-9s %3s %10s %10s %7s\n' workload protocol c "base tps" "new tps" ratio
for w in read row lock; do
	for m in simple prepared; do
		for c in 1 8; do
			b=(); n=()
			for _ in $(seq "$rounds"); do
				b+=("$(tps "$pb" $w $m $c)")
				n+=("$(tps "$pn" $w $m $c)")
			done
			mb=$(printf '%s\n' "${b[@]}" | median)
			mn=$(printf '%s\n' "${n[@]}" | median)
			printf '%-6s %-9s %3s %10s %10s %7.2f\n' $w $m $c "$mb" "$mn" "$(awk -v a="$mn" -v b="$mb" 'BEGIN {print (b > 0 ? a / b : 0)}')"
		done
	done
done
