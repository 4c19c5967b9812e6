"""The fused DAPO policy loss against the PyTorch reference: equality at a small size, and its timing and traffic.

What tools/bench_kernel.py and tools/preflight.py run; it lives above algorithm/ and kernels/, since it compares
the two. Per size N (rounded down to whole responses of seq_len tokens, with ragged padding): forward and forward+backward time (CUDA events, warm-up, median), bytes moved
against the floor (one read of each input + one write of the gradient), GB/s, and the fraction of the
device-to-device copy bandwidth (megatron_dapo.model.perf.copy_bandwidth_gbs) measured in the same run.
"""

from __future__ import annotations

import math
import os
from typing import Optional

import torch

from megatron_dapo.model.perf import cuda_time_ms

EPS_LOW, EPS_HIGH = 0.2, 0.28
SECTOR = 32  # bytes: the DRAM access granularity the traffic model counts in


def make_inputs(n: int, seq_len: int, dtype: torch.dtype, device, per_token_adv: bool, is_weight: bool, valid: float):
    """[B, T] inputs with ragged padding (each response a random length, `valid` of them on average)."""
    t = min(seq_len, n)
    b = max(1, n // t)
    gen = torch.Generator(device=device).manual_seed(0)
    old = torch.randn(b, t, device=device, generator=gen) * 2.0 - 3.0
    logp = (old + torch.randn(b, t, device=device, generator=gen) * 0.3).to(dtype)
    shape = (b, t) if per_token_adv else (b,)
    adv = torch.randn(shape, device=device, generator=gen)
    lengths = (torch.rand(b, device=device, generator=gen) * 2 * valid * t).long().clamp(1, t)
    mask = torch.arange(t, device=device)[None, :] < lengths[:, None]
    isw = torch.rand(b, t, device=device, generator=gen) * 2.0 if is_weight else None
    return logp, old, adv, mask, isw


# ----------------------------------------------------------------------------- equality check


def equality_check(
    device, dtypes=(torch.float32, torch.bfloat16), b: int = 8, t: int = 4099, seed: Optional[int] = None
) -> bool:
    """Kernel vs reference at a small size: loss, stats, both gradient paths. Prints one line each, with the seed of
    the random inputs (fresh unless given) so that a mismatch can be replayed."""
    from megatron_dapo.algorithm.policy_loss import STAT_KEYS, policy_loss
    from megatron_dapo.kernels import fused_policy_loss

    seed = int.from_bytes(os.urandom(4), "little") >> 1 if seed is None else seed
    torch.manual_seed(seed)
    print(f"  inputs: seed {seed}")
    ok = True
    for dtype in dtypes:
        logp, old, adv, mask, isw = make_inputs(b * t, t, dtype, device, per_token_adv=False, is_weight=True, valid=0.7)
        logp = logp + torch.where(torch.rand_like(old) < 0.1, torch.randn_like(old) * 2, 0).to(dtype)  # fire dual
        logp[~mask] = float("nan")  # padding must not leak
        kw = dict(dual_clip_c=3.0, is_weight=isw)
        lp_ref = logp.clone().requires_grad_()
        ref = policy_loss(lp_ref, old, adv, mask, EPS_LOW, EPS_HIGH, **kw)
        n_valid = float(ref.normalizer)
        (ref.loss_sum / n_valid).backward()
        r = torch.exp((logp.float() - old.float()).double())
        near = torch.zeros_like(mask)
        for kink in (1 - EPS_LOW, 1 + EPS_HIGH, 3.0):
            near |= (r / kink - 1).abs() < 1e-6
        near &= mask
        scale = torch.where(mask, adv.abs()[:, None] * (r + 1) * isw, 0).sum().item()
        for path, norm in (("separate bwd", None), ("fused grad", n_valid)):
            runs = []
            for _ in range(2):  # the same call twice: no atomics, so bit-identical (races show only on a GPU)
                lp = logp.clone().requires_grad_()
                out = fused_policy_loss(lp, old, adv, mask, EPS_LOW, EPS_HIGH, normalizer=norm, **kw)
                (out.loss_sum / n_valid).backward()
                runs.append((out.loss_sum, *out.stats.values(), lp.grad))
            repeat = all(torch.equal(a, b) for a, b in zip(*runs))
            loss_err = abs(out.loss_sum.item() - ref.loss_sum.item()) / max(scale, 1e-30)
            stat_err = max(
                abs(out.stats[k].item() - ref.stats[k].item()) / max(abs(ref.stats[k].item()), 1.0)
                for k in STAT_KEYS
                if k != "approx_kl_sum"
            )
            kl_scale = torch.where(mask, r + 1 + (logp.float() - old.float()).double().abs(), 0).sum().item()
            kl_err = abs(out.stats["approx_kl_sum"].item() - ref.stats["approx_kl_sum"].item()) / max(kl_scale, 1e-30)
            keep = ~near
            g, gr = lp.grad[keep].float(), lp_ref.grad[keep].float()
            grad_err = ((g - gr).abs() / gr.abs().clamp(min=1e-30)).masked_fill((g == gr), 0).max().item()
            grad_tol = 1e-6 if dtype == torch.float32 else 2**-7
            good = (
                loss_err <= 2e-6
                and stat_err <= 2e-6 + int(near.sum()) / max(n_valid, 1.0)
                and kl_err <= 2e-6
                and grad_err <= grad_tol
                and torch.isfinite(lp.grad).all().item()
                and repeat
            )
            ok &= good
            print(
                f"  equality {str(dtype).removeprefix('torch.'):9s} {path:12s}: loss {loss_err:.1e}, "
                f"stats {stat_err:.1e}, kl {kl_err:.1e}, grad {grad_err:.1e} (tol {grad_tol:.0e}), "
                f"{int(near.sum())} tokens at a clip boundary, repeat {'bit-identical' if repeat else 'DIFFERS'} -> "
                f"{'ok' if good else 'MISMATCH'}"
            )
            if not good:  # the worst token, to tell a wrong formula from a wrong read (replays of a seed have passed)
                rel = (lp.grad.float() - lp_ref.grad.float()).abs() / lp_ref.grad.float().abs().clamp(min=1e-30)
                i = int(torch.where(near | (lp.grad == lp_ref.grad), 0, rel).nan_to_num(0).argmax())
                print(
                    f"  worst token {i} of {mask.numel()}: mask {bool(mask.flatten()[i])}, logp {logp.flatten()[i].item()!r}, "
                    f"old {old.flatten()[i].item()!r}, ratio {r.flatten()[i].item()!r}, grad {lp.grad.flatten()[i].item()!r} "
                    f"vs {lp_ref.grad.flatten()[i].item()!r}; stats {[(k, out.stats[k].item(), ref.stats[k].item()) for k in STAT_KEYS]}"
                )
    return ok


# ----------------------------------------------------------------------------- traffic model and timing per size


def sector_bytes(mask_flat: torch.Tensor, elem: int) -> int:
    """Bytes of the 32-byte sectors of an [N] array (element size `elem`) holding a valid token."""
    per = SECTOR // elem
    n = mask_flat.numel()
    padded = torch.zeros(math.ceil(n / per) * per, dtype=torch.bool, device=mask_flat.device)
    padded[:n] = mask_flat
    return int(padded.view(-1, per).any(dim=1).sum()) * SECTOR


def traffic(logp, old, adv, mask, isw, block: int) -> dict[str, int]:
    """Bytes: the floor, and what the fused kernel reads with and without skipping padding."""
    n = logp.numel()
    per_token = [logp.element_size(), old.element_size()] + ([isw.element_size()] if isw is not None else [])
    adv_bytes = adv.numel() * adv.element_size()  # per response: B values, once
    if adv.dim() == 2:
        per_token.append(adv.element_size())
        adv_bytes = 0
    floor_reads = n * (sum(per_token) + 1) + adv_bytes  # +1: the mask
    flat = mask.reshape(-1)
    return {
        "floor_reads": floor_reads,
        "grad": n * logp.element_size(),
        "reads_skip_padding": n + adv_bytes + sum(sector_bytes(flat, e) for e in per_token),
        "reads_all": floor_reads,
        "partials": 2 * 8 * 8 * math.ceil(n / block),  # write + read of the fp64 partials
    }


def fused_bytes(t: dict[str, int], skip_padding: bool, phase: str) -> int:
    """What one fused variant moves: forward reads (+ gradient traffic for fwd+bwd)."""
    reads = t["reads_skip_padding"] if skip_padding else t["reads_all"]
    if phase == "fwd":
        return reads + t["partials"]
    if phase == "fwd+bwd separate":  # backward re-reads the inputs and writes the gradient
        return 2 * reads + t["partials"] + t["grad"]
    return reads + t["partials"] + 3 * t["grad"]  # fused: grad written; backward scales it (read + write)


def bench_size(n: int, args, copy_gbs: float, dtype: torch.dtype) -> list[dict]:
    """One row per implementation and phase at n tokens: ms, bytes (floor, moved), GB/s, speed-up over eager.

    args: tools/bench_kernel.py's flags (seq_len, per_token_adv, is_weight, valid, dual_clip, warmup, iters,
    no_compile); copy_gbs: the device's copy bandwidth, GB/s, the denominator of frac_copy_bw. Needs CUDA.
    """
    from megatron_dapo.algorithm.policy_loss import policy_loss
    from megatron_dapo.kernels import fused_policy_loss
    from megatron_dapo.kernels import ratio_clip_reduce as rcr

    logp, old, adv, mask, isw = make_inputs(
        n, args.seq_len, dtype, "cuda", args.per_token_adv, args.is_weight, args.valid
    )
    n = logp.numel()
    n_valid = float(mask.sum())
    kw = dict(dual_clip_c=args.dual_clip, is_weight=isw)
    lp = logp.clone().requires_grad_()
    t = traffic(logp, old, adv, mask, isw, rcr.GPU_BLOCK)
    floor = {"fwd": t["floor_reads"], "fwd+bwd": t["floor_reads"] + t["grad"]}

    def reference(x):
        out = policy_loss(x, old, adv, mask, EPS_LOW, EPS_HIGH, **kw)
        return out.loss_sum, out.stats

    def fused(x, norm=None):
        out = fused_policy_loss(x, old, adv, mask, EPS_LOW, EPS_HIGH, normalizer=norm, **kw)
        return out.loss_sum, out.stats

    def fwd(fn):
        return lambda: fn(logp)

    def fwd_bwd(fn):
        def run():
            lp.grad = None
            (fn(lp)[0] / n_valid).backward()  # the token-mean, as the trainer takes it

        return run

    def skipping(flag: bool, fn):
        def run():
            rcr.SKIP_PADDING_LOADS = flag
            try:
                fn()
            finally:
                rcr.SKIP_PADDING_LOADS = True

        return run

    cases = []  # (impl, phase, fn, moved bytes or None)
    for flag, tag in ((True, "skip-pad"), (False, "vec-load")):
        cases += [
            (f"fused[{tag}]", "fwd", skipping(flag, fwd(fused)), fused_bytes(t, flag, "fwd")),
            (
                f"fused[{tag}]/sep-bwd",
                "fwd+bwd",
                skipping(flag, fwd_bwd(fused)),
                fused_bytes(t, flag, "fwd+bwd separate"),
            ),
            (
                f"fused[{tag}]/fused-grad",
                "fwd+bwd",
                skipping(flag, fwd_bwd(lambda x: fused(x, n_valid))),
                fused_bytes(t, flag, "fwd+bwd fused"),
            ),
        ]
    cases += [("eager", "fwd", fwd(reference), None), ("eager", "fwd+bwd", fwd_bwd(reference), None)]
    if not args.no_compile:
        compiled = torch.compile(reference, dynamic=False)
        cases += [("compiled", "fwd", fwd(compiled), None), ("compiled", "fwd+bwd", fwd_bwd(compiled), None)]

    rows = []
    for impl, phase, fn, moved in cases:
        row = {"tokens": n, "valid": int(n_valid), "impl": impl, "phase": phase}
        row.update(floor_bytes=floor[phase], moved_bytes=moved)
        try:
            ms = cuda_time_ms(fn, args.warmup, args.iters)
        except Exception as exc:  # e.g. torch.compile unavailable: report, keep going
            row["error"] = f"{type(exc).__name__}: {exc}"[:200]
            rows.append(row)
            continue
        row["ms"] = ms
        row["floor_gbs"] = floor[phase] / (ms * 1e-3) / 1e9  # effective: floor bytes per second
        if moved is not None:
            row["moved_gbs"] = moved / (ms * 1e-3) / 1e9
            row["frac_copy_bw"] = row["moved_gbs"] / copy_gbs
        rows.append(row)
    for phase in ("fwd", "fwd+bwd"):
        eager = next((r.get("ms") for r in rows if r["impl"] == "eager" and r["phase"] == phase), None)
        for r in rows:
            if r["phase"] == phase and eager and r.get("ms"):
                r["speedup_vs_eager"] = eager / r["ms"]
    return rows
