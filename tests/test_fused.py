"""Sibling projections stacked into one matmul (torch.fused): the same parameters under the same
keys, the logits of the unstacked model, and the right rows whatever order siblings are called."""

import copy
import threading

import pytest

torch = pytest.importorskip("torch")

from promptcache.engines.torch.fused import StackedLinear, fuse_projections  # noqa: E402
from promptcache.engines.torch.onednn import (  # noqa: E402
    OneDnnLinear,
    can_use_onednn,
    use_onednn_linears,
)
from promptcache.engines.torch.threads import ThreadTuner  # noqa: E402
from promptcache.testing.tiny_families import build_family  # noqa: E402
from promptcache.testing.tiny_models import tiny_model  # noqa: E402

pytestmark = [
    pytest.mark.torch,
    pytest.mark.skipif(
        not can_use_onednn(tiny_model("llama")), reason="no oneDNN linear in this torch build"
    ),
]


# llama: q/k/v + gate/up; gpt_oss: biased q/k/v, MoE experts (not linears); qwen3_moe: MoE
# with per-expert linears; qwen3_5: linear-attention layers beside full attention
@pytest.mark.parametrize("family", ["llama", "gpt_oss", "qwen3_moe", "qwen3_5"])
def test_stacking_keeps_parameters_and_logits(family):
    plain, _ = build_family(family)
    use_onednn_linears(plain)
    model = copy.deepcopy(plain)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert fuse_projections(model) > 0
    assert fuse_projections(model) == 0  # idempotent
    after = model.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], v) for k, v in before.items())
    stacked = [m for m in model.modules() if isinstance(m, StackedLinear)]
    assert stacked
    # every sibling's weight is a view into its group's stack: no second copy of the weights
    for m in stacked:
        assert m.weight.data_ptr() == m.stack.weight[m.start].data_ptr()
    ids = torch.randint(3, 300, (1, 29), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want, got = plain(input_ids=ids).logits, model(input_ids=ids).logits
    assert (want - got).abs().max().item() < 1e-4
    assert torch.equal(want.argmax(-1), got.argmax(-1))


def test_a_sibling_fed_another_input_gets_its_own_rows():
    torch.manual_seed(0)
    module = torch.nn.Module()
    for name, rows in (("q_proj", 12), ("k_proj", 4), ("v_proj", 4)):
        setattr(module, name, OneDnnLinear(torch.nn.Linear(8, rows, bias=True)))
    want = {
        n: (module.get_submodule(f"{n}_proj").weight.clone(), module.get_submodule(f"{n}_proj").bias.clone())
        for n in "qkv"
    }  # fmt: skip
    assert fuse_projections(module) == 1
    x1, x2 = torch.randn(3, 8), torch.randn(3, 8)

    def ref(n: str, x: torch.Tensor) -> torch.Tensor:
        w, b = want[n]
        return torch.nn.functional.linear(x, w, b)

    with torch.inference_mode():
        # an order no model uses, a repeat, and a sibling between two inputs
        calls = [("k", x1), ("q", x1), ("q", x1), ("v", x2), ("k", x2), ("v", x1), ("q", x2)]
        for n, x in calls:
            got = module.get_submodule(f"{n}_proj")(x)
            assert torch.allclose(got, ref(n, x), atol=1e-5), (n, calls)


def test_fixed_threads_are_set_in_every_thread_that_runs_forwards():
    calls: list[tuple[str, int]] = []
    tuner = ThreadTuner(
        2, cores=2, set_threads=lambda n: calls.append((threading.current_thread().name, n))
    )
    tuner.apply()
    tuner.apply()
    worker = threading.Thread(target=lambda: (tuner.apply(), tuner.apply()), name="steps")
    worker.start()
    worker.join()
    assert calls == [(threading.current_thread().name, 2), ("steps", 2)]


def test_background_threads_run_torch_on_one_thread():
    """A torch engine's hook: the threads promptcache starts (writers, readers, the generation
    executor) run torch ops on one thread, so only the stepping thread keeps an OpenMP team."""
    from concurrent.futures import ThreadPoolExecutor

    from promptcache.core.worker_threads import add_start_hook, start_thread, worker_initializer
    from promptcache.engines.torch.threads import hold_one_thread

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)  # what the stepping thread sets on a 2-core machine
        plain: list[int] = []
        thread = threading.Thread(target=lambda: plain.append(torch.get_num_threads()))
        thread.start()
        thread.join()
        assert plain == [2]  # a new thread starts at the count last set anywhere
        add_start_hook(hold_one_thread)
        add_start_hook(hold_one_thread)  # once only
        got: list[int] = []
        start_thread(lambda: got.append(torch.get_num_threads()), "promptcache-test").join()
        with ThreadPoolExecutor(1, initializer=worker_initializer) as pool:
            got.append(pool.submit(torch.get_num_threads).result())
        assert got == [1, 1]
    finally:
        torch.set_num_threads(before)
