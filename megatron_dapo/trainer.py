"""The DAPO loop: rollout -> rewards -> informative filter -> old logprobs -> mini-batch updates -> weight sync.

One rollout step: the dynamic-sampling loader collects `sampler.train_batch_size` informative
groups of `algorithm.group_size` responses from the colocated vLLM engine; each group's shaped
rewards become advantages; the policy recomputes the sampling policy's logprobs (old_logp)
once, then takes one optimizer step per mini-batch of `optim.mini_batch_size` responses (16
with the paper's sizes); the bridge then streams the new weights into the engine. Rollout
steps, optimizer steps and generation rounds are counted apart; the LR schedule follows
optimizer steps.

This version runs the rollout on a single data-parallel replica (data parallel size 1; any TP
or PP inside the policy); spreading generation over data-parallel replicas comes with the
multi-node work.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch

from megatron_dapo.algorithm import group_advantages
from megatron_dapo.checkpoint import CheckpointManager
from megatron_dapo.config import Config, ConfigError
from megatron_dapo.data.dynamic_sampling import DynamicSamplingLoader
from megatron_dapo.data.types import Group, Prompt, Response
from megatron_dapo.model.policy import TrainSample

log = logging.getLogger("megatron_dapo.trainer")


def samples_from_groups(groups: list[Group], adv_eps: float, overlong_filter: bool) -> list[TrainSample]:
    """One TrainSample per response: its group's advantage (from shaped rewards), overlong filtering."""
    if not groups:
        return []
    rewards = torch.tensor([g.rewards for g in groups], dtype=torch.float64)
    advantages = group_advantages(rewards, eps=adv_eps)
    samples = []
    for g, adv in zip(groups, advantages.tolist()):
        for r, a in zip(g.responses, adv):
            samples.append(
                TrainSample(
                    prompt_ids=list(g.prompt.token_ids),
                    response_ids=list(r.token_ids),
                    advantage=float(a),
                    rollout_logp=None if r.logprobs is None else torch.tensor(r.logprobs, dtype=torch.float32),
                    in_loss=not (overlong_filter and r.truncated),
                )
            )
    return samples


