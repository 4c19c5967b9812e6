"""The simulated workload: per prompt a difficulty and a length scale, per sample a length and its correctness.

Per prompt a success probability q ~ Beta(a, a), with a solved so that the expected informative
fraction of 16-sample groups equals p, truncated samples counted wrong (without truncation it is
1 - 2 B(a, a + 16) / B(a, a)): a symmetric, U-shaped difficulty, most prompts nearly always or never
solved. Per sample a length
exp(mu + 0.5 z_prompt + 0.6 z_sample) (z standard normal: samples of one prompt correlate), mu solved so
the mean after capping at 20,480 is 4,500 (late run, ~1% truncated) or 2,000 (early run); a truncated
sample is wrong (no final answer), otherwise right with probability q, independently of its length.
Prompts: 150-450 tokens (uniform; DAPO-Math problems in their template). 17,917 prompts (DAPO-Math-17K).
Outcomes are a function of (prompt, the group's seed, sample index): a resubmitted prompt gets new
responses. The oracle row uses the same lengths with every group informative (p = 1).

Drift (the prompt-memory rows; drift = 0 elsewhere): training makes prompts easier, so a prompt's success
probability at policy version v is q(v) = sigmoid(logit q + drift v). Written down before any prompt-memory
result: drift = 0.02 a step, a modelling choice rather than a measurement; it moves a prompt at q = 0.5 to
0.60 after 20 steps and 0.69 after 40, while the U-shaped majority near 0 or 1 barely moves, so the informative
fraction changes slowly and the all-correct share grows (bench_sampler prints the fraction it measures per row).
A prompt never gets harder (no forgetting is modelled).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from megatron_dapo.algorithm.overlong import soft_overlong_punishment

LENGTH_REGIMES = {"late": 4500.0, "early": 2000.0}
"""Mean response length (tokens, after the 20,480 cap) of the benchmarks' two regimes: late and early in the paper's
run (tools/bench_sampler.py, tools/bench_async.py)."""


def _phi(x: float) -> float:
    """Standard normal CDF."""
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


def _beta_informative(a: float, group: int, keep: tuple[np.ndarray, np.ndarray] = (np.ones(1), np.ones(1))) -> float:
    """Expected informative fraction of `group`-sample groups when q ~ Beta(a, a) and a sample is right with
    probability c q, c = its chance not to be truncated (a truncated sample is wrong).

    keep: (c values, their probabilities) over prompts. With moments m_k = E[q^k] = prod_{i<k} (a+i)/(2a+i):
    P(all right | c) = c^G m_G and P(all wrong | c) = E[(1 - c q)^G] = sum_k C(G, k) (-c)^k m_k.
    """
    m = np.cumprod([1.0] + [(a + i) / (2 * a + i) for i in range(group)])
    coef = np.array([math.comb(group, k) * (-1.0) ** k for k in range(group + 1)])
    c, weight = keep
    powers = c[:, None] ** np.arange(group + 1)[None, :]
    all_right = powers[:, group] * m[group]
    all_wrong = powers @ (coef * m)
    return float(np.sum(weight * (1.0 - all_right - all_wrong)))


def solve_beta(p: float, group: int = 16, keep: tuple[np.ndarray, np.ndarray] = (np.ones(1), np.ones(1))) -> float:
    """The Beta(a, a) concentration a whose expected informative fraction is p (bisection on log a; see above)."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"informative fraction p={p}: expected 0 < p < 1 (use oracle=True for p = 1)")
    lo, hi = -12.0, 12.0
    for _ in range(100):
        mid = (lo + hi) / 2
        if _beta_informative(math.exp(mid), group, keep) < p:
            lo = mid
        else:
            hi = mid
    return math.exp((lo + hi) / 2)


def _capped_lognormal_mean(mu: float, sigma: float, cap: float) -> float:
    """E[min(X, cap)] for log X ~ N(mu, sigma^2)."""
    lc = math.log(cap)
    return math.exp(mu + sigma**2 / 2) * _phi((lc - mu - sigma**2) / sigma) + cap * (1.0 - _phi((lc - mu) / sigma))


