#!/usr/bin/env bash
# A private PostgreSQL for a Prefect server, in a directory of its own, from the distribution's
# PostgreSQL binaries (Debian/Ubuntu: `apt-get install postgresql`; no Docker needed).
#
#   deployments/prefect/postgres.sh start DIR [PORT]   initdb on first use, start on 127.0.0.1:PORT
#                                                      (default: a free port), create the `prefect`
#                                                      database; prints the connection URL
#   deployments/prefect/postgres.sh url DIR            print the URL again
#   deployments/prefect/postgres.sh stop DIR           stop it (the data stays in DIR)
#
# Then:  PREFECT_API_DATABASE_CONNECTION_URL=$(deployments/prefect/postgres.sh url DIR) prefect server start
#
# Why: Prefect's default SQLite serialises every write; under a burst of task runs (a boosted round
# of hundreds of actors) the server answers 503 "database is locked" and clients back off for
# tens of seconds. bench/orchestration_overhead.py --big-round measures both.
#
# It listens on 127.0.0.1 only, with its Unix socket inside DIR, so it never touches a PostgreSQL
# the machine already runs. Authentication is `trust` for local connections: a development server,
# not one to expose. As root, the server runs as the `postgres` user (PostgreSQL refuses root).
# PG_BIN names the binaries' directory; otherwise they are looked up on PATH, then under
# /usr/lib/postgresql/<newest>/bin.
set -euo pipefail

usage() { sed -n '2,12p' "$0" >&2; exit 2; }
[ $# -ge 2 ] || usage
cmd=$1
dir=$(mkdir -p "$2" && cd "$2" && pwd)
data=$dir/data

find_bin() {
  if [ -n "${PG_BIN:-}" ]; then echo "$PG_BIN"; return; fi
  if command -v initdb >/dev/null 2>&1; then dirname "$(readlink -f "$(command -v initdb)")"; return; fi
  local newest
  newest=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1 || true)
  if [ -n "$newest" ] && [ -x "$newest/initdb" ]; then echo "$newest"; return; fi
  echo "postgres.sh: PostgreSQL's initdb/pg_ctl not found; install the postgresql package or set PG_BIN" >&2
  exit 3
}

# Run a PostgreSQL binary as an unprivileged user when we are root.
as_owner() {
  if [ "$(id -u)" -eq 0 ]; then
    id postgres >/dev/null 2>&1 || { echo "postgres.sh: running as root needs a 'postgres' user" >&2; exit 4; }
    runuser -u postgres -- "$@"
  else
    "$@"
  fi
}

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

url() {
  echo "postgresql+asyncpg://prefect@127.0.0.1:$(cat "$dir/port")/prefect"
}

case "$cmd" in
  start)
    bin=$(find_bin)
    if [ "$(id -u)" -eq 0 ]; then
      chown postgres: "$dir"
      runuser -u postgres -- test -w "$dir" \
        || { echo "postgres.sh: the postgres user cannot reach $dir (is a parent directory private?)" >&2; exit 4; }
    fi
    if [ ! -f "$data/PG_VERSION" ]; then
      as_owner "$bin/initdb" -D "$data" -U prefect --auth=trust -E UTF8 >"$dir/initdb.log" 2>&1 \
        || { cat "$dir/initdb.log" >&2; exit 1; }
    fi
    if [ -f "$data/postmaster.pid" ] && as_owner "$bin/pg_ctl" -D "$data" status >/dev/null 2>&1; then
      url  # already running: starting twice changes nothing
      exit 0
    fi
    port=${3:-$(free_port)}
    echo "$port" >"$dir/port"
    # Prefect's server opens a pool of connections per process; 200 leaves room for a worker too.
    as_owner "$bin/pg_ctl" -D "$data" -l "$dir/postgres.log" -w -t 60 \
      -o "-c listen_addresses=127.0.0.1 -p $port -c unix_socket_directories=$dir -c max_connections=200" start >/dev/null \
      || { tail -n 20 "$dir/postgres.log" >&2; exit 1; }
    if ! as_owner "$bin/psql" -h 127.0.0.1 -p "$port" -U prefect -d postgres -tAc \
        "SELECT 1 FROM pg_database WHERE datname = 'prefect'" | grep -q 1; then
      as_owner "$bin/createdb" -h 127.0.0.1 -p "$port" -U prefect prefect
    fi
    url
    ;;
  url)
    url
    ;;
  stop)
    bin=$(find_bin)
    if [ -f "$data/postmaster.pid" ]; then
      as_owner "$bin/pg_ctl" -D "$data" -m fast -w stop >/dev/null
    fi
    ;;
  *)
    usage
    ;;
esac