class Trainer:
    """Builds every component from the config and runs rollout steps."""

    def __init__(self, cfg: Config) -> None:
        from transformers import AutoTokenizer

        from megatron_dapo.convert.checkpoint_io import LazyMegatronWeights, SafetensorsReader
        from megatron_dapo.data.datasets import PromptDataset
        from megatron_dapo.model.arch import ModelArch
        from megatron_dapo.model.parallel import init_parallel
        from megatron_dapo.model.policy import MegatronPolicy
        from megatron_dapo.reward import RewardPool
        from megatron_dapo.rollout.vllm_engine import VLLMEngine
        from megatron_dapo.rollout.weight_bridge import WeightBridge

        if not cfg.model.hf_path:
            raise ConfigError("config field model.hf_path is empty: expected a Hugging Face model directory")
        self.cfg = cfg
        hf = Path(cfg.model.hf_path)
        self.arch = ModelArch.from_hf_dir(hf)
        self.layout = init_parallel(self.arch, cfg.parallel, cfg.model, cfg.seed)
        if self.layout.dp != 1:
            raise ConfigError(
                f"world size {self.layout.world_size} gives data parallel {self.layout.dp}: this trainer "
                "runs the rollout on one replica, so set parallel.tp x parallel.pp to the world size"
            )
        self.tokenizer = AutoTokenizer.from_pretrained(hf)
        self.policy = MegatronPolicy(cfg, self.arch, self.layout, LazyMegatronWeights(SafetensorsReader(hf), self.arch))
        self.engine = VLLMEngine.from_config(cfg, model_path=str(hf), load_format="dummy")
        self.bridge = WeightBridge(self.policy.model, self.arch, self.layout, cfg.rollout.bucket_bytes)
        self.dataset = PromptDataset.from_config(cfg.data, self.tokenizer)
        self.scorer = RewardPool.from_config(cfg.reward)
        self.loader = DynamicSamplingLoader.from_config(cfg, self.dataset, self.rollout, self.scorer)
        self.checkpoints = CheckpointManager(Path(cfg.trainer.run_dir) / "checkpoints", cfg.trainer.keep_last)
        self.step = 0
        self.gen_rounds = 0
        self.rollout_calls = 0  # seeds generation: a resumed run samples what the uninterrupted one would
        self.nan_in_a_row = 0
        self._val_prompts: list[Prompt] | None = None
        self.engine.show_progress = cfg.trainer.progress_bar and self.layout.rank == 0
        if cfg.trainer.resume:
            state = self.checkpoints.load(self.policy)
            if state is not None:
                self.step = state["step"]
                saved = state["trainer"]
                self.gen_rounds, self.rollout_calls = saved["gen_rounds"], saved["rollout_calls"]
                self.nan_in_a_row = saved["nan_in_a_row"]
                self.loader.load_state_dict(saved["loader"])
                log.info("resumed from step %d", self.step)
        self.bridge.sync(self.engine)  # the engine started from dummy weights

    # ---------------------------------------------------------------- rollout

    def rollout(self, prompts: list[Prompt], n: int) -> list[list[Response]]:
        r = self.cfg.rollout
        self.rollout_calls += 1
        return self.engine.generate(
            [p.token_ids for p in prompts],
            n=n,
            temperature=r.temperature,
            top_p=r.top_p,
            max_tokens=r.max_response_length,
            stop_token_ids=[self.tokenizer.eos_token_id],
            seed=(self.cfg.seed * 1_000_003 + self.rollout_calls * 7919) % 2**31,
        )

    # ---------------------------------------------------------------- one step

    def train_step(self) -> dict[str, float]:
        """One rollout step; returns its metrics."""
        cfg, t0 = self.cfg, time.perf_counter()
        batch = self.loader.next_batch()
        self.gen_rounds += int(batch.stats["sampler/gen_rounds"])
        t_gen = time.perf_counter() - t0
        samples = samples_from_groups(batch.groups, cfg.algorithm.adv_eps, cfg.algorithm.overlong_filter)
        temperature = cfg.rollout.temperature
        t1 = time.perf_counter()
        old = self.policy.compute_logprobs(samples, temperature)
        mismatch = []
        if old is not None:
            for s, lp in zip(samples, old):
                s.old_logp = lp["logp"]
                if s.rollout_logp is not None and len(s.rollout_logp) == len(lp["logp"]):
                    mismatch.append((s.rollout_logp - lp["logp"]).abs())
        t_old = time.perf_counter() - t1
        t2 = time.perf_counter()
        per_update = []
        size = cfg.optim.mini_batch_size
        for start in range(0, len(samples), size):
            per_update.append(self.policy.train_step(samples[start : start + size], temperature))
        skipped = sum(1 for m in per_update if not m["actor/update_applied"])
        self.nan_in_a_row = self.nan_in_a_row + 1 if skipped else 0
        if self.nan_in_a_row >= cfg.trainer.max_nan_in_a_row:
            raise FloatingPointError(
                f"step {self.step + 1}: the loss was not finite in {self.nan_in_a_row} rollout steps in a row "
                f"(trainer.max_nan_in_a_row={cfg.trainer.max_nan_in_a_row}); the last good checkpoint is in "
                f"{self.checkpoints.root}"
            )
        t_train = time.perf_counter() - t2
        t3 = time.perf_counter()
        sync = self.bridge.sync(self.engine)
        t_sync = time.perf_counter() - t3
        self.step += 1
        metrics = dict(batch.stats)
        metrics.update(_mean_metrics(per_update))
        metrics.update(sync)
        tokens = sum(len(s.response_ids) for s in samples)
        elapsed = time.perf_counter() - t0
        metrics.update(
            {
                "step": float(self.step),
                "trainer/optimizer_steps": float(self.policy.optimizer_steps),
                "trainer/gen_rounds_total": float(self.gen_rounds),
                "trainer/updates": float(len(per_update)),
                "trainer/nan_skipped_updates": float(skipped),
                "rollout/logp_mismatch_mean": float(torch.cat(mismatch).mean()) if mismatch else 0.0,
                "perf/tokens_per_s": tokens / elapsed if elapsed > 0 else 0.0,
                "timing/generate": t_gen,
                "timing/old_logp": t_old,
                "timing/train": t_train,
                "timing/sync": t_sync,
                "timing/step": elapsed,
            }
        )
        return metrics

    def evaluate(
        self,
        prompts: list[Prompt],
        k: int = 1,
        temperature: float = 0.0,
        top_p: float = 1.0,
        max_tokens: int | None = None,
    ) -> dict[str, float]:
        """avg@k and pass@k on prompts with the engine's current weights, scored by the reward pool.

        avg@k: mean correctness over every (problem, sample); pass@k: fraction of problems with at
        least one correct sample. Defaults: one greedy sample (then both are the greedy accuracy).
        """
        if not prompts:
            raise ValueError("evaluate: no prompts (is data.val_files empty?)")
        outputs = self.engine.generate(
            [p.token_ids for p in prompts],
            n=k,
            temperature=temperature,
            top_p=top_p,
            max_tokens=max_tokens or self.cfg.rollout.max_response_length,
            stop_token_ids=[self.tokenizer.eos_token_id],
            seed=self.cfg.seed,  # the same samples for the same weights: curves compare step to step
        )
        scored = self.scorer.score(
            [r.text for group in outputs for r in group],
            [p.ground_truth for p in prompts for _ in range(k)],
            [p.data_source for p in prompts for _ in range(k)],
        )
        correct = torch.tensor(scored.acc, dtype=torch.float64).view(len(prompts), k)
        return {
            "eval/avg_at_k": float(correct.mean()),
            "eval/pass_at_k": float((correct > 0).any(dim=1).double().mean()),
            "eval/k": float(k),
            "eval/problems": float(len(prompts)),
        }

    def evaluate_from_config(self) -> dict[str, float]:
        """evaluate() on data.val_files with the eval section's k, temperature, top_p and length."""
        from megatron_dapo.data.datasets import PromptDataset

        if self._val_prompts is None:
            self._val_prompts = list(PromptDataset.from_config(self.cfg.data, self.tokenizer, split="val"))
        e = self.cfg.eval
        return self.evaluate(self._val_prompts, e.k, e.temperature, e.top_p, e.max_response_length)

    def save(self) -> Path:
        state = {
            "gen_rounds": self.gen_rounds,
            "rollout_calls": self.rollout_calls,
            "nan_in_a_row": self.nan_in_a_row,
            "loader": self.loader.state_dict(),
        }
        return self.checkpoints.save(self.policy, self.step, state)

    def close(self) -> None:
        self.scorer.close()
        self.engine.close()


