"""The DAPO loop: rollout -> rewards -> informative filter -> old logprobs -> mini-batch updates -> weight sync.

One rollout step: the dynamic-sampling loader collects `sampler.train_batch_size` informative
groups of `algorithm.group_size` responses from the colocated vLLM engines; each group's shaped
rewards become advantages; the policy recomputes the sampling policy's logprobs (old_logp)
once (and, with algorithm.kl_coef > 0, the frozen reference policy its own), then takes one
optimizer step per mini-batch of `optim.mini_batch_size` responses (16 with the paper's sizes);
the bridge then streams the new weights into the engines. Rollout steps, optimizer steps and
generation rounds are counted apart; the LR schedule follows optimizer steps.

Distributed (torchrun, any TP x PP x CP x DP): every rank runs the same sampling scheduler
(dataset, seed, state), so prompt draws, acceptance and carried-over groups agree everywhere.
Every rank hosts an in-process vLLM engine; an engine spans `rollout.tp` consecutive ranks on GPU
(vLLM's external launcher; None = parallel.tp) and one rank on CPU, so the world holds
world_size / rollout_tp engines, each fed groups on demand by the scheduler. A group's responses
stay on its engine's first rank, which scores them; only their summaries (lengths, correctness,
rewards) reach every rank. Once the batch is known each response moves, as tensors, to the ranks of
the data-parallel replica that trains it (sampling/exchange.py). Each data-parallel rank trains on its
slice of every mini-batch (the policy's token-mean normaliser and metrics are global), and every
rank's bridge streams the full weights into its own engine. All of that is the colocated `Rollout`
(placement/colocated.py); with pipeline.mode=async the same loop runs against the remote one (placement/remote.py: the
engines, loader and evaluator in the rollout processes), with no branch here on the mode. The loop knows the rollout
side only through the `Rollout` protocol (placement/protocol.py): tests/test_trainer_loop.py drives it against a
stand-in.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Optional

import torch

from megatron_dapo import gc_tuning, progress
from megatron_dapo.algorithm.advantages import group_advantages
from megatron_dapo.algorithm.kl import kl_estimate, kl_penalized_rewards
from megatron_dapo.algorithm.mismatch import MISMATCH_KEYS, mismatch_metrics, rollout_mismatch_sums
from megatron_dapo.algorithm.overlong import overlong_filter_mask
from megatron_dapo.checkpoint import CheckpointManager
from megatron_dapo.config import Config, ConfigError
from megatron_dapo.model.comm import Comm
from megatron_dapo.model.policy import TrainSample
from megatron_dapo.placement.evaluation import Evaluation, held_out_request
from megatron_dapo.placement.protocol import Rollout, RolloutFactory
from megatron_dapo.placement.split import TrainSplit
from megatron_dapo.sampling.exchange import SampleId
from megatron_dapo.sampling.loader import StepBatch
from megatron_dapo.sampling.records import GroupMeta
from megatron_dapo.timing import PhaseTimer
from megatron_dapo.types import EvalRequest, Prompt, Response

log = logging.getLogger("megatron_dapo.trainer")


def train_samples(
    batch: list[GroupMeta],
    ids: list[SampleId],
    responses: dict[SampleId, Response],
    prompts: Any,
    overlong_filter: bool,
    engine_routes: bool = False,
) -> list[TrainSample]:
    """TrainSamples for the responses `ids` of the batch: overlong filtering, the engine's logprobs for truncated IS
    and, with engine_routes (routing replay R3), its routes; their advantages come once the step's rewards are final
    (assign_advantages).

    batch: the step's groups; responses: (key, j) -> Response for every id; prompts[index] -> Prompt.
    """
    if not ids:
        return []
    by_key = {g.key: i for i, g in enumerate(batch)}
    truncated = torch.tensor([g.truncated for g in batch], dtype=torch.bool)
    in_loss = overlong_filter_mask(truncated) if overlong_filter else torch.ones_like(truncated)
    samples = []
    for key, j in ids:
        g, r = batch[by_key[key]], responses[(key, j)]
        prompt = list(prompts[g.index].token_ids)
        if engine_routes and (r.routes is None or len(r.routes) != len(prompt) + len(r.token_ids) - 1):
            got = "none" if r.routes is None else f"{len(r.routes)} positions"
            raise RuntimeError(
                f"model.router_replay=r3: response {j} of group {key} came with {got} of routes, expected "
                f"{len(prompt) + len(r.token_ids) - 1} (prompt + response - 1): the engine did not capture them"
            )
        samples.append(
            TrainSample(
                prompt_ids=prompt,
                response_ids=list(r.token_ids),
                rollout_logp=None if r.logprobs is None else torch.tensor(r.logprobs, dtype=torch.float32),
                in_loss=bool(in_loss[by_key[key], j]),
                routes=r.routes if engine_routes else None,
            )
        )
    return samples


def assign_advantages(
    batch: list[GroupMeta],
    ids: list[SampleId],
    samples: list[TrainSample],
    rewards: torch.Tensor,
    adv_eps: float,
    adv_norm: str = "std",
) -> None:
    """Each sample (response `ids[i]`) its group's advantage, from the shaped rewards of every response of the group.

    rewards: [len(batch), G] float64, the batch's rewards in batch order (with algorithm.kl_in_reward already less
    the KL penalty); the advantages are computed once, in float64, whichever of them this rank trains.
    """
    if not ids:
        return
    row = {g.key: i for i, g in enumerate(batch)}
    advantages = group_advantages(rewards, eps=adv_eps, norm=adv_norm)
    for (key, j), s in zip(ids, samples):
        s.advantage = float(advantages[row[key], j])


def batch_rewards(batch: list[GroupMeta]) -> torch.Tensor:
    """[len(batch), G] float64: every response's shaped reward, in batch order."""
    return torch.tensor([g.rewards for g in batch], dtype=torch.float64)


