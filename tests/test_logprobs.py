"""model/logprobs.py (token logprobs and entropy in one chunked pass over vocab-parallel logits) against float64.

The references are written out here: log_softmax of logits / T in float64 over the real vocabulary (padded columns
dropped), entropy = -sum p log p in float64, and the gradient from autograd through that float64 log_softmax.
Fresh random inputs from each test's seed. No Megatron: tensor parallel runs on a plain 2-process gloo group.

Tolerances: the pass computes in float32 from the exact logits (bf16 ones upcast exactly), so logp and entropy are
within 1e-5 of float64 (logits of a few units; huge logits: relative to their size); the gradient is within 1e-6
in float32, and for bf16 logits one bf16 rounding of it (relative 2^-8).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from megatron_dapo.model import logprobs
from megatron_dapo.model.comm import Comm
from megatron_dapo.model.logprobs import vocab_parallel_logprobs
from megatron_dapo.model.parallel import world_layout

PADDING_VALUE = 40.0  # padded columns hold logits far above the real ones: counting them changes every result


def inputs(g: torch.Generator, b: int, t: int, width: int, vocab_size: int, dtype: torch.dtype, scale: float = 3.0):
    """(logits [b, t, width] of dtype, the columns from vocab_size on at PADDING_VALUE; targets [b, t] < vocab_size;
    upstream gradient [b, t] float32)."""
    logits = torch.randn(b, t, width, generator=g) * scale
    logits[..., vocab_size:] = PADDING_VALUE
    targets = torch.randint(0, vocab_size, (b, t), generator=g)
    return logits.to(dtype), targets, torch.randn(b, t, generator=g)


def reference(logits: torch.Tensor, targets: torch.Tensor, temperature: float, vocab_size: int, grad: torch.Tensor):
    """float64 (logp, entropy, d(sum grad * logp)/d logits) over the first vocab_size columns; padded columns get 0."""
    x = logits.detach().double().requires_grad_()
    logp_all = torch.log_softmax(x[..., :vocab_size] / temperature, dim=-1)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    p = logp_all.exp()
    entropy = -(p * logp_all).sum(-1)
    (logp * grad.double()).sum().backward()
    return logp.detach(), entropy.detach(), x.grad


def check(logits, targets, temperature, vocab_size, grad, atol=1e-5, entropy_atol=1e-5, grad_atol=1e-6, rtol=0.0):
    """vocab_parallel_logprobs against the float64 reference: first without autograd (compute_logprobs's
    forward-only pass), its values checked before any backward runs; then with autograd (the train step's): the
    very same values, a non-differentiable entropy, and the gradient of sum(grad * logp) in the logits' dtype."""
    want = reference(logits, targets, temperature, vocab_size, grad)
    with torch.no_grad():
        logp, entropy = vocab_parallel_logprobs(logits, targets, temperature, vocab_size, with_entropy=True)
    assert logp.dtype == entropy.dtype == torch.float32 and logp.shape == entropy.shape == targets.shape
    assert torch.isfinite(logp).all() and torch.isfinite(entropy).all()
    torch.testing.assert_close(logp.double(), want[0], rtol=rtol, atol=atol)
    torch.testing.assert_close(entropy.double(), want[1], rtol=0, atol=entropy_atol)
    x = logits.detach().clone().requires_grad_()
    logp_ad, entropy_ad = vocab_parallel_logprobs(x, targets, temperature, vocab_size, with_entropy=True)
    assert logp_ad.requires_grad and not entropy_ad.requires_grad  # the entropy is a metric
    assert torch.equal(logp_ad.detach(), logp) and torch.equal(entropy_ad, entropy)
    (logp_ad * grad).sum().backward()
    assert x.grad.dtype == logits.dtype and torch.isfinite(x.grad).all()
    assert_grad_close(x.grad, want[2], atol=grad_atol)
    assert torch.all(x.grad[..., vocab_size:] == 0)  # padded columns: no gradient


def assert_grad_close(got: torch.Tensor, want: torch.Tensor, atol: float = 1e-6) -> None:
    rtol = 2.0**-8 if got.dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got.double(), want, rtol=rtol, atol=atol)


