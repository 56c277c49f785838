"""Decode attention of many rows in one call: each row's one query over its own keys/values,
where they are, every (row, KV head) pair a work item of one parallel region.

Why: a decode row reads its whole context's keys and values once per layer (about one FLOP a
byte), so many rows are bound by how fast their KV streams from memory. One SDPA call per row
(``lean.attend_one``) splits three KV heads over the threads (uneven on two cores) and pays a
call's set-up per row and layer: 32 rows of 1-3K positions read their KV at a third of what one
pass over memory reaches (``benchmarks/rows_attention_bench.py``). Torch has no CPU kernel
taking many lengths at once, so this is a small C++ one, built on first use with the compiler
torch's extensions use (cached by torch, rebuilt when the source changes).

Contract of ``attend_rows(q, keys, values, scale)``: ``q`` rows x heads x dim, float32,
contiguous; ``keys[r]``/``values[r]`` 1 x kv_heads x n_r x dim views (last axis contiguous),
heads a multiple of kv_heads, query head i reading KV head i // (heads / kv_heads) (grouped
query attention as transformers repeats it); every key visible. Returns rows x heads x dim:
softmax(q k^T scale) v per row, the same sums as SDPA up to float32 rounding. ``kernel()`` is
None where it cannot be built (no compiler, ``PROMPTCACHE_ROWS_KERNEL=0``): callers keep the
per-row calls.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

log = logging.getLogger(__name__)

_SOURCE = r"""
#include <torch/extension.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include <algorithm>
#include <atomic>
#include <cmath>
#include <vector>

namespace {

// Softmax over each head's n scores in place (exp(s - max)); returns 1 / sum per head in inv.
void softmax_rows(float* __restrict s, int G, int64_t n, float* __restrict inv) {
  for (int g = 0; g < G; ++g) {
    float* sg = s + g * n;
    float m = sg[0];
    for (int64_t j = 1; j < n; ++j) m = std::max(m, sg[j]);
    float sum = 0.f;
    for (int64_t j = 0; j < n; ++j) {
      const float e = std::exp(sg[j] - m);
      sg[j] = e;
      sum += e;
    }
    inv[g] = 1.f / sum;
  }
}

// One (row, KV head) with the head size and group known at compile time: the G queries and the
// G output rows stay in registers; each key and value row is read once for all G heads.
template <int D, int G>
void attend_fixed(const float* __restrict q, const float* __restrict k, int64_t k_step,
                  const float* __restrict v, int64_t v_step, int64_t n, float scale,
                  float* __restrict s, float* __restrict o) {
  for (int64_t j = 0; j < n; ++j) {
    const float* kj = k + j * k_step;
    float dot[G] = {};
    for (int g = 0; g < G; ++g)
      for (int d = 0; d < D; ++d) dot[g] += q[g * D + d] * kj[d];
    for (int g = 0; g < G; ++g) s[g * n + j] = dot[g] * scale;
  }
  float inv[G];
  softmax_rows(s, G, n, inv);
  float acc[G][D] = {};
  for (int64_t j = 0; j < n; ++j) {
    const float* vj = v + j * v_step;
    for (int g = 0; g < G; ++g) {
      const float p = s[g * n + j];
      for (int d = 0; d < D; ++d) acc[g][d] += p * vj[d];
    }
  }
  for (int g = 0; g < G; ++g)
    for (int d = 0; d < D; ++d) o[g * D + d] = acc[g][d] * inv[g];
}

// Any head size and group: the same sums, one head's output row at a time.
void attend_any(const float* __restrict q, int G, int D, const float* __restrict k,
                int64_t k_step, const float* __restrict v, int64_t v_step, int64_t n,
                float scale, float* __restrict s, float* __restrict o) {
  for (int64_t j = 0; j < n; ++j) {
    const float* kj = k + j * k_step;
    for (int g = 0; g < G; ++g) {
      const float* qg = q + g * D;
      float dot = 0.f;
      for (int d = 0; d < D; ++d) dot += qg[d] * kj[d];
      s[g * n + j] = dot * scale;
    }
  }
  std::vector<float> inv(G);
  softmax_rows(s, G, n, inv.data());
  for (int g = 0; g < G; ++g) {
    float* og = o + g * D;
    const float* sg = s + g * n;
    for (int d = 0; d < D; ++d) og[d] = 0.f;
    for (int64_t j = 0; j < n; ++j) {
      const float* vj = v + j * v_step;
      const float p = sg[j];
      for (int d = 0; d < D; ++d) og[d] += p * vj[d];
    }
    for (int d = 0; d < D; ++d) og[d] *= inv[g];
  }
}

// ``work`` once on each thread of the calling thread's OpenMP team: as many threads as torch set
// in this thread. Not at::parallel_for: compiled into this library, its first call in a thread
// resets that thread's count to the last any thread set (a background thread's one).
template <typename F>
void on_team(const F& work) {
#ifdef _OPENMP
  if (omp_get_max_threads() > 1 && !omp_in_parallel()) {
#pragma omp parallel
    work();
    return;
  }
#endif
  work();
}

using Attend = void (*)(const float*, const float*, int64_t, const float*, int64_t, int64_t,
                        float, float*, float*);

template <int D>
Attend fixed_for_group(int G) {
  switch (G) {
    case 1: return attend_fixed<D, 1>;
    case 2: return attend_fixed<D, 2>;
    case 3: return attend_fixed<D, 3>;
    case 4: return attend_fixed<D, 4>;
    case 5: return attend_fixed<D, 5>;
    case 6: return attend_fixed<D, 6>;
    case 7: return attend_fixed<D, 7>;
    case 8: return attend_fixed<D, 8>;
    default: return nullptr;
  }
}

Attend fixed_for(int D, int G) {
  if (D == 64) return fixed_for_group<64>(G);
  if (D == 128) return fixed_for_group<128>(G);
  return nullptr;
}

void check_kv(const at::Tensor& t, int64_t kv_heads, int64_t dim) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.device().is_cpu(), "float32 CPU keys/values");
  TORCH_CHECK(t.dim() == 4 && t.size(0) == 1 && t.size(1) == kv_heads && t.size(3) == dim,
              "keys/values must be 1 x kv_heads x n x dim");
  TORCH_CHECK(t.stride(3) == 1 && t.size(2) > 0, "keys/values: contiguous last axis, n >= 1");
}

}  // namespace