def _mean_metrics(per_update: list[dict[str, float]]) -> dict[str, float]:
    if not per_update:
        return {}
    applied = [m for m in per_update if m["actor/update_applied"]] or per_update
    out = {k: sum(m[k] for m in applied) / len(applied) for k in applied[0]}
    out["actor/ratio_max"] = max(m["actor/ratio_max"] for m in applied)
    out["actor/lr"] = per_update[-1]["actor/lr"]
    return out


def progress_line(m: dict[str, Any]) -> str:
    """The one line a person reads per rollout step."""
    if "reward/mean" in m:
        rollout = (
            f"reward {m['reward/mean']:+.3f} acc {m['reward/acc']:.3f} "
            f"informative {m['sampler/informative_frac']:.2f} rounds {int(m['sampler/gen_rounds'])} | "
            f"len {m['response/length_mean']:.0f}/{m['response/length_max']:.0f}"
        )
    else:  # a step trained entirely on groups carried over from the last one
        rollout = f"no generation: {int(m['sampler/batch_groups'])} carried-over groups"
    evaluation = ""
    if "eval/avg_at_k" in m:
        k = int(m["eval/k"])
        evaluation = f" | eval avg@{k} {m['eval/avg_at_k']:.3f} pass@{k} {m['eval/pass_at_k']:.3f}"
    return (
        f"step {int(m['step'])} | {rollout} | "
        f"clip lo/hi {m.get('actor/clip_frac_low', 0):.3f}/{m.get('actor/clip_frac_high', 0):.3f} "
        f"entropy {m.get('actor/entropy', 0):.3f} | {m['perf/tokens_per_s']:.0f} tok/s | "
        f"gen {m['timing/generate']:.1f}s old {m['timing/old_logp']:.1f}s train {m['timing/train']:.1f}s "
        f"sync {m['timing/sync']:.1f}s{evaluation}"
    )
