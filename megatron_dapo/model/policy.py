"""The Megatron policy: logprobs of responses and the train step (DAPO's objective or another: algorithm.policy_loss).

A mini-batch of samples (this data-parallel rank's share) is packed into micro-batches
under a token budget (microbatch.py lays them out), then run through Megatron's forward-backward schedule (no pipeline,
1F1B or interleaved, from the layout). The DAPO loss is token-mean over the *whole*
mini-batch: the number of valid response tokens across every micro-batch, pipeline stage
and data-parallel rank is known before the step, so it is all-reduced once and each
micro-batch contributes loss_sum / global_tokens. Megatron is told the loss is already
normalised (calculate_per_token_loss, and a finalize that does not rescale), and its DDP
sums (not averages) gradients over data-parallel ranks, so the gradient is exactly that of
the global token-mean.
"""

from __future__ import annotations

import logging
import math
import time
import warnings
from dataclasses import replace
from functools import partial
from typing import Optional

import torch

from megatron_dapo import progress
from megatron_dapo.algorithm.losses import policy_loss_fn, resolve_loss_impl
from megatron_dapo.algorithm.policy_loss import loss_metrics, loss_normalizer, reduce_stats
from megatron_dapo.algorithm.rollout_correction import correction_weight
from megatron_dapo.config import AlgorithmConfig, Correction, ModelConfig, OptimConfig, TrainConfig
from megatron_dapo.kernels import fused_runs_on
from megatron_dapo.model import provider
from megatron_dapo.model.arch import ModelArch
from megatron_dapo.model.comm import Comm
from megatron_dapo.model.logprobs import token_logprobs
from megatron_dapo.model.microbatch import (  # TrainSample: what callers build, imported from here too
    MicroBatch,
    TrainSample,
    collate,
    cp_unslice,
    pack_microbatches,
    row_multiple,
    slice_for_cp,
)
from megatron_dapo.model.parallel import Layout
from megatron_dapo.model.routing import Routing, route_dtype

# megatron-core's distributed optimizer clears the .grad of its (non-leaf) fp32 shard views in
# zero_grad; torch warns on every step about a read that is harmless there
warnings.filterwarnings("ignore", message="The .grad attribute of a Tensor that is not a leaf")
log = logging.getLogger(__name__)


