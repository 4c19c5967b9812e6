"""A paper-scale discrete-event model of generation time per rollout step, driving the real SamplingScheduler.

What it answers: at the paper's scale (Qwen2.5-32B, 512 prompts x 16 responses per step, 128 H100 as
32 colocated vLLM engines of TP=4, as verl's DAPO 32B recipe), how long does one rollout step's
generation take with each sampler mode (fill dropping or carrying the surplus, stream, stream with
partial rollout, and an oracle that only ever draws informative prompts)? The decisions are made by
megatron_dapo.sampling.scheduler.SamplingScheduler itself, fed exactly as DynamicSamplingLoader.next_batch
feeds it; only the engines and the prompts' outcomes are simulated.

Modules, each with its assumptions in its docstring (benchmarks/SAMPLER_CALIBRATION.md has the
calibration's arithmetic): hardware.py (model shapes, GPU datasheet numbers), calibration.py (the
step-time factors fitted to published vLLM measurements), engines.py (one engine's time model and
N engines with continuous batching), workload.py (prompts' difficulty, response lengths and
correctness), driver.py (simulate(): the scheduler and the engines, one table row at a time).
"""
