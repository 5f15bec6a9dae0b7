#!/usr/bin/env bash
# Installs the Debian packages fenceproxy's tests and benchmarks need, if they
# are missing: PostgreSQL server binaries (initdb, postgres, pgbench), psql,
# a C compiler for pg_query_go (cgo), docker-compose (to validate the compose
# file), redis-server and PgBouncer (the lock and pooler tests), chromium
# (the status page test), and with --bench also valgrind.
set -euo pipefail

need=()
have_pg_bin() {
	for d in /usr/lib/postgresql/*/bin; do
		[ -x "$d/initdb" ] && [ -x "$d/postgres" ] && [ -x "$d/pgbench" ] && return 0
	done
	return 1
}
have_pg_bin || need+=(postgresql)
command -v psql >/dev/null 2>&1 || need+=(postgresql-client)
command -v gcc >/dev/null 2>&1 || need+=(gcc libc6-dev)
# docker-compose validates docker-compose.yml in the tests ('config' needs no engine).
command -v docker-compose >/dev/null 2>&1 || need+=(docker-compose)
command -v redis-server >/dev/null 2>&1 || need+=(redis-server)
command -v pgbouncer >/dev/null 2>&1 || [ -x /usr/sbin/pgbouncer ] || need+=(pgbouncer)
[ -f /usr/share/java/zookeeper.jar ] || need+=(zookeeperd)
command -v chromium >/dev/null 2>&1 || need+=(chromium fonts-dejavu-core)
if [ "${1:-}" = "--bench" ]; then
	command -v valgrind >/dev/null 2>&1 || need+=(valgrind)
fi
if [ ${#need[@]} -gt 0 ]; then
	if [ "$(id -u)" != 0 ]; then
		echo "install-deps: missing packages: ${need[*]} (run as root or install them)" >&2
		exit 1
	fi
	echo "install-deps: installing ${need[*]}"
	export DEBIAN_FRONTEND=noninteractive
	apt-get update -qq
	apt-get install -y -qq --no-install-recommends "${need[@]}"
	# The Debian server package starts a cluster of its own; the tests use
	# throwaway clusters, so keep the machine quiet.
	if command -v pg_ctlcluster >/dev/null 2>&1; then
		for c in $(pg_lsclusters -h 2>/dev/null | awk '{print $1"/"$2}'); do
			pg_ctlcluster "${c%/*}" "${c#*/}" stop || true
		done
	fi
	# Likewise the packaged redis-server and pgbouncer services.
	for svc in redis-server pgbouncer; do
		if command -v systemctl >/dev/null 2>&1; then
			systemctl stop "$svc" >/dev/null 2>&1 || true
		fi
		service "$svc" stop >/dev/null 2>&1 || true
	done
fi
