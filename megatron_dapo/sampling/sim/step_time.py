"""Predict the paper-scale DAPO step time from measured per-GPU rates: a written-out back-of-the-envelope model.

    python tools/estimate_step_time.py --from-json bench.json           # rates from tools/bench_throughput.py
    python tools/estimate_step_time.py --decode-tokens-per-gpu-s 2000 --mfu 0.4 --peak-tflops 989 \\
        --sync-gb-per-s 10 --response-len 1000 3000 5000

Defaults are the paper's run (Yu et al. 2025, arXiv 2503.14476): Qwen2.5-32B, B = 512 prompts x G = 16
responses per rollout step, mini-batches of 512 responses (16 optimizer steps), responses up to 20480
tokens, 16 nodes x 8 GPUs, Megatron TP=8 PP=2 (so DP=8), vLLM TP=8 (16 engines), generation rounds of
1536 prompts (the trainer's sampler.gen_batch_size). The mean response length L is an input: the paper's
grows from about 1k tokens at the start to about 4-5k late in the run; the default 3000 is mid-run.
The mean prompt length P (default 200 tokens: a DAPO-Math-17K problem in its instruction template) is an
assumption too. Give several --response-len values to get one column each.

Symbols and units: n GPUs; E = n / vllm_tp rollout engines; dp = n / (tp pp); T = B G (P + L) tokens
through the policy per step (prompt + response); F = training model FLOPs per token at sequence P + L,
as tools/bench_train.py counts them: 6 N_mm + 6 layers (P + L) q_dim, with N_mm the matmul parameters a token
passes through (about 6 N_active: the second term is causal attention; a mixture of experts, --shape
qwen3-30b-a3b or qwen3-235b-a22b, counts its top-k experts and the router, not every expert); N the parameter
count, every expert included (the sync moves them all); A_train, A_fwd achieved model FLOP/s per GPU = MFU x
peak, or measured tokens/s per GPU x FLOPs per token (F for train, F / 3 forward).

  generate  = rounds x max(gen_batch G L / (n r_gpu),  L_max / r_seq)
              rounds = --gen-rounds, else B / (f gen_batch) with f the informative fraction: surplus
              informative groups carry over to the next step, so this is the average over steps.
              r_gpu: decode tokens/s per GPU at full batch (an engine's rate / vllm_tp).
              Long tail: a round lasts at least as long as its longest response takes to decode on its
              own (r_seq: single-sequence decode tokens/s, --seq-decode-tokens-per-s; the term is left
              out without it). Engines also slow down as the batch drains, so with long chains of
              thought the first term alone is optimistic: read it as a lower bound.
  old_logp  = T (F / 3) / (n A_fwd) x (m_f + pp - 1) / m_f      forward only: 2 N FLOPs per token
  train     = T F c / (n A_train) x (m + pp - 1) / m           c = --recompute-factor (full recompute: 4/3)
              pipeline bubble (pp - 1) / (m + pp - 1): m = ceil((mini_batch / dp) (P + L) / mb_tokens)
              micro-batches per pipeline per optimizer step; m_f the same for all B G responses (one pass)
  sync      = 2 N / sync_bw                                    bf16 weights; every rank receives them all
  step      = generate + old_logp + train + sync               colocated: the phases run one after another

The measured MFU is taken as free of pipeline bubbles (a pp=1 run) and of recompute (unless c says so);
what TP=8 communication costs beyond it is not modelled, nor are prompt prefill, reward scoring (about
0.25 s a step with the DAPO rule, benchmarks/RESULTS.md), optimizer steps and vLLM sleep/wake.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path

from megatron_dapo.cli import argument_parser
from megatron_dapo.model.perf import SHAPES, active_param_count, model_flops_per_token, param_count, shape_arch

# bench_throughput JSON key for each rate, and the flag that gives it instead
JSON_RATES = {
    "decode": (
        "rollout_tokens_per_s_per_device",
        "--decode-tokens-per-gpu-s or --decode-tokens-per-engine-s",
        "rollout",
    ),
    "mfu": ("mfu", "--mfu or --train-tokens-per-gpu-s", "train"),
    "logprob_mfu": ("logprob_mfu", "--logprob-mfu or --logprob-tokens-per-gpu-s", "train"),
    "peak": ("peak_tflops_per_device", "--peak-tflops", "train"),
    "sync": ("sync_gb_per_s", "--sync-gb-per-s", "sync"),
}


class EstimateError(ValueError):
    """An input the estimate cannot use: the message names it and what was expected."""


@dataclass(frozen=True)
class StepInputs:
    """One step's sizes, layout and per-GPU rates (see the module docstring for the symbols)."""

    flops_per_token: float  # F: training model FLOPs per token at sequence prompt_len + response_len (active params)
    params: float  # N, every parameter (a mixture of experts: every expert)
    decode_tokens_per_gpu_s: float  # r_gpu
    train_flops_per_gpu_s: float  # A_train, FLOP/s
    logprob_flops_per_gpu_s: float  # A_fwd, FLOP/s
    sync_gb_per_s: float
    response_len: float = 3000  # L, tokens
    prompt_len: float = 200  # P, tokens
    max_response_len: int = 20480  # L_max, tokens
    prompts: int = 512  # B
    group: int = 16  # G
    gpus: int = 128  # n
    tp: int = 8
    pp: int = 2
    vllm_tp: int = 8
    mini_batch: int = 512  # responses per optimizer step
    microbatch_tokens: int = 16384
    gen_batch: int = 1536  # prompts per generation round
    informative_frac: float = 1.0  # f
    gen_rounds: float | None = None  # overrides B / (f gen_batch)
    seq_decode_tokens_per_s: float | None = None  # r_seq, for the long-tail bound
    recompute_factor: float = 1.0  # c