class Trainer:
    """Builds every component from the config and runs rollout steps. make_rollout: what builds the rollout side
    (default: placement/protocol.py's, by pipeline.mode)."""

    def __init__(self, cfg: Config, make_rollout: Optional[RolloutFactory] = None) -> None:
        self.rollout: Optional[Rollout] = None  # the engines' side, in either pipeline.mode (placement/protocol.py)
        self.evaluation: Optional[Evaluation] = None
        """The evaluation the last train_step asked for (eval_due), None if none: result() gives its metrics."""
        try:
            self._build(cfg, make_rollout)
        except BaseException:  # a bad checkpoint or a signal at start-up: stop what already started, then raise
            self.close()
            raise
        gc_tuning.start_up_done()

    def _build(self, cfg: Config, make_rollout: Optional[RolloutFactory]) -> None:
        from transformers import AutoTokenizer

        from megatron_dapo.convert.safetensors_io import LazyMegatronWeights, SafetensorsReader
        from megatron_dapo.data.datasets import PromptDataset
        from megatron_dapo.model.arch import ModelArch
        from megatron_dapo.model.parallel import arm_group_timeouts, init_parallel
        from megatron_dapo.model.policy import MegatronPolicy
        from megatron_dapo.model.provider import weights_digest
        from megatron_dapo.placement.protocol import make_rollout as default_rollout
        from megatron_dapo.rollout.vllm_env import rollout_tp
        from megatron_dapo.rollout.weight_bridge import WeightBridge

        if not cfg.model.hf_path:
            raise ConfigError("config field model.hf_path is empty: expected a Hugging Face model directory")
        self.cfg = cfg
        hf = Path(cfg.model.hf_path)
        self.arch = ModelArch.from_hf_dir(hf)
        self.replay = cfg.model.router_replay if self.arch.is_moe else "none"
        """model.router_replay for this model: 'none' for a dense one."""
        timeout_s = cfg.trainer.collective_timeout_s
        self.layout = init_parallel(self.arch, cfg.parallel, cfg.model, cfg.seed, timeout_s)
        self.comm = Comm(self.layout)
        check_distributed(cfg, self.layout.world_size, self.layout.dp, rollout_tp(cfg.rollout, cfg.parallel))
        self.tokenizer = AutoTokenizer.from_pretrained(hf)
        weights = LazyMegatronWeights(SafetensorsReader(hf), self.arch)
        self.policy = MegatronPolicy(self.arch, self.layout, weights, **policy_options(cfg))
        self.reference = self.reference_digest = None
        if cfg.algorithm.kl_coef > 0:  # KL's reference: the starting weights, frozen, sharded like the policy
            self.reference = MegatronPolicy(self.arch, self.layout, weights, **policy_options(cfg), frozen=True)
            self.reference_digest = weights_digest(weights, self.comm)  # checked when a checkpoint is resumed
        self.bridge = WeightBridge(
            self.policy.model, self.arch, self.layout, cfg.rollout.bucket_bytes, cfg.rollout.weight_digest
        )
        self.checkpoints = CheckpointManager(Path(cfg.trainer.run_dir) / "checkpoints", cfg.trainer.keep_last)
        if cfg.trainer.resume and self.reference_digest is not None:  # refuse before the engines start
            self._check_reference(self.checkpoints.peek_trainer_state(self.layout.rank))
        resumed = None
        # before the engines and the reward pool: no usable checkpoint stops the run in seconds. What starts after it
        # draws nothing from the global generators it restored (the engine puts them back: vllm_env), so the resumed
        # run still reproduces the uninterrupted one (the kill -9 test)
        if cfg.trainer.resume:
            resumed = self.checkpoints.load(self.policy)
        self.dataset = PromptDataset.from_config(cfg.data, self.tokenizer)
        # every rank's data-parallel rank: senders and receivers of rollout data agree on who trains what
        dp_rank = torch.tensor([self.layout.dp_rank], dtype=torch.int64, device=self.comm.device)
        dp_rank_of = tuple(int(r) for r in self.comm.all_gather(dp_rank, "world"))
        self.split = TrainSplit(cfg.optim.mini_batch_size, self.layout.dp, dp_rank_of)
        self.step = self.gen_rounds = self.nan_in_a_row = 0
        loader_state = None
        if resumed is not None:
            state = resumed["trainer"]
            self._check_reference(state)
            self.step, self.gen_rounds, self.nan_in_a_row = resumed["step"], state["gen_rounds"], state["nan_in_a_row"]
            loader_state = state["loader"]
            if self.layout.rank == 0:
                log.info("resumed from step %d (%s)", self.step, self.checkpoints.root)
        # ready when built: the loader resumed, the engines (started from dummy weights) holding the policy's
        build = make_rollout or default_rollout
        self.rollout = build(
            cfg, self.tokenizer, self.dataset, self.comm, self.split, self.bridge, self.step, loader_state
        )
        arm_group_timeouts(timeout_s)  # every group of this process, published for the watchdog's records

    # ---------------------------------------------------------------- one step

    def _samples(self, batch: StepBatch) -> tuple[list[list[TrainSample]], list[SampleId], float]:
        """This rank's TrainSamples per mini-batch (advantages not yet assigned), its responses fetched from where
        they were generated; their ids in the same order, flat; bytes sent over the world."""
        mine = self.split.minibatches(batch.groups, self.layout.dp_rank)
        responses, sent = self.rollout.responses(batch)
        missing = [sid for ids in mine for sid in ids if sid not in responses]
        sent, lost = self.comm.sum([sent, len(missing)])  # every rank stops on a rank's missing share
        if lost:
            raise RuntimeError(
                f"step {self.step + 1}: the rollout side delivered no response for {int(lost)} of those the train "
                f"ranks train (this rank: {len(missing)} of its {sum(map(len, mine))}): Rollout.responses must cover "
                "each rank's share (TrainSplit.wanted_by)"
            )
        overlong, r3 = self.cfg.algorithm.overlong_filter, self.replay == "r3"
        slices = [train_samples(batch.groups, ids, responses, self.dataset, overlong, r3) for ids in mine]
        return slices, [sid for ids in mine for sid in ids], sent

    def _sum_once(self, total: torch.Tensor) -> torch.Tensor:
        """[n] float64 on the last stage (its TP and CP ranks hold the same numbers: the logprobs are whole there) ->
        the sum over the data-parallel replicas, each counted once, on every rank."""
        return self.comm.count_once(total.to(self.comm.device), ("tp", "cp", "pp")).cpu()

    def _mismatch(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, float]:
        """Rollout-vs-training mismatch over the step's tokens on every rank (each DP rank's slice counted once):
        mean |logp difference|, KL (k3) and, with a rollout correction on, the share of tokens (and responses) it
        capped or masked."""
        correction = self.cfg.rollout_correction()
        total = torch.zeros(len(MISMATCH_KEYS), dtype=torch.float64)
        for old, rollout in pairs:  # empty before the last stage
            total += rollout_mismatch_sums(old, rollout, correction, self.cfg.algorithm.log_ratio_clamp)
        return mismatch_metrics(self._sum_once(total), correction)

    def _kl_in_reward(
        self, groups: list[GroupMeta], ids: list[SampleId], samples: list[TrainSample], rewards: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """algorithm.kl_in_reward: each response's reward becomes R - kl_coef x (sum of k over its tokens, from the
        old and reference logprobs). The sums meet on every rank (each response counted once). Returns the penalised
        rewards [len(groups), G], actor/kl (k per token) and actor/reward_kl_penalty (per response)."""
        a = self.cfg.algorithm
        size = len(groups[0].lengths) if groups else 0  # responses per group (train_samples' layout too)
        row = {g.key: i for i, g in enumerate(groups)}
        sums = torch.zeros(len(groups) * size + 1, dtype=torch.float64)  # per response, then the tokens
        if self.policy.is_last_stage:  # where old_logp and ref_logp are
            for (key, j), s in zip(ids, samples):
                k = kl_estimate(s.old_logp.double(), s.ref_logp.double(), a.kl_estimator)
                sums[row[key] * size + j], sums[-1] = k.sum(), sums[-1] + k.numel()
        sums = self._sum_once(sums)
        kl_sums = sums[:-1].reshape(len(groups), size)
        return kl_penalized_rewards(rewards, kl_sums, a.kl_coef), {
            "actor/kl": float(sums[:-1].sum() / sums[-1].clamp(min=1)),
            "actor/reward_kl_penalty": float(a.kl_coef * kl_sums.mean()),
        }

    def train_step(self) -> dict[str, float]:
        """One rollout step; returns its metrics (the whole step's, on every rank)."""
        cfg, a, timer = self.cfg, self.cfg.algorithm, PhaseTimer()
        progress.set_phase("step", step=self.step + 1)  # the stall watchdog's; the timer's phases are inside it
        with timer.phase("generate"):
            batch = self.rollout.next_batch()
            self.gen_rounds += int(batch.stats["sampler/gen_rounds"])
        mini_batches, ids, bytes_moved = self._samples(batch)
        temperature = cfg.rollout.temperature
        with timer.phase("old_logp"):
            mine = [s for mb in mini_batches for s in mb]
            old = self.policy.compute_logprobs(mine, temperature, record_routes=self.replay == "r2")
            pairs = []
            if old is not None:
                for s, lp in zip(mine, old):
                    s.old_logp = lp["logp"]
                    if s.rollout_logp is not None and len(s.rollout_logp) == len(lp["logp"]):
                        pairs.append((lp["logp"], s.rollout_logp))
            mismatch = self._mismatch(pairs)
        kl, rewards = {}, batch_rewards(batch.groups)
        if self.reference is not None:
            with timer.phase("ref_logp"):
                # the reference routes by itself unless the engine's routes are replayed (R3); R2's are the policy's
                ref = self.reference.compute_logprobs(mine, temperature, replay=self.replay == "r3")
                for s, lp in zip(mine, ref or []):
                    s.ref_logp = lp["logp"]
                if a.kl_in_reward:
                    rewards, kl = self._kl_in_reward(batch.groups, ids, mine, rewards)
        assign_advantages(batch.groups, ids, mine, rewards, a.adv_eps, a.adv_norm)  # once, from the final rewards
        with timer.phase("train"):
            per_update = [self.policy.train_step(mb, temperature) for mb in mini_batches]
            skipped = sum(1 for m in per_update if not m["actor/update_applied"])
            self.nan_in_a_row = self.nan_in_a_row + 1 if skipped else 0
            if self.nan_in_a_row >= cfg.trainer.max_nan_in_a_row:
                raise FloatingPointError(
                    f"step {self.step + 1}: the loss was not finite in {self.nan_in_a_row} rollout steps in a row "
                    f"(trainer.max_nan_in_a_row={cfg.trainer.max_nan_in_a_row}); the last good checkpoint is in "
                    f"{self.checkpoints.root}"
                )
        with timer.phase("sync"):  # the weights that train batch step + 1, evaluated when eval.every says so
            request = held_out_request(cfg) if self.eval_due(self.step + 1) else None
            synced = self.rollout.sync(self.bridge, self.step + 1, request)
        self.step += 1
        self.evaluation = synced.evaluation
        metrics = dict(batch.stats)
        metrics.update(_mean_metrics(per_update))
        metrics.update(synced.metrics)
        metrics.update(mismatch)
        metrics.update(kl)
        tokens = sum(g.tokens for g in batch.groups)
        elapsed = timer.elapsed()
        metrics.update(
            {
                "step": float(self.step),
                "trainer/optimizer_steps": float(self.policy.optimizer_steps),
                "trainer/gen_rounds_total": float(self.gen_rounds),
                "trainer/updates": float(len(per_update)),
                "trainer/nan_skipped_updates": float(skipped),
                "sampler/bytes_moved": bytes_moved,
                "perf/tokens_per_s": tokens / elapsed if elapsed > 0 else 0.0,
                **{f"timing/{name}": seconds for name, seconds in timer.seconds.items()},
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
        """avg@k and pass@k on prompts with the weights last synced, scored by the reward pool (HeldOutEval), in
        either pipeline.mode. Defaults: one greedy sample, responses up to rollout.max_response_length. Collective
        over the world."""
        max_tokens = max_tokens or self.cfg.rollout.max_response_length
        return self.rollout.evaluate(EvalRequest(k, temperature, top_p, max_tokens, prompts=list(prompts))).result()

    # ---------------------------------------------------------------- checkpoints and cadence

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint holds beside the model and optimizer (the step is the checkpoint's own)."""
        return {
            "gen_rounds": self.gen_rounds,
            "nan_in_a_row": self.nan_in_a_row,
            "loader": self.rollout.state_dict(),
            "reference_digest": self.reference_digest,
        }

    def _check_reference(self, state: Optional[dict[str, Any]]) -> None:
        """A checkpoint's trainer state trained against other reference weights than model.hf_path's: ConfigError.
        (No digest saved, KL off now, or no state: nothing to check.)"""
        saved = (state or {}).get("reference_digest")
        if self.reference_digest is not None and saved is not None and saved != self.reference_digest:
            raise ConfigError(
                f"{self.checkpoints.root}: the run trained with KL to reference weights {saved[:12]} (model.hf_path "
                f"when it started), but model.hf_path={self.cfg.model.hf_path} holds {self.reference_digest[:12]}: "
                "resume with the model the run started from, or start a new run in another trainer.run_dir"
            )

    def save(self) -> Path:
        return self.checkpoints.save(self.policy, self.step, self.state_dict())

    def eval_due(self, step: int | None = None) -> bool:
        """After step `step` (default: the last one trained)? Every eval.every steps and at the last step; never
        when eval.every is 0."""
        step = self.step if step is None else step
        every, last = self.cfg.eval.every, step == self.cfg.trainer.total_steps
        return bool(every) and (step % every == 0 or last)

    def save_due(self) -> bool:
        """Every trainer.save_every steps and always at the last step (save_every 0: only there)."""
        every, last = self.cfg.trainer.save_every, self.step == self.cfg.trainer.total_steps
        return (bool(every) and self.step % every == 0) or last

    def close(self, *, exiting: bool = False) -> None:
        """The last call: a colocated engine's shutdown takes torch.distributed's world with it; what is left of the
        world goes here. Safe on a half-built trainer. exiting: the process ends next (VLLMEngine.close)."""
        from megatron_dapo.model.parallel import destroy_parallel

        if self.rollout is not None:
            self.rollout.close(exiting=exiting)
        destroy_parallel()


def policy_options(cfg: Config) -> dict[str, Any]:
    """MegatronPolicy's keyword arguments from the run's Config: the sections it acts on and the values derived
    across them (the rollout correction in force)."""
    return dict(
        model=cfg.model,
        algorithm=cfg.algorithm,
        train=cfg.train,
        optim=cfg.optim,
        correction=cfg.rollout_correction(),
        max_response_length=cfg.rollout.max_response_length,
        use_distributed_optimizer=cfg.parallel.use_distributed_optimizer,
    )


def check_distributed(cfg: Config, world_size: int, dp: int, rollout_tp: int) -> None:
    """Raise ConfigError for a world the rollout engines or the data-parallel split cannot use."""
    if world_size % rollout_tp:
        raise ConfigError(
            f"rollout.tp={rollout_tp} (null means parallel.tp) does not divide the world size {world_size}: "
            "each vLLM engine spans rollout.tp consecutive ranks"
        )
    if cfg.optim.mini_batch_size % dp:
        raise ConfigError(
            f"optim.mini_batch_size={cfg.optim.mini_batch_size} is not divisible by the data-parallel size {dp} "
            f"(world size {world_size} / parallel.tp x pp x cp): each data-parallel rank trains on an equal share "
            "of every mini-batch"
        )
    short = cfg.sampler.mode == "dynamic_bs" or cfg.sampler.on_shortfall == "train"
    if short and cfg.algorithm.group_size % dp:
        why = "sampler.mode=dynamic_bs" if cfg.sampler.mode == "dynamic_bs" else "sampler.on_shortfall=train"
        raise ConfigError(
            f"algorithm.group_size={cfg.algorithm.group_size} is not divisible by the data-parallel size {dp}: with "
            f"{why} a step's last mini-batch holds whole groups and must split evenly over the ranks"
        )


def _mean_metrics(per_update: list[dict[str, float]]) -> dict[str, float]:
    if not per_update:
        return {}
    applied = [m for m in per_update if m["actor/update_applied"]] or per_update
    out = {k: sum(m[k] for m in applied) / len(applied) for k in applied[0]}
    out["actor/ratio_max"] = max(m["actor/ratio_max"] for m in applied)
    out["actor/lr"] = per_update[-1]["actor/lr"]
    return out