@dataclass(frozen=True)
class Workload:
    """Prompts and their sampled responses: difficulty, lengths, correctness (module docstring).

    p: expected informative fraction of groups; mean_len: mean response length after the cap (tokens).
    """

    p: float = 0.5
    mean_len: float = 4500.0
    max_len: int = 20480
    sigma_prompt: float = 0.5
    sigma_sample: float = 0.6
    prompt_len: tuple[int, int] = (150, 450)
    num_prompts: int = 17917
    group_size: int = 16
    oracle: bool = False
    """Every group informative (p = 1), same lengths: the floor that prompt memory aims at."""
    seed: int = 0
    overlong_buffer: int = 4096
    drift: float = 0.0
    """Success-logit increase per policy version (module docstring); 0: every prompt's difficulty is fixed."""

    @cached_property
    def mu(self) -> float:
        """Log-length location solved so that E[min(length, max_len)] = mean_len."""
        sigma = math.hypot(self.sigma_prompt, self.sigma_sample)
        lo, hi = -5.0, math.log(self.max_len)
        for _ in range(200):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if _capped_lognormal_mean(mid, sigma, self.max_len) < self.mean_len else (lo, mid)
        return (lo + hi) / 2

    @cached_property
    def beta_a(self) -> float:
        """The Beta(a, a) concentration of per-prompt success probabilities (1 for the oracle, unused there).

        Solved with truncation counted: a prompt of length factor z truncates a sample with probability
        t(z) = 1 - Phi((ln(max_len - 1/2) - mu - sigma_prompt z) / sigma_sample), integrated over z (Gauss-Hermite).
        """
        if self.oracle:
            return 1.0
        z, w = np.polynomial.hermite_e.hermegauss(48)
        lc = math.log(self.max_len - 0.5)
        keep = np.array([_phi((lc - self.mu - self.sigma_prompt * x) / self.sigma_sample) for x in z])
        return solve_beta(self.p, self.group_size, (keep, w / math.sqrt(2 * math.pi)))

    @cached_property
    def _prompt_table(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per prompt: success probability q, length factor z, prompt length (tokens)."""
        rng = np.random.default_rng([self.seed, 0])
        q = rng.beta(self.beta_a, self.beta_a, size=self.num_prompts)
        z = rng.standard_normal(self.num_prompts)
        lo, hi = self.prompt_len
        return q, z, rng.integers(lo, hi + 1, size=self.num_prompts)

    @property
    def prompts(self) -> np.ndarray:
        """Prompt lengths in tokens, int64[num_prompts]."""
        return self._prompt_table[2]

    def success(self, prompt: int, version: int = 0) -> float:
        """The prompt's success probability under policy version `version` (drift: module docstring)."""
        q = float(self._prompt_table[0][prompt])
        if self.drift == 0.0:
            return q
        q = min(max(q, 1e-12), 1.0 - 1e-12)
        return 1.0 / (1.0 + math.exp(-(math.log(q / (1.0 - q)) + self.drift * version)))

    def group(self, prompt: int, seed: int, version: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(lengths int64[G], correct bool[G], truncated bool[G]) of prompt `prompt` submitted with group seed `seed`
        under policy version `version`."""
        _, z_prompt, _ = self._prompt_table
        rng = np.random.default_rng([self.seed, 1, prompt, seed])
        z = rng.standard_normal(self.group_size)
        u = rng.random(self.group_size)
        raw = np.exp(self.mu + self.sigma_prompt * z_prompt[prompt] + self.sigma_sample * z)
        lengths = np.clip(np.rint(raw), 1, self.max_len).astype(np.int64)
        truncated = lengths >= self.max_len
        correct = (u < self.success(prompt, version)) & ~truncated  # a truncated response has no final answer
        if self.oracle:
            correct[0], correct[1] = True, False
        return lengths, correct, truncated

    def shaped_rewards(self, lengths: np.ndarray, correct: np.ndarray) -> np.ndarray:
        """+1 / -1 plus DAPO's soft overlong punishment (buffer `overlong_buffer` before max_len): the trainer's own
        rule (algorithm/overlong.py). lengths: [...] int, correct: [...] bool; returns [...] float64."""
        flat = torch.from_numpy(np.ascontiguousarray(lengths).reshape(-1))
        penalty = soft_overlong_punishment(flat, self.max_len, self.overlong_buffer).numpy().reshape(lengths.shape)
        return np.where(correct, 1.0, -1.0) + penalty.astype(np.float64)