def estimate(i: StepInputs) -> dict[str, float]:
    """Seconds per phase and per step, with the intermediate counts the formulas use."""
    if i.gpus % (i.tp * i.pp) or i.gpus % i.vllm_tp:
        raise EstimateError(
            f"{i.gpus} GPUs: expected a multiple of tp x pp = {i.tp * i.pp} and of vllm_tp = {i.vllm_tp}"
        )
    dp = i.gpus // (i.tp * i.pp)
    seq = i.prompt_len + i.response_len
    rounds = i.gen_rounds if i.gen_rounds is not None else i.prompts / (i.informative_frac * i.gen_batch)
    round_s = i.gen_batch * i.group * i.response_len / (i.gpus * i.decode_tokens_per_gpu_s)
    tail_s = i.max_response_len / i.seq_decode_tokens_per_s if i.seq_decode_tokens_per_s else 0.0
    tokens = i.prompts * i.group * seq
    m = max(1, math.ceil(i.mini_batch / dp * seq / i.microbatch_tokens))
    m_f = max(1, math.ceil(i.prompts * i.group / dp * seq / i.microbatch_tokens))
    old_logp = tokens * i.flops_per_token / 3 / (i.gpus * i.logprob_flops_per_gpu_s) * (m_f + i.pp - 1) / m_f
    train = tokens * i.flops_per_token * i.recompute_factor / (i.gpus * i.train_flops_per_gpu_s) * (m + i.pp - 1) / m
    sync = 2 * i.params / (i.sync_gb_per_s * 1e9)
    generate = rounds * max(round_s, tail_s)
    return {
        "rounds": rounds,
        "generated_tokens": rounds * i.gen_batch * i.group * i.response_len,
        "long_tail_bound": float(tail_s > round_s),
        "train_tokens": tokens,
        "micro_batches": m,
        "bubble": (i.pp - 1) / (m + i.pp - 1),
        "generate_s": generate,
        "old_logp_s": old_logp,
        "train_s": train,
        "sync_s": sync,
        "step_s": generate + old_logp + train + sync,
    }