def chunk_rows(monkeypatch, rows: int, valid: int) -> None:
    """Chunks of `rows` rows of `valid` real columns (CHUNK_ELEMENTS rounds down to whole rows)."""
    monkeypatch.setattr(logprobs, "CHUNK_ELEMENTS", rows * valid + valid - 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("pad", [0, 5], ids=["full-vocab", "padded"])
def test_logprobs_entropy_and_gradient_match_float64(seed, monkeypatch, dtype, temperature, pad):
    """15 rows in uneven chunks of 4, 4, 4, 3; with pad, the last 5 of 29 columns are padding."""
    g = torch.Generator().manual_seed(seed)
    width = 29
    logits, targets, grad = inputs(g, 3, 5, width, width - pad, dtype)
    chunk_rows(monkeypatch, 4, width - pad)
    check(logits, targets, temperature, width - pad, grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_one_token(seed, dtype):
    g = torch.Generator().manual_seed(seed)
    logits, targets, grad = inputs(g, 1, 1, 50, 47, dtype)
    check(logits, targets, 0.7, 47, grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_huge_logits_do_not_overflow(seed, monkeypatch, dtype):
    """Logits of magnitude ~1e4 (exp overflows float32 past 88): finite, and float64's values up to the float32
    rounding of z = logits / T (delta = 2^-24 |z| each, ~1e-3 here): logp within 4 delta; the entropy and the
    softmax in the gradient move by a few delta (times |grad| / T) where two logits lie within a few units."""
    g = torch.Generator().manual_seed(seed)
    logits, targets, grad = inputs(g, 2, 7, 33, 30, dtype, scale=1e4)
    chunk_rows(monkeypatch, 3, 30)
    atol = 4 * 2.0**-24 * float(logits.abs().max()) / 0.7
    grad_atol = 2 * atol * float(grad.abs().max()) / 0.7
    check(logits, targets, 0.7, 30, grad, atol, 4 * atol, grad_atol, rtol=1e-6)


def test_entropy_only_when_asked(seed, monkeypatch):
    """Without with_entropy: no entropy returned, and the pass does less work over the logits (fewer [rows, V]
    float32 operations), with the same logprobs and gradient."""
    from torch.overrides import TorchFunctionMode

    g = torch.Generator().manual_seed(seed)
    logits, targets, grad = inputs(g, 2, 6, 24, 21, torch.bfloat16)
    chunk_rows(monkeypatch, 5, 21)

    class FullWidthOps(TorchFunctionMode):
        """Counts the calls that return a float32 tensor as wide as the real vocabulary (a pass over a chunk)."""

        def __init__(self):
            super().__init__()
            self.count = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and out.dtype == torch.float32 and out.dim() == 2 and out.shape[1] == 21:
                self.count += 1
            return out

    results = {}
    for asked in (False, True):
        x = logits.clone().requires_grad_()
        with FullWidthOps() as mode:
            logp, entropy = vocab_parallel_logprobs(x, targets, 1.0, 21, with_entropy=asked)
        (logp * grad).sum().backward()
        results[asked] = (logp.detach(), entropy, x.grad, mode.count)
    assert results[False][1] is None and results[True][1] is not None
    assert torch.equal(results[False][0], results[True][0]) and torch.equal(results[False][2], results[True][2])
    assert 0 < results[False][3] < results[True][3]  # 3 chunks: 9 full-width ops without the entropy, 12 with


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_saved_for_backward_is_the_logits_and_row_vectors(seed, monkeypatch, dtype):
    """What autograd keeps between forward and backward, counted with saved_tensors_hooks (each storage once):
    at most the logits' own bytes (the very storage, not a copy) + 16 bytes per row (the float32 logsumexp: 4, the
    int64 targets: 8, 4 to spare), and no float32 [N, V] tensor besides the logits themselves: neither saved nor
    kept alive another way (an attribute of the backward node: found with gc, which sees such tensors)."""
    import gc

    g = torch.Generator().manual_seed(seed)
    b, t, width, vocab = 4, 16, 384, 380
    logits, targets, grad = inputs(g, b, t, width, vocab, dtype)
    chunk_rows(monkeypatch, 8, vocab)
    x = logits.clone().requires_grad_()
    saved: list[torch.Tensor] = []

    def large() -> dict[int, torch.Tensor]:  # tensors of at least [N, V] ending in V or the hidden width, by id
        return {
            id(o): o
            for o in gc.get_objects()
            if issubclass(type(o), torch.Tensor)  # type(): isinstance would touch deprecated proxies
            and o.layout == torch.strided
            and o.numel() >= b * t * vocab
            and o.shape[-1] in (vocab, width)
        }

    before = large()  # what earlier tests keep (the shared Megatron launch's results), held: no id reused

    def pack(tensor):
        saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        logp, entropy = vocab_parallel_logprobs(x, targets, 0.7, vocab, with_entropy=True)
    storages = {s.untyped_storage().data_ptr(): s.untyped_storage().nbytes() for s in saved}
    n = b * t
    logits_storage = x.untyped_storage().data_ptr()
    assert logits_storage in storages  # saved by reference
    assert sum(storages.values()) <= x.untyped_storage().nbytes() + 16 * n, [(s.dtype, s.shape) for s in saved]
    for s in saved:
        if s.untyped_storage().data_ptr() != logits_storage:
            assert s.numel() <= n, (s.dtype, s.shape)  # per-row vectors only
    inputs_storage = {logits.untyped_storage().data_ptr(), logits_storage}
    alive = [
        (o.dtype, tuple(o.shape))
        for i, o in large().items()
        if i not in before and o.untyped_storage().data_ptr() not in inputs_storage
    ]
    assert alive == []
    (logp * grad).sum().backward()
    assert x.grad is not None and x.grad.dtype == dtype


# ------------------------------------------------------------------ tensor parallel: 2 processes, gloo

TP_CASES = [  # (vocab_size, dtype, temperature) over 2 ranks of PART columns each
    (27, torch.float32, 0.7),  # rank 1: 11 real columns, 5 padded
    (27, torch.bfloat16, 1.0),
    (13, torch.float32, 1.0),  # rank 1: no real column at all
    (13, torch.bfloat16, 0.7),
]
PART = 16


def _tp_rank(rank: int, store_path: str, out: str, cases: list) -> None:
    torch.set_num_threads(1)  # a forked child: no OpenMP pool of the parent's
    store = dist.FileStore(store_path, 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    reduces = []
    all_reduce = dist.all_reduce

    def counted(tensor, *args, **kwargs):
        reduces.append(tuple(tensor.shape))
        return all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = counted
    logprobs.CHUNK_ELEMENTS = 3 * PART  # 3-row chunks of 10 rows: several chunks, one set of all-reduces
    comm = Comm(replace(world_layout(rank, 2), tp=2, dp=1, tp_rank=rank, dp_rank=0))  # the world is the TP group
    results = []
    try:
        for logits, targets, grad, vocab_size, temperature in cases:
            reduces.clear()
            x = logits[..., rank * PART : (rank + 1) * PART].clone().requires_grad_()
            logp, entropy = vocab_parallel_logprobs(x, targets, temperature, vocab_size, comm, True)
            (logp * grad).sum().backward()
            results.append({"logp": logp.detach(), "entropy": entropy, "grad": x.grad, "reduces": list(reduces)})
    finally:
        dist.all_reduce = all_reduce
        dist.destroy_process_group()
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))


def test_tensor_parallel_over_gloo_matches_unsplit_float64(seed, tmp_path):
    """Two ranks, each holding half the padded vocabulary columns, agree with the unsplit float64 reference; the
    gradient of each rank is its slice of the full one; two all-reduces of [N]-vectors per call, however many
    chunks."""
    import torch.multiprocessing as mp

    g = torch.Generator().manual_seed(seed)
    cases = []
    for vocab_size, dtype, temperature in TP_CASES:
        logits, targets, grad = inputs(g, 2, 5, 2 * PART, vocab_size, dtype)
        cases.append((logits, targets, grad, vocab_size, temperature))
    mp.start_processes(
        _tp_rank, args=(str(tmp_path / "store"), str(tmp_path), cases), nprocs=2, join=True, start_method="fork"
    )
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for i, (logits, targets, grad, vocab_size, temperature) in enumerate(cases):
        want = reference(logits, targets, temperature, vocab_size, grad)
        for r in range(2):
            got = ranks[r][i]
            what = f"case {i} rank {r}"
            torch.testing.assert_close(got["logp"].double(), want[0], rtol=0, atol=1e-5, msg=what)
            torch.testing.assert_close(got["entropy"].double(), want[1], rtol=0, atol=1e-5, msg=what)
            assert_grad_close(got["grad"], want[2][..., r * PART : (r + 1) * PART])
            assert got["reduces"] == [(10,), (3, 10)], what  # the max; the sums with the target logit
