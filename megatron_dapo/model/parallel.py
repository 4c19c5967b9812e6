"""Parallel state: torch.distributed and Megatron's process groups, from the torchrun environment.

One SPMD program per device, launched by torchrun: RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR and MASTER_PORT come from the environment (a lone process without torchrun is
rank 0 of 1). nccl on GPU, gloo on CPU. The layout is checked against the model before
anything is allocated, so an impossible one fails in a second, not after a checkpoint load.
Megatron keeps the groups themselves (megatron.core.parallel_state); `Layout` is our view: sizes and
this rank's place in each group, read once here so no other module asks torch.distributed or parallel_state
for a rank (they take a Layout, or ranks from one), and the collectives over the groups are model/comm.py's `Comm`,
built from the Layout. The exceptions, where no Layout can exist yet: the command
line reads RANK and WORLD_SIZE before any process group starts (cli.error_line's rank prefix, cli's rank-0-only
logging, train.py's start-up line, hf_export's one-process check), and rollout/vllm_env.py asks whether the
torchrun variables are set at all.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

from megatron_dapo import progress
from megatron_dapo.config import ConfigError, ModelConfig, ParallelConfig
from megatron_dapo.model import cpu_compat
from megatron_dapo.model.arch import ModelArch


class LayoutError(ConfigError):
    """A parallel layout that cannot hold the model on this world."""


@dataclass(frozen=True)
class Layout:
    world_size: int
    rank: int
    local_rank: int
    tp: int
    pp: int
    vpp: Optional[int]
    cp: int
    dp: int
    use_te: bool
    sequence_parallel: bool
    attention: str
    """The core attention that runs: 'te' (Transformer Engine's fused attention), 'sdpa' (model/attention.py) or
    'unfused' (Megatron-Core's local DotProductAttention): model.attention resolved for this machine."""
    tp_rank: int = 0
    """This rank's place in its tensor-, pipeline-, context- and data-parallel groups (Megatron's order)."""
    pp_rank: int = 0
    cp_rank: int = 0
    dp_rank: int = 0
    ep: int = 1
    """Expert parallel: the MoE layers' experts split over ep ranks (each holds num_experts / ep of them)."""
    etp: int = 1
    """Expert tensor parallel: each expert's weights split over etp ranks."""
    edp: int = 0
    """The experts' data parallel, world / (pp x ep x etp): the ranks holding the same experts (0: dense model)."""
    ep_rank: int = 0
    """This rank's place in its expert-, expert-tensor- and expert-data-parallel groups."""
    etp_rank: int = 0
    edp_rank: int = 0

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", self.local_rank) if torch.cuda.is_available() else torch.device("cpu")


def have_transformer_engine() -> bool:
    """TE needs CUDA: on CPU its mere presence breaks `import megatron.core`, so never probe there."""
    return torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None


def use_transformer_engine(model: ModelConfig) -> bool:
    if model.transformer_impl == "transformer_engine":
        if not have_transformer_engine():
            raise LayoutError(
                "model.transformer_impl='transformer_engine' but Transformer Engine is not usable here "
                "(it needs CUDA and the transformer-engine package); use 'local' or 'auto'"
            )
        return True
    return model.transformer_impl == "auto" and have_transformer_engine()


def resolve_attention(model: ModelConfig, use_te: bool) -> str:
    """model.attention -> 'te', 'sdpa' or 'unfused': 'auto' is TE's own fused attention under TE, else SDPA."""
    if model.attention == "auto":
        return "te" if use_te else "sdpa"
    return model.attention


def check_layout(arch: ModelArch, par: ParallelConfig, model: ModelConfig, world_size: int) -> Layout:
    """Validate a layout without touching a device; returns it with dp filled in (rank fields 0)."""
    te = use_transformer_engine(model)
    if not arch.is_moe:
        _check_dense(par)
    cells = par.tp * par.pp * par.cp
    if world_size % cells:
        raise LayoutError(
            f"world size {world_size} is not a multiple of parallel.tp x parallel.pp x parallel.cp = "
            f"{par.tp} x {par.pp} x {par.cp} = {cells}"
        )
    if arch.num_attention_heads % par.tp:
        raise LayoutError(f"parallel.tp={par.tp} must divide the model's {arch.num_attention_heads} attention heads")
    if arch.num_key_value_heads % par.tp:
        raise LayoutError(
            f"parallel.tp={par.tp} must divide the model's {arch.num_key_value_heads} query groups (KV heads)"
        )
    stages = par.pp * (par.vpp or 1)
    if arch.num_layers % stages:
        what = f"parallel.pp x parallel.vpp = {par.pp} x {par.vpp}" if par.vpp else f"parallel.pp={par.pp}"
        raise LayoutError(f"the model's {arch.num_layers} layers do not split evenly over {what} stages")
    if par.cp > 1 and not te:
        raise LayoutError(f"parallel.cp={par.cp} needs Transformer Engine (GPU only); use parallel.cp=1 here")
    attention = resolve_attention(model, te)
    if par.cp > 1 and attention != "te":
        raise LayoutError(
            f"parallel.cp={par.cp} needs Transformer Engine's attention (ring attention), but model.attention="
            f"{model.attention!r}: use model.attention=auto"
        )
    if model.fp8 is not None and not te:
        raise LayoutError(f"model.fp8={model.fp8!r} needs Transformer Engine (GPU only); set model.fp8=null")
    edp = _check_experts(arch, par, model, world_size) if arch.is_moe else 0
    return Layout(
        world_size=world_size,
        rank=0,
        local_rank=0,
        tp=par.tp,
        pp=par.pp,
        vpp=par.vpp,
        cp=par.cp,
        dp=world_size // cells,
        use_te=te,
        sequence_parallel=par.sequence_parallel and par.tp > 1,
        attention=attention,
        ep=par.ep,
        etp=par.etp,
        edp=edp,
    )


def _check_experts(arch: ModelArch, par: ParallelConfig, model: ModelConfig, world_size: int) -> int:
    """The MoE layout's checks (Megatron's expert groups: etp x ep x edp x pp = world); returns edp."""
    if par.pp > 1 and model.moe_token_dispatcher == "allgather":
        raise LayoutError(
            f"model.moe_token_dispatcher='allgather' cannot run with parallel.pp={par.pp}: Megatron's allgather "
            "dispatcher takes no variable sequence lengths between stages; use 'alltoall'"
        )
    if par.etp > par.tp or par.tp % par.etp:
        raise LayoutError(f"parallel.etp={par.etp} must divide parallel.tp={par.tp} (and not exceed it)")
    if arch.num_experts % par.ep:
        raise LayoutError(f"parallel.ep={par.ep} must divide the model's {arch.num_experts} experts")
    if arch.moe_intermediate_size % par.etp:
        raise LayoutError(
            f"parallel.etp={par.etp} must divide the experts' width moe_intermediate_size={arch.moe_intermediate_size}"
        )
    cells = par.etp * par.ep * par.pp
    if world_size % cells:
        raise LayoutError(
            f"world size {world_size} is not a multiple of parallel.etp x parallel.ep x parallel.pp = "
            f"{par.etp} x {par.ep} x {par.pp} = {cells} (the expert layers' groups)"
        )
    return world_size // cells


def _check_dense(par: ParallelConfig) -> None:
    """A dense model has no experts to split: ep and etp must stay 1."""
    for key in ("ep", "etp"):
        if getattr(par, key) != 1:
            raise LayoutError(f"parallel.{key}={getattr(par, key)} needs a mixture-of-experts model; this one is dense")


def env_place() -> tuple[int, int, int]:
    """(rank, world size, local rank) as torchrun's environment gives them (a lone process: 0, 1, 0)."""
    return (
        int(os.environ.get("RANK", "0")),
        int(os.environ.get("WORLD_SIZE", "1")),
        int(os.environ.get("LOCAL_RANK", "0")),
    )


def _timeout(timeout_s: Optional[float]) -> dict[str, Any]:
    """init_process_group's timeout argument (None: torch's default)."""
    return {} if timeout_s is None else {"timeout": timedelta(seconds=timeout_s)}


def world_layout(rank: int = 0, world_size: int = 1, local_rank: int = 0) -> Layout:
    """The Layout of a world without Megatron's groups (a lone process, the asynchronous rollout processes): no model
    parallelism, each rank a data-parallel replica of its own."""
    return Layout(
        world_size=world_size,
        rank=rank,
        local_rank=local_rank,
        tp=1,
        pp=1,
        vpp=None,
        cp=1,
        dp=world_size,
        use_te=False,
        sequence_parallel=False,
        attention="sdpa",
        dp_rank=rank,
    )


def init_plain_world(timeout_s: Optional[float] = None) -> Layout:
    """torch.distributed's world from the environment, without Megatron's groups: the asynchronous rollout
    processes' (their loaders' collectives, their engines' groups; objects over gloo, CUDA tensors over NCCL). A lone
    process starts none. timeout_s: every collective's (trainer.collective_timeout_s; None: torch's default).
    Returns its world_layout."""
    rank, world_size, local_rank = env_place()
    if world_size > 1:
        if torch.cuda.is_available():
            torch.cuda.set_device(local_rank)
        dist.init_process_group("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo", **_timeout(timeout_s))
    return world_layout(rank, world_size, local_rank)


def _group_names() -> dict[Any, str]:
    """{process group: a name}: the world, Megatron's groups and vLLM's (of the libraries this process imported)."""
    names: dict[Any, str] = {}
    vllm = sys.modules.get("vllm.distributed.parallel_state")
    for attr, value in vars(vllm).items() if vllm else ():
        for kind in ("device_group", "cpu_group"):
            if getattr(value, kind, None) is not None:
                names[getattr(value, kind)] = f"vllm:{attr.strip('_').lower()}:{kind.split('_')[0]}"
    megatron = sys.modules.get("megatron.core.parallel_state")
    for attr, value in vars(megatron).items() if megatron else ():
        for i, group in enumerate(value if isinstance(value, list) else [value]):
            if isinstance(group, dist.ProcessGroup):
                names.setdefault(group, f"megatron:{attr.strip('_').lower()}" + (f"[{i}]" if i else ""))
    if dist.is_initialized():
        names[dist.group.WORLD] = "world"
    return names


def group_timeout_s(group: Any) -> float:
    """A process group's collective timeout, as its backend (gloo, NCCL) holds it; -1 where a backend does not say
    (what is published is a record, never a reason to stop a run)."""
    try:
        return min(group._get_backend(d).options._timeout.total_seconds() for d in group._device_types)
    except (AttributeError, RuntimeError):
        return -1.0


def arm_group_timeouts(timeout_s: float) -> dict[str, float]:
    """Give every process group of this process (the world, Megatron's, vLLM's: those torch.distributed knows) the
    run's collective timeout, once the last of them exists (after the engine is built: vLLM makes its own with
    torch's default); returns and publishes (progress.STATE.groups) each one's timeout by name."""
    from torch.distributed import distributed_c10d as c10d

    names = _group_names()
    armed = {}
    for group, tag in list(c10d._world.pg_names.items()):
        c10d._set_pg_timeout(timedelta(seconds=timeout_s), group)
        armed[names.get(group, f"group {tag}")] = group_timeout_s(group)
    progress.STATE.groups.update(armed)
    return armed


def init_parallel(
    arch: ModelArch, par: ParallelConfig, model: ModelConfig, seed: int, timeout_s: Optional[float] = None
) -> Layout:
    """torch.distributed + Megatron process groups + Megatron's model-parallel RNG, from the environment; timeout_s:
    every group's collective timeout (trainer.collective_timeout_s; None: torch's and Megatron's defaults)."""
    rank, world_size, local_rank = env_place()
    layout = check_layout(arch, par, model, world_size)  # before any allocation
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        backend = "nccl"
    else:
        cpu_compat.enable()
        backend = "gloo"
    if not dist.is_initialized():
        if world_size == 1:  # a lone process: its store binds a port of its own (0), so none can be taken first
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", "0")
        dist.init_process_group(backend=backend, rank=rank, world_size=world_size, **_timeout(timeout_s))

    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=par.tp,
        pipeline_model_parallel_size=par.pp,
        virtual_pipeline_model_parallel_size=par.vpp,
        context_parallel_size=par.cp,
        expert_model_parallel_size=par.ep,
        expert_tensor_parallel_size=par.etp,
        **({} if timeout_s is None else {"distributed_timeout_minutes": timeout_s / 60}),
    )
    model_parallel_cuda_manual_seed(seed)
    ranks = dict(
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
        cp_rank=parallel_state.get_context_parallel_rank(),
        dp_rank=parallel_state.get_data_parallel_rank(),
        ep_rank=parallel_state.get_expert_model_parallel_rank(),
        etp_rank=parallel_state.get_expert_tensor_parallel_rank(),
        edp_rank=parallel_state.get_expert_data_parallel_rank(),
    )
    return Layout(**{**layout.__dict__, "rank": rank, "local_rank": local_rank, **ranks})


def destroy_parallel() -> None:
    """Megatron's groups and torch.distributed's world, if they are still there (a colocated engine's shutdown takes
    the world with it)."""
    if not dist.is_initialized():
        return
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