at::Tensor attend_rows(const at::Tensor& q, const std::vector<at::Tensor>& keys,
                       const std::vector<at::Tensor>& values, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous() &&
              q.device().is_cpu(), "q must be rows x heads x dim, float32, contiguous, CPU");
  const int64_t R = q.size(0), H = q.size(1), D = q.size(2);
  TORCH_CHECK((int64_t)keys.size() == R && (int64_t)values.size() == R, "one K/V per row");
  TORCH_CHECK(R > 0, "no rows");
  const int64_t KVH = keys[0].size(1);
  TORCH_CHECK(KVH > 0 && H % KVH == 0, "heads must be a multiple of kv_heads");
  const int G = (int)(H / KVH);
  std::vector<const float*> kp(R), vp(R);
  std::vector<int64_t> n(R), k_head(R), v_head(R), k_step(R), v_step(R);
  int64_t max_n = 0;
  for (int64_t r = 0; r < R; ++r) {
    check_kv(keys[r], KVH, D);
    check_kv(values[r], KVH, D);
    TORCH_CHECK(keys[r].size(2) == values[r].size(2), "keys and values of a row differ in length");
    kp[r] = keys[r].data_ptr<float>();
    vp[r] = values[r].data_ptr<float>();
    n[r] = keys[r].size(2);
    k_head[r] = keys[r].stride(1);
    v_head[r] = values[r].stride(1);
    k_step[r] = keys[r].stride(2);
    v_step[r] = values[r].stride(2);
    max_n = std::max(max_n, n[r]);
  }
  at::Tensor out = at::empty_like(q);
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float sc = (float)scale;
  const Attend fixed = fixed_for((int)D, G);
  const int64_t items = R * KVH;
  std::atomic<int64_t> next{0};  // items are taken one at a time: rows differ in length
  on_team([&] {
    std::vector<float> s((size_t)G * max_n);
    for (int64_t w; (w = next.fetch_add(1, std::memory_order_relaxed)) < items;) {
      const int64_t r = w / KVH, h = w % KVH;
      const float* qg = qp + (r * H + h * G) * D;
      float* og = op + (r * H + h * G) * D;
      const float* k = kp[r] + h * k_head[r];
      const float* v = vp[r] + h * v_head[r];
      if (fixed != nullptr)
        fixed(qg, k, k_step[r], v, v_step[r], n[r], sc, s.data(), og);
      else
        attend_any(qg, G, (int)D, k, k_step[r], v, v_step[r], n[r], sc, s.data(), og);
    }
  });
  return out;
}

// The threads one kernel call runs on from the calling thread (1 in a build without OpenMP).
int64_t region_threads() {
  std::atomic<int64_t> entered{0};
  on_team([&] { entered.fetch_add(1); });
  return entered.load();
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("attend_rows", &attend_rows, "many decode rows' attention",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("region_threads", &region_threads, "threads one parallel region runs on",
        pybind11::call_guard<pybind11::gil_scoped_release>());
}
"""

_lock = threading.Lock()
_built: list[Any] = []  # [the module or None] once tried

# OpenMP first: without it every row runs on the calling thread. A compiler that lacks OpenMP
# gets that serial build, still one call for every row.
_FLAG_SETS: tuple[list[str], ...] = (["-fopenmp"], [])


def kernel() -> Any:
    """``attend_rows`` (see the module's contract), built on the first call (tens of seconds,
    then torch's cached build); None where it cannot be built. Safe from any thread."""
    module = _module()
    return None if module is None else module.attend_rows


def region_threads() -> int:
    """Threads one kernel call from the calling thread runs on (torch's count in that thread;
    1 in a build without OpenMP); 0 where no kernel is built."""
    module = _module()
    return 0 if module is None else int(module.region_threads())


def _module() -> Any:
    with _lock:
        if not _built:
            _built.append(_build())
        return _built[0]


def _build() -> Any:
    if os.environ.get("PROMPTCACHE_ROWS_KERNEL", "1") == "0":
        return None
    from torch.utils.cpp_extension import load_inline

    failure: Exception | None = None
    for flags in _FLAG_SETS:
        start = time.monotonic()
        try:
            # -ffast-math: the compiler may reorder the dot products' and exp's float sums (SIMD)
            module = load_inline(
                name="promptcache_rows_attention",
                cpp_sources=[_SOURCE],
                extra_cflags=["-O3", "-march=native", "-ffast-math", *flags],
                extra_ldflags=flags,
                verbose=False,
            )
        except Exception as exc:  # no compiler, no ninja, no OpenMP, a build error
            failure = exc
            continue
        took = time.monotonic() - start
        if took > 2:  # a build, not torch's cached one: once per machine and source
            log.info("built the decode rows' attention kernel in %.0f s", took)
        if not flags:
            log.warning("decode rows' attention kernel built without OpenMP: one thread")
        return module
    log.warning("decode rows' attention kernel not built (%s): one SDPA call per row", failure)
    return None