def _as_positive(value) -> float | None:
    """value as a finite float > 0, else None."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) and v > 0 else None


def _flag(text: str) -> float:
    v = _as_positive(text)
    if v is None:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a finite number > 0")
    return v


def _count(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        v = 0
    if v < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected an integer >= 1")
    return v


def _rate(args, data: dict | None, name: str, flag_value: float | None, missing: list[str]) -> tuple[float, str]:
    """A rate from its flag, else from the bench JSON; (value, where it came from). A rate neither gives is added
    to `missing` (what to pass for it) and comes back as nan, so one error can name every missing rate."""
    if flag_value is not None:
        return flag_value, "given"
    key, flags, part = JSON_RATES[name]
    if data is None:
        missing.append(f"{name} ({flags})")
        return float("nan"), "missing"
    if key not in data:
        skipped = data.get("skipped", {}).get(part)
        why = f", its {part} part was skipped: {skipped}" if skipped else ""
        missing.append(f"{name} ({args.from_json} has no field '{key}'{why}; pass {flags})")
        return float("nan"), "missing"
    v, fraction = _as_positive(data[key]), name.endswith("mfu")
    if v is None or (fraction and v > 1):
        expected = "a fraction in (0, 1]" if fraction else "a finite number > 0"
        raise EstimateError(f"{args.from_json} field '{key}' = {data[key]!r}: expected {expected}")
    return v, f"from {Path(args.from_json).name}"


def build_inputs(args) -> tuple[list[StepInputs], list[str]]:
    """One StepInputs per --response-len, and a line per rate saying where it came from."""
    data = None
    if args.from_json:
        try:
            data = json.loads(Path(args.from_json).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise EstimateError(f"--from-json {args.from_json}: cannot read it as JSON ({e})") from None
        if not isinstance(data, dict):
            raise EstimateError(f"--from-json {args.from_json}: expected a JSON object (bench_throughput --json)")
    arch = shape_arch(args.shape, int(args.prompt_len + max(args.response_len)))
    missing: list[str] = []
    if args.decode_tokens_per_engine_s is not None:
        decode, decode_src = args.decode_tokens_per_engine_s / args.vllm_tp, "given per engine"
    else:
        decode, decode_src = _rate(args, data, "decode", args.decode_tokens_per_gpu_s, missing)
    sync, sync_src = _rate(args, data, "sync", args.sync_gb_per_s, missing)
    notes = [f"decode {decode:,.1f} tokens/s per GPU ({decode_src})", f"sync {sync:,.3f} GB/s ({sync_src})"]
    train_by_mfu = args.train_tokens_per_gpu_s is None
    fwd_given = args.logprob_mfu is not None or args.logprob_tokens_per_gpu_s is not None
    fwd_from_json = train_by_mfu and not fwd_given and data is not None and "logprob_mfu" in data
    mfu = logprob_mfu = peak = None
    if train_by_mfu or args.logprob_mfu is not None or fwd_from_json:
        peak, src = _rate(args, data, "peak", args.peak_tflops, missing)
        notes.append(f"peak {peak:,.3f} TFLOP/s per GPU ({src})")
    if train_by_mfu:
        mfu, src = _rate(args, data, "mfu", args.mfu, missing)
        notes.append(f"train MFU {mfu:.4f} ({src})")
    else:
        notes.append(f"train {args.train_tokens_per_gpu_s:,.1f} tokens/s per GPU (given)")
    if args.logprob_tokens_per_gpu_s is not None:
        notes.append(f"old-logprob {args.logprob_tokens_per_gpu_s:,.1f} tokens/s per GPU (given)")
    elif args.logprob_mfu is not None or fwd_from_json:
        logprob_mfu, src = _rate(args, data, "logprob_mfu", args.logprob_mfu, missing)
        notes.append(f"old-logprob MFU {logprob_mfu:.4f} ({src})")
    else:
        notes.append("old-logprob forward at the train step's FLOP/s (no rate of its own given)")
    if missing:
        source = "" if data is not None else ", or --from-json with a bench_throughput result"
        raise EstimateError(f"{len(missing)} rate(s) missing: " + "; ".join(missing) + source)

    out = []
    for length in args.response_len:
        f = model_flops_per_token(arch, int(args.prompt_len + length))
        a_train = mfu * peak * 1e12 if train_by_mfu else args.train_tokens_per_gpu_s * f
        if args.logprob_tokens_per_gpu_s is not None:
            a_fwd = args.logprob_tokens_per_gpu_s * f / 3
        else:
            a_fwd = logprob_mfu * peak * 1e12 if logprob_mfu is not None else a_train
        out.append(
            StepInputs(
                flops_per_token=f,
                params=param_count(arch),
                decode_tokens_per_gpu_s=decode,
                train_flops_per_gpu_s=a_train,
                logprob_flops_per_gpu_s=a_fwd,
                sync_gb_per_s=sync,
                response_len=length,
                prompt_len=args.prompt_len,
                max_response_len=args.max_response_len,
                prompts=args.prompts,
                group=args.group,
                gpus=args.nodes * args.gpus_per_node,
                tp=args.tp,
                pp=args.pp,
                vllm_tp=args.vllm_tp,
                mini_batch=args.mini_batch,
                microbatch_tokens=args.microbatch_tokens,
                gen_batch=args.gen_batch,
                informative_frac=args.informative_frac,
                gen_rounds=args.gen_rounds,
                seq_decode_tokens_per_s=args.seq_decode_tokens_per_s,
                recompute_factor=args.recompute_factor,
            )
        )
    return out, notes


ROWS = (  # (key, label, format)
    ("rounds", "generation rounds", "{:.3f}"),
    ("generated_tokens", "generated tokens (M)", "{:.1f}"),
    ("train_tokens", "policy tokens T (M)", "{:.1f}"),
    ("micro_batches", "micro-batches m", "{:.0f}"),
    ("bubble", "pipeline bubble", "{:.1%}"),
    ("generate_s", "generate s", "{:,.1f}"),
    ("old_logp_s", "old_logp s", "{:,.1f}"),
    ("train_s", "train s", "{:,.1f}"),
    ("sync_s", "sync s", "{:,.1f}"),
    ("step_s", "step s", "{:,.1f}"),
)


def table(inputs: list[StepInputs], results: list[dict[str, float]], title: str, notes: list[str]) -> str:
    """Rows: counts and seconds per phase; one column per mean response length."""
    lines = [title, *[f"  {n}" for n in notes]]
    lines.append(f"{'':<22}" + "".join(f"{f'L={i.response_len:g}':>14}" for i in inputs))
    for key, label, fmt in ROWS:
        scale = 1e-6 if key.endswith("tokens") else 1.0
        lines.append(f"{label:<22}" + "".join(f"{fmt.format(r[key] * scale):>14}" for r in results))
    bound = [f"L={i.response_len:g}" for i, r in zip(inputs, results) if r["long_tail_bound"]]
    if bound:
        lines.append(
            f"generate is bound by the longest response ({inputs[0].max_response_len} tokens) at {', '.join(bound)}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict[str, float]]:
    ap = argument_parser(__doc__)
    ap.add_argument("--from-json", default=None, help="rates from a tools/bench_throughput.py --json file")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-32b")
    size = ap.add_argument_group("step size (the paper's by default)")
    size.add_argument("--prompts", type=_count, default=512, help="B: prompts per rollout step")
    size.add_argument("--group", type=_count, default=16, help="G: responses per prompt")
    size.add_argument("--prompt-len", type=_flag, default=200, help="P: mean prompt tokens")
    size.add_argument("--response-len", type=_flag, nargs="+", default=[3000], help="L: mean response tokens")
    size.add_argument("--max-response-len", type=_count, default=20480, help="L_max, for the long-tail bound")
    size.add_argument("--mini-batch", type=_count, default=512, help="responses per optimizer step")
    size.add_argument("--microbatch-tokens", type=_count, default=16384, help="train.max_tokens_per_microbatch")
    size.add_argument("--gen-batch", type=_count, default=1536, help="prompts per generation round")
    rounds = size.add_mutually_exclusive_group()
    rounds.add_argument("--informative-frac", type=_flag, default=1.0, help="f: fraction of groups kept")
    rounds.add_argument("--gen-rounds", type=_flag, default=None, help="generation rounds per step, measured")
    lay = ap.add_argument_group("layout")
    lay.add_argument("--nodes", type=_count, default=16)
    lay.add_argument("--gpus-per-node", type=_count, default=8)
    lay.add_argument("--tp", type=_count, default=8)
    lay.add_argument("--pp", type=_count, default=2)
    lay.add_argument("--vllm-tp", type=_count, default=8, help="tensor parallel of each vLLM engine")
    rates = ap.add_argument_group("measured rates (flags win over --from-json)")
    dec = rates.add_mutually_exclusive_group()
    dec.add_argument("--decode-tokens-per-gpu-s", type=_flag, help="r_gpu: generated tokens/s per GPU")
    dec.add_argument("--decode-tokens-per-engine-s", type=_flag, help="generated tokens/s per vLLM engine")
    rates.add_argument("--seq-decode-tokens-per-s", type=_flag, help="r_seq: one sequence's decode tokens/s")
    train = rates.add_mutually_exclusive_group()
    train.add_argument("--mfu", type=_flag, help="train step MFU (0-1), with --peak-tflops")
    train.add_argument("--train-tokens-per-gpu-s", type=_flag, help="train tokens/s per GPU at this model and length")
    rates.add_argument("--peak-tflops", type=_flag, help="peak dense TFLOP/s per GPU (H100 SXM bf16: 989)")
    fwd = rates.add_mutually_exclusive_group()
    fwd.add_argument("--logprob-mfu", type=_flag, help="old-logprob forward MFU (default: the train rate)")
    fwd.add_argument("--logprob-tokens-per-gpu-s", type=_flag, help="old-logprob tokens/s per GPU")
    rates.add_argument("--sync-gb-per-s", type=_flag, help="weight-sync GB/s (the bridge's, end to end)")
    rates.add_argument("--recompute-factor", type=_flag, default=1.0, help="c: 4/3 with full recompute")
    args = ap.parse_args(argv)
    for flag in ("informative_frac", "mfu", "logprob_mfu"):
        if (getattr(args, flag) or 0) > 1:
            ap.error(f"--{flag.replace('_', '-')} = {getattr(args, flag)}: expected a fraction in (0, 1]")
    try:
        inputs, notes = build_inputs(args)
        results = [estimate(i) for i in inputs]
    except EstimateError as e:
        ap.error(str(e))
    i = inputs[0]
    arch = shape_arch(args.shape)
    active = active_param_count(arch)
    params = f"{i.params / 1e9:.1f} B params" + (f" ({active / 1e9:.1f} B active)" if active != i.params else "")
    title = (
        f"{args.shape}: {params}; {i.prompts} prompts x {i.group} responses; "
        f"{args.nodes} nodes x {args.gpus_per_node} GPUs, tp{i.tp} pp{i.pp} dp{i.gpus // (i.tp * i.pp)}, "
        f"vLLM tp{i.vllm_tp} ({i.gpus // i.vllm_tp} engines); prompt {i.prompt_len:g} tokens"
    )
    print(table(inputs, results, title, notes))
    return results