class MegatronPolicy:
    """Megatron model chunks, optimizer and schedule for one rank of a layout; or, frozen, the reference policy."""

    def __init__(
        self,
        arch: ModelArch,
        layout: Layout,
        full_weights: Optional[dict[str, torch.Tensor]],
        *,
        model: ModelConfig,
        algorithm: AlgorithmConfig,
        train: TrainConfig,
        optim: OptimConfig,
        correction: Correction,
        max_response_length: int,
        use_distributed_optimizer: bool,
        frozen: bool = False,
    ):
        """full_weights: full Megatron tensors (convert.layouts.hf_to_megatron); None keeps Megatron's
        random initialisation (benchmarks). model: the model section (precision, recompute, attention); algorithm:
        the objective, its clipping and KL; train: the micro-batch token budgets and packing; optim: the optimizer and
        its schedule; correction: the rollout correction in force (Config.rollout_correction()); max_response_length:
        rollout.max_response_length (the constant some loss aggregations divide by); use_distributed_optimizer:
        parallel.use_distributed_optimizer. frozen: the KL reference: the same sharding, no gradient buffers, no
        optimizer, compute_logprobs only; with algorithm.ref_offload its weights wait in CPU memory."""
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.pipeline_parallel import get_forward_backward_func

        self.arch, self.layout, self.comm = arch, layout, Comm(layout)
        self.algorithm, self.correction, self.max_response_length = algorithm, correction, max_response_length
        self.microbatch_tokens = train.microbatch_tokens
        self.fp8 = model.fp8 is not None
        recompute = model.recompute == "full"
        chunks = provider.build_model_chunks(arch, model, layout)
        if full_weights is not None:
            provider.load_full_weights(chunks, full_weights, arch, layout)
        self._forward_backward = get_forward_backward_func()
        # THD packing needs an attention that takes packed rows (TE's or SDPA's); Megatron's unfused one gets padded
        # rows. Under context parallel THD would need per-sequence zig-zag partitioning: padded rows there too.
        a = algorithm
        takes_packed = layout.attention in ("te", "sdpa")
        self.packed = train.packed_sequences and takes_packed and layout.cp == 1
        self.offload = frozen and a.ref_offload and layout.device.type == "cuda"
        self.routing: Optional[Routing] = None
        """The MoE routers of this policy's chunks (model/routing.py); None for a dense model."""
        if frozen:
            for chunk in chunks:
                chunk.requires_grad_(False)
                chunk.eval()
                if self.offload:
                    chunk.cpu()
            self.model, self.optimizer, self.scheduler = chunks, None, None
            self._routing(chunks, recompute)
            return
        self.model = provider.wrap_ddp(chunks, use_distributed_optimizer)
        self._routing(self.model, recompute)
        self.optimizer, self.scheduler = provider.build_optimizer(
            self.model, optim, dtype=model.dtype, use_distributed_optimizer=use_distributed_optimizer
        )
        tf_config = chunks[0].config
        self.moe_loss_coeffs = (tf_config.moe_aux_loss_coeff, tf_config.moe_z_loss_coeff)
        """The configured load-balancing and z-loss coefficients: each train step hands Megatron these over the
        step's token count (see _scale_moe_losses)."""
        tf_config.grad_scale_func = self.optimizer.scale_loss
        tf_config.no_sync_func = [m.no_sync for m in self.model] if len(self.model) > 1 else self.model[0].no_sync
        # The loss is already divided by the global token count: finalize must not rescale by it.
        tf_config.finalize_model_grads_func = lambda model, num_tokens, **kw: finalize_model_grads(model, None, **kw)
        self.optimizer_steps = 0
        # algorithm.loss_impl, 'auto' resolved once for this device and objective: the fused kernel or the reference
        fused_here = fused_runs_on(layout.device)
        self.loss_impl = resolve_loss_impl(a.loss_impl, fused_here, a.policy_loss)
        self.loss_fn = policy_loss_fn(self.loss_impl, a.policy_loss)
        if fused_here and self.loss_impl == "reference" and a.loss_impl == "auto" and layout.rank == 0:
            log.info(
                "algorithm.loss_impl=auto: policy_loss=%s runs the PyTorch reference (no fused kernel)", a.policy_loss
            )
        if a.policy_loss.startswith("gspo") and a.loss_agg_mode != "seq-mean-token-mean" and layout.rank == 0:
            log.warning(
                "algorithm.policy_loss=%s with loss_agg_mode=%s weighs each response by its length; the GSPO paper "
                "averages per response (seq-mean-token-mean)", a.policy_loss, a.loss_agg_mode
            )  # fmt: skip

    def _routing(self, chunks: list, recompute: bool) -> None:
        """The routing driver of a MoE model, over the chunks as the schedule hands them to forward_step; recompute:
        model.recompute is full."""
        if self.arch.is_moe:
            self.routing = Routing(chunks, self.arch, self.comm, recompute=recompute)

    def close(self) -> None:
        """Let this policy's memory go once the caller drops it (a process that builds policies one after
        another: the preflight, benchmarks, tests). Megatron's TransformerConfig, held by every layer, keeps this
        policy's callbacks, and the cycle through the DDP wrapper's gradient hooks is never collected: without
        this a second 0.5B policy on an 80 GiB GPU ran out of memory. Megatron's MoE token dispatchers keep their
        last forward's routing probabilities, whose autograd graph reaches the same hooks: dropped too. The policy
        is unusable afterwards."""
        for chunk in self.model:
            config = provider.unwrap(chunk).config
            config.grad_scale_func = config.no_sync_func = config.finalize_model_grads_func = None
            for module in chunk.modules():
                dispatcher = getattr(module, "token_dispatcher", None)
                for name, value in list(vars(dispatcher).items()) if dispatcher is not None else ():
                    if isinstance(value, torch.Tensor) and value.grad_fn is not None:
                        setattr(dispatcher, name, None)
        self.model, self.optimizer, self.scheduler, self.routing = [], None, None, None

    # ---------------------------------------------------------------- helpers

    @property
    def is_last_stage(self) -> bool:
        return self.layout.pp_rank == self.layout.pp - 1

    def _gather_cp(self, t: torch.Tensor) -> torch.Tensor:
        """[b, L / cp] on each context-parallel rank -> [b, L] everywhere."""
        return cp_unslice(self.comm.all_gather(t, "cp"))

    def _microbatches(self, samples: list[TrainSample], forward_only: bool) -> list[MicroBatch]:
        """This rank's micro-batches of samples for a pass (its context-parallel share of each)."""
        lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
        groups = pack_microbatches(lengths, self.microbatch_tokens(forward_only), self.packed)
        multiple = row_multiple(self.layout, fp8=self.fp8)
        mbs = [collate(samples, g, self.layout.device, multiple, self.packed) for g in groups]
        if self.layout.cp > 1:
            mbs = [slice_for_cp(mb, self.layout.cp, self.layout.cp_rank) for mb in mbs]
        return mbs

    def _run(self, mbs: list[MicroBatch], loss_fn, forward_only: bool, routing: str = "off") -> list[dict]:
        """One pass of the schedule over micro-batches; returns the last stage's per-micro-batch outputs. routing:
        a MoE model's routing mode for the pass (model/routing.py MODES)."""
        if self.routing is not None:
            self.routing.start_pass(routing, backward=not forward_only)

        point = "logprob_batch" if forward_only else "micro_batch"  # progress.py's names: fault places count them

        def forward_step(data_iterator, model):
            progress.point(point)
            mb = next(data_iterator)
            if self.routing is not None:
                self.routing.feed(model, mb)
            output = model(mb.tokens, mb.position_ids, attention_mask=None, packed_seq_params=mb.packed_seq_params)
            return output, partial(loss_fn, mb)

        if not mbs:
            return []
        iters = [iter(mbs) for _ in self.model] if len(self.model) > 1 else iter(mbs)
        return self._forward_backward(
            forward_step_func=forward_step,
            data_iterator=iters,
            model=self.model if len(self.model) > 1 else self.model[0],
            num_microbatches=len(mbs),
            seq_length=max(mb.tokens.shape[1] for mb in mbs),
            micro_batch_size=max(mb.tokens.shape[0] for mb in mbs),
            forward_only=forward_only,
        )

    # ---------------------------------------------------------------- logprobs

    @torch.no_grad()
    def compute_logprobs(
        self,
        samples: list[TrainSample],
        temperature: float,
        with_entropy: bool = False,
        record_routes: bool = False,
        replay: bool = True,
    ) -> Optional[list[dict[str, torch.Tensor]]]:
        """Response-token logprobs (and entropy if with_entropy) under the current weights (forward only).

        Returns, on the last pipeline stage, one {"logp": [R]} float32 per sample (CPU tensors), with "entropy": [R]
        float32 too if with_entropy (the same pass over the logits); None on other stages. A MoE model replays the
        samples' routes when they carry them; record_routes (R2) instead routes by itself and sets each sample's
        `routes` (in place, on every pipeline stage: its own layers, placeholders for the others') to what its
        routers picked. replay=False routes by itself whatever the samples carry.
        """
        for m in self.model:
            m.eval()
        vocab = self.arch.vocab_size

        def loss_fn(mb: MicroBatch, logits: torch.Tensor):
            logp, entropy = token_logprobs(logits, mb.targets, temperature, vocab, self.comm, with_entropy)
            rows = {"logp": logp} if entropy is None else {"logp": logp, "entropy": entropy}
            if self.layout.cp > 1:  # spans index the full row: reassemble it from the CP ranks
                rows = {k: self._gather_cp(v) for k, v in rows.items()}
            out = {"spans": mb.spans, **{k: v.cpu() for k, v in rows.items()}}
            return torch.zeros((), device=logits.device), torch.zeros((), dtype=torch.int), out

        if self.offload:  # the reference's weights come to the GPU for this pass only
            for m in self.model:
                m.to(self.layout.device)
        mbs = self._microbatches(samples, forward_only=True)
        try:
            mode = self._routing_mode(samples, record_routes) if replay or record_routes else "off"
            outputs = self._run(mbs, loss_fn, forward_only=True, routing=mode)
        finally:
            for m in self.model:
                if self.offload:
                    m.cpu()
                elif self.optimizer is not None:  # the policy trains next; the reference stays in eval mode
                    m.train()
        if record_routes and self.routing is not None:
            self._keep_recorded_routes(samples, mbs)
        if not self.is_last_stage:
            return None
        result: list[Optional[dict[str, torch.Tensor]]] = [None] * len(samples)
        for out in outputs:
            for i, row, start, end in out["spans"]:
                result[i] = {k: out[k][row, start:end] for k in ("logp", "entropy") if k in out}
        return result  # type: ignore[return-value]

    def _routing_mode(self, samples: list[TrainSample], record: bool = False) -> str:
        """A pass's routing (model/routing.py MODES): record when asked, replay when the samples carry routes."""
        if record:
            return "record"
        return "replay" if samples and all(s.routes is not None for s in samples) else "off"

    def _keep_recorded_routes(self, samples: list[TrainSample], mbs: list[MicroBatch]) -> None:
        """Set each sample's routes to what the pass's routers picked (this stage's layers)."""
        dtype = route_dtype(self.arch.num_experts)
        for j, mb in enumerate(mbs):
            full = self.routing.recorded_routes(j, mb)
            if self.layout.cp > 1:  # spans index the full row: reassemble it from the CP ranks
                full = self._gather_cp(full.to(self.layout.device)).cpu()
            for i, row, start, _ in mb.spans:
                s = samples[i]
                first = start - len(s.prompt_ids) + 1  # spans start at the last prompt position
                s.routes = full[row, first : first + len(s.prompt_ids) + len(s.response_ids) - 1].to(dtype)

    # ---------------------------------------------------------------- train step

    def global_normalizer(self, samples: list[TrainSample]) -> float:
        """What the mini-batch's loss sum is divided by (algorithm.loss_normalizer's rule for loss_agg_mode), summed
        over data-parallel ranks (the samples differ)."""
        tokens = torch.tensor([len(s.response_ids) if s.in_loss else 0 for s in samples], dtype=torch.int64)
        local = loss_normalizer(tokens, self.algorithm.loss_agg_mode, self.max_response_length)
        return self.comm.sum([float(local)], "dp", "the token-mean's divisor")[0]

    def train_step(self, samples: list[TrainSample], temperature: float) -> dict[str, float]:
        """One optimizer step on this rank's share of a mini-batch (old_logp needed on the last stage).

        Returns metrics (identical on every rank): actor/loss, actor/grad_norm, actor/lr,
        clip fractions, ratio, approx KL, entropy, tokens, and whether the update was applied.
        """
        a, correction = self.algorithm, self.correction
        eps_low, eps_high = a.clip_bounds()
        kl_term = a.kl_coef > 0 and not a.kl_in_reward
        if self.is_last_stage and any(s.old_logp is None for s in samples):
            raise ValueError("train_step: every sample needs old_logp on the last stage (from compute_logprobs)")
        if kl_term and self.is_last_stage and any(s.ref_logp is None for s in samples):
            raise ValueError(
                "train_step: algorithm.kl_coef > 0: every sample needs ref_logp (the reference's logprobs)"
            )
        if correction.mode != "none" and self.is_last_stage:  # each response's weights, from its whole length
            samples = [
                s if s.rollout_logp is None else
                replace(s, is_weight=correction_weight(s.old_logp, s.rollout_logp, correction, a.log_ratio_clamp)[0])
                for s in samples
            ]  # fmt: skip
        normalizer = self.global_normalizer(samples)
        vocab = self.arch.vocab_size
        t0 = time.perf_counter()

        def loss_fn(mb: MicroBatch, logits: torch.Tensor):
            logp, entropy = token_logprobs(logits, mb.targets, temperature, vocab, self.comm, with_entropy=True)
            out = self.loss_fn(
                logp,
                mb.old_logp,
                mb.advantages,
                mb.loss_mask,
                eps_low=eps_low,
                eps_high=eps_high,
                dual_clip_c=a.dual_clip_c,
                is_weight=mb.is_weight,
                loss_agg_mode=a.loss_agg_mode,
                log_ratio_clamp=a.log_ratio_clamp,
                max_response_length=self.max_response_length,
                ref_logp=mb.ref_logp if kl_term else None,
                kl_coef=a.kl_coef,
                kl_estimator=a.kl_estimator,
                seq_index=mb.seq_index,
            )
            loss = out.loss_sum / max(normalizer, 1.0)
            stats = dict(out.stats)
            stats["entropy_sum"] = torch.where(mb.loss_mask, entropy, torch.zeros_like(entropy)).sum()
            stats["loss"] = loss.detach().float()
            return loss, out.normalizer.detach().to(torch.int), stats

        for m in self.model:
            m.zero_grad_buffer()
        self.optimizer.zero_grad()
        mbs = self._microbatches(samples, forward_only=False)
        self._scale_moe_losses(mbs)
        outputs = self._run(mbs, loss_fn, forward_only=False, routing=self._routing_mode(samples))
        metrics = self._reduce_metrics(outputs, normalizer, kl_term)  # identical on every rank: all skip together
        if self.routing is not None:
            metrics.update(self.routing.metrics())
        if math.isfinite(metrics["actor/loss"]):
            with torch.profiler.record_function("optimizer"):  # a range of its own in a profile (preflight's)
                applied, grad_norm, _ = self.optimizer.step()
        else:  # a NaN/inf loss would poison the weights and Adam's moments: drop this update
            applied, grad_norm = False, None
        if applied:
            self.scheduler.step(increment=1)
            self.optimizer_steps += 1
        metrics.update(
            {
                "actor/grad_norm": float(grad_norm) if grad_norm is not None else 0.0,
                "actor/lr": self.optimizer.param_groups[0]["lr"],
                "actor/update_applied": float(bool(applied)),
                "actor/normalizer": normalizer,
                "timing/train_step": time.perf_counter() - t0,
            }
        )
        return metrics

    def _scale_moe_losses(self, mbs: list[MicroBatch]) -> None:
        """The MoE auxiliary losses as a mean over the mini-batch's tokens. With calculate_per_token_loss Megatron's
        router multiplies each micro-batch's loss by its tokens and leaves the division by the total to
        finalize_model_grads, which this policy's loss (already divided by its own count) skips: so the coefficients
        Megatron reads are the configured ones over the tokens all routers see in the step (every micro-batch, every
        data- and context-parallel rank; row padding counts, as Megatron counts it)."""
        aux, z = self.moe_loss_coeffs
        if not (aux or z):
            return
        local = float(sum(mb.tokens.numel() for mb in mbs))
        total = max(self.comm.sum([local], "dp_cp", "the routers' tokens")[0], 1.0)  # CP ranks: different positions
        for chunk in self.model:
            config = provider.unwrap(chunk).config
            config.moe_aux_loss_coeff = aux / total
            config.moe_z_loss_coeff = z / total if z else None

    def _reduce_metrics(self, outputs: list[dict], normalizer: float, kl_term: bool) -> dict[str, float]:
        """Sum the last stage's statistics over micro-batches and the DP and CP ranks (CP ranks hold different
        positions), on every stage. kl_term: add actor/kl (the reference KL estimate per token) and actor/kl_loss (its
        part of actor/loss)."""
        keys = ["loss", "entropy_sum", "tokens", "clip_low", "clip_high", "clip_dual", "ratio_sum", "approx_kl_sum"]
        keys += ["kl_sum", "kl_loss_sum"]
        sums = torch.zeros(len(keys) + 1, dtype=torch.float64)
        if self.is_last_stage and outputs:
            stats = reduce_stats(outputs)
            for j, k in enumerate(keys):
                sums[j] = float(sum(float(o[k]) for o in outputs)) if k in ("loss", "entropy_sum") else float(stats[k])
            sums[-1] = float(stats["ratio_max"])
        sums = sums.to(self.layout.device)
        ratio_max = self.comm.count_once(sums[-1:], ("tp", "pp"), "max")  # TP ranks hold the same statistics
        sums = self.comm.count_once(sums[:-1], ("tp", "pp"))
        total = {k: torch.tensor(float(sums[j])) for j, k in enumerate(keys)}
        total["ratio_max"] = torch.tensor(float(ratio_max[0]))
        metrics = loss_metrics(total)
        tokens = max(float(total["tokens"]), 1.0)
        metrics["actor/loss"] = float(total["loss"])
        metrics["actor/entropy"] = float(total["entropy_sum"]) / tokens
        if kl_term:
            metrics["actor/kl"] = float(total["kl_sum"]) / tokens
            metrics["actor/kl_loss"] = float(total["kl_loss_sum"]) / max(normalizer, 1.0)
        return metrics
