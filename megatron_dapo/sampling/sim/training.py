"""The simulator's training and weight-refit phases, calibrated from published figures (written down before any
asynchronous result was simulated; benchmarks/SAMPLER_CALIBRATION.md has the same with the arithmetic).

A step trains D tokens: every response of the batch's groups with its prompt (512 groups x 16 responses at the
paper's settings). On Megatron with the shipped 32B example's full activation recompute
(examples/dapo_math_qwen2.5_32b.yaml: `recompute: full`):

    train FLOPs      = 8 N D     forward 2ND + backward 4ND + the recomputed forward 2ND
    old-logprob FLOPs = 2 N D    one forward pass over the same tokens (the proximal policy's logprobs)

at TRAIN_FLOPS_PER_GPU per GPU, counting recompute as work done: NeMo AutoModel's performance summary
(docs.nvidia.com/nemo/automodel, "Pre-Training Performance", System DGX-H100, Precision BF16): Llama3 70B, 64
GPUs, sequence 8192, TE + fsdp2_prefetch: 389 model TFLOP/s per GPU, 39% of the H100's 989 dense peak. It is the
published dense pre-training figure nearest a 32B model at a long sequence (the table's Qwen2.5 32B rows are LoRA
fine-tuning). RL micro-batches of varying length and pipeline bubbles run slower than pre-training: the tables'
x0.5 column covers that, x2 a better-tuned run.

Refit: the policy's bf16 weights (2 N bytes, 65.5 GB for Qwen2.5-32B) reach the engines at REFIT_BYTES_PER_S:
MoonshotAI/checkpoint-engine's README benchmark (broadcast update into vLLM 0.10.2rc1, whole models):
GLM-4.5-Air BF16 (106e9 params, 212 GB) on 8 x H800 TP8 in 3.47 s = 61 GB/s; Qwen3-235B-A22B BF16 (470 GB) on
8 x H800 TP8 in 6.22 s = 76 GB/s; DeepSeek-V3.1 FP8 (671 GB) on 256 x H20 TP16 in 11.33 s = 59 GB/s; Kimi-K2 FP8
(1.04e12 params, 1.04 TB) on 256 x H20 TP16 in 16.04 s = 65 GB/s. The median, 63 GB/s, gives 1.04 s for
Qwen2.5-32B. Colocated and asynchronous rows pay the same refit: colocated also puts vLLM to sleep and wakes it
and moves the optimizer state, which is not modelled (it favours colocated). In the asynchronous rows the engines
stop generating for the refit (their weights are being overwritten) and the trainer waits for it before the next
step; with `pipeline.recompute_kv` they would also re-read every running sequence's context (not modelled here:
the rows keep the KV cache).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from megatron_dapo.sampling.sim.hardware import QWEN25_32B, ModelSpec

TRAIN_FLOPS_PER_GPU = 389e12
"""Sustained training FLOP/s per H100 (module docstring: NeMo AutoModel, Llama3 70B, DGX-H100 BF16)."""
REFIT_BYTES_PER_S = 63e9
"""Weight refit rate into the engines (module docstring: checkpoint-engine's four published whole-model updates)."""
TRAIN_FLOPS_PER_TOKEN = 8
"""x N per token: forward, backward and the full-recompute forward."""
LOGPROB_FLOPS_PER_TOKEN = 2
"""x N per token: the old-logprob forward pass."""


@dataclass(frozen=True)
class TrainModel:
    """The training side's time model: the step's training and old-logprob passes on `gpus` GPUs, and the refit."""

    model: ModelSpec = QWEN25_32B
    flops_per_gpu: float = TRAIN_FLOPS_PER_GPU
    refit_bytes_per_s: float = REFIT_BYTES_PER_S

    def train_seconds(self, tokens: float, gpus: int) -> float:
        """Old-logprob pass and training over `tokens` (prompts and responses) on `gpus` GPUs."""
        flops = (TRAIN_FLOPS_PER_TOKEN + LOGPROB_FLOPS_PER_TOKEN) * self.model.params * tokens
        return flops / (gpus * self.flops_per_gpu)

    @property
    def refit_seconds(self) -> float:
        """The bf16 weights into the engines."""
        return self.model.weight_bytes / self.refit_bytes_per_s

    def scaled(self, flops: float = 1.0, refit: float = 1.0) -> TrainModel:
        """The sensitivity columns: the training rate and the refit rate times these factors."""
        return replace(self, flops_per_gpu=self.flops_per_gpu * flops, refit_bytes_per_s=self.refit_bytes_per_s * refit)
