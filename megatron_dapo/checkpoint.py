"""Training checkpoints: model + optimizer as a Megatron distributed checkpoint, plus per-rank trainer state.

    root/
      latest                  the name of the newest complete checkpoint, updated last
      step_00000010/
        dist/                 dist_checkpointing of {model, optimizer} (loads into any TP/PP/DP layout)
        state/rank00000.pt    this rank's scheduler, RNG states and the trainer's own state (loader, counters)
        COMPLETE              written when every rank has finished

A checkpoint is written under `step_N.tmp` and renamed when complete, and `latest` is
replaced atomically after that, so a crash mid-save never leaves a half checkpoint that
looks whole; a save that fails removes its `step_N.tmp` (a full disk says so, with the space it needs). `load` falls
back from a missing or unreadable checkpoint to the previous complete one, saying so; a state file that names code
to run is refused outright (convert/resolve.py read_rank_state: torch's weights-only unpickler). The optimizer uses the distributed optimizer's dp_reshardable
format (the default one cannot be saved from every layout). The layout's file names and the
search for complete steps are convert/resolve.py's, so the conversion tools read it without
importing this module.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
from pathlib import Path
from typing import Any, Optional

import torch

from megatron_dapo import progress
from megatron_dapo.cli import UserError
from megatron_dapo.convert.megatron_io import in_process_write_results, model_sharded_state_dict
from megatron_dapo.convert.resolve import (
    COMPLETE,
    LATEST,
    UnsafeCheckpoint,
    complete_steps,
    rank_state_file,
    read_rank_state,
    step_candidates,
)
from megatron_dapo.model.provider import unwrap

log = logging.getLogger("megatron_dapo.checkpoint")

_OPTIM_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}


class CheckpointError(UserError, RuntimeError):
    """No checkpoint could be loaded: the message lists what was tried and why each failed."""


def _step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


def _rng_states() -> dict[str, Any]:
    import random

    import numpy as np

    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    state["megatron_tracker"] = get_cuda_rng_tracker().get_states()
    return state


def _set_rng_states(state: dict[str, Any]) -> None:
    import random

    import numpy as np

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if torch.cuda.is_available() and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    get_cuda_rng_tracker().set_states(state["megatron_tracker"])


def _ensure_optimizer_state(optimizer) -> None:
    """A never-stepped distributed optimizer has no Adam state to load into: give it some first.

    Megatron's own initialiser takes a step with zero gradients; every value it touches (the
    fp32 main params, the moments, the step count) is then overwritten by the checkpoint.
    """
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if inner is not None and not inner.state and hasattr(opt, "_init_optimizer_states_with_dummy_values"):
            opt._init_optimizer_states_with_dummy_values()


def _fresh_adam_state(optimizer) -> None:
    """Give a never-stepped torch Adam(W) the state its first step would create: step 0 and zero moments.

    Saving asks every parameter's state for its step (Megatron's distributed optimizer asserts one common value), so
    a run whose every update so far was skipped (a non-finite loss from the first step on) could not be saved. The
    state is exactly what torch.optim.AdamW initialises lazily, so the next step is the same either way.
    """
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if not isinstance(inner, torch.optim.Adam | torch.optim.AdamW) or inner.state:
            continue
        for group in inner.param_groups:
            on_device = group.get("capturable") or group.get("fused")
            for p in group["params"]:
                moments = (
                    ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if group.get("amsgrad") else ("exp_avg", "exp_avg_sq")
                )
                inner.state[p] = {
                    "step": torch.zeros((), device=p.device if on_device else "cpu"),
                    **{m: torch.zeros_like(p, memory_format=torch.preserve_format) for m in moments},
                }


def _restore_adam_steps(optimizer) -> None:
    """Give every parameter its own Adam `step` tensor, holding the checkpoint's step.

    Megatron stores one common step in the param groups; after a dist-checkpoint load the
    per-parameter torch AdamW state can keep the step of the state it was loaded into (the dummy
    initialisation's 1), or share one tensor that torch then increments once per parameter.
    Either way bias correction runs wrong and the resumed run silently drifts (~1e-4 per step here).
    """
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        for group in getattr(inner, "param_groups", []):
            step = group.get("step")
            for p in group["params"]:
                state = inner.state.get(p)
                if state and isinstance(state.get("step"), torch.Tensor):
                    value = float(step) if step is not None else float(state["step"])
                    state["step"] = torch.tensor(value, dtype=state["step"].dtype, device=state["step"].device)


def _sharded_state(policy, is_loading: bool) -> tuple[dict, dict]:
    """(the model's sharded state dict, it with the optimizer's added): what dist_checkpointing saves and loads."""
    model_sd = model_sharded_state_dict(policy.model)
    optim_sd = policy.optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=_OPTIM_METADATA)
    return model_sd, {**model_sd, "optimizer": optim_sd}


class CheckpointMismatch(CheckpointError):
    """A checkpoint this run cannot take whichever candidate is tried: refused at once, no fallback."""


class CheckpointSpaceError(CheckpointError):
    """A save that ran out of disk space: its partial folder was removed."""


def _out_of_space(e: BaseException, where: Path) -> bool:
    """e (or what caused it) is a full disk: ENOSPC, or a writer's failure while `where`'s filesystem has no room
    (torch's zip writer reports a short write as 'unexpected pos')."""
    seen: BaseException | None = e
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        seen = seen.__cause__ or seen.__context__
    try:
        return shutil.disk_usage(where).free < 1 << 20
    except OSError:
        return False


def _tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _state_bytes(sharded: dict) -> int:
    """The bytes of the tensors in a sharded state dict (Megatron's ShardedTensors hold theirs in .data)."""
    total, todo = 0, [sharded]
    while todo:
        x = todo.pop()
        if isinstance(x, dict):
            todo.extend(x.values())
        elif isinstance(x, (list, tuple)):
            todo.extend(x)
        else:
            t = x if isinstance(x, torch.Tensor) else getattr(x, "data", None)
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


def layer_impl(layout) -> dict[str, Any]:
    """What a checkpoint records of how its layers were built: the layer spec (Transformer Engine's and the local
    one order their parameters and gradient buckets differently, so the optimizer state maps only onto the same
    spec), the core attention (no parameters of its own: a change is only worth a warning) and the expert split
    (ep, etp: the distributed optimizer shards the experts' state over their own data-parallel group, which another
    split regroups)."""
    return {
        "transformer_impl": "transformer_engine" if layout.use_te else "local",
        "attention": layout.attention,
        "ep": layout.ep,
        "etp": layout.etp,
    }


def check_layer_impl(saved: Optional[dict], layout, ckpt: Path) -> None:
    """Refuse a checkpoint saved under the other layer spec; warn when only the attention differs. A checkpoint
    from before layers were recorded passes (it can only have been saved with the local spec or TE as here)."""
    if saved is None:
        return
    now = layer_impl(layout)
    if saved["transformer_impl"] != now["transformer_impl"]:
        raise CheckpointMismatch(
            f"{ckpt} was saved with model.transformer_impl={saved['transformer_impl']!r} and this run builds "
            f"{now['transformer_impl']!r} layers (their parameter order differs): resume with "
            f"model.transformer_impl={saved['transformer_impl']}, or convert it (tools/convert_megatron_to_hf.py)"
        )
    for key in ("ep", "etp"):  # recorded since mixture-of-experts models: older checkpoints are dense (1)
        if saved.get(key, 1) != now[key]:
            raise CheckpointMismatch(
                f"{ckpt} was saved with parallel.{key}={saved.get(key, 1)} and this run has parallel.{key}={now[key]} "
                f"(the experts' optimizer state is sharded by that split): resume with parallel.{key}="
                f"{saved.get(key, 1)}, or convert the weights (tools/convert_megatron_to_hf.py) and start from them"
            )
    if saved["attention"] != now["attention"] and layout.rank == 0:
        log.warning(
            "%s was trained with attention %r, this run uses %r: the same parameters, slightly different rounding",
            ckpt,
            saved["attention"],
            now["attention"],
        )


class CheckpointManager:
    """Save, find and load training checkpoints under root, keeping the newest keep_last."""

    def __init__(self, root: str | Path, keep_last: int = 3) -> None:
        if keep_last < 1:
            raise ValueError(f"checkpoint keep_last={keep_last}: expected an integer >= 1")
        self.root = Path(root)
        self.keep_last = keep_last

    # ---------------------------------------------------------------- save

    def save(self, policy, step: int, trainer_state: dict[str, Any]) -> Path:
        """Collective: every rank calls with its own trainer_state (plain containers and tensors)."""
        final = _step_dir(self.root, step)
        tmp = final.with_name(final.name + ".tmp")
        rank = policy.layout.rank
        with progress.phase("save"):
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)  # a previous crash mid-save
                (tmp / "state").mkdir(parents=True)
                (tmp / "dist").mkdir()
            policy.comm.barrier("a checkpoint's start")
            self._write(policy, step, trainer_state, tmp)
            policy.comm.barrier("a checkpoint's end")
            self._complete(policy, tmp, final)
        return final

    def _write(self, policy, step: int, trainer_state: dict[str, Any], tmp: Path) -> None:
        """This rank's shards and state file into tmp; a failure removes tmp and raises (a full disk: one line
        naming the path and the space a checkpoint needs)."""
        from megatron.core import dist_checkpointing
        from torch.distributed.checkpoint.api import CheckpointException

        _fresh_adam_state(policy.optimizer)
        _, sharded = _sharded_state(policy, is_loading=False)
        rank = policy.layout.rank
        try:
            with in_process_write_results():
                dist_checkpointing.save(sharded, str(tmp / "dist"))
            progress.point("save")  # this rank's shards are written
            state = {
                "step": step,
                "scheduler": policy.scheduler.state_dict(),
                "optimizer_steps": policy.optimizer_steps,
                "rng": _rng_states(),
                "layers": layer_impl(policy.layout),
                "trainer": trainer_state,
            }
            torch.save(state, rank_state_file(tmp, rank))
            progress.point("save")
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - torch DCP's is a BaseException
            full = _out_of_space(e, tmp if tmp.exists() else self.root)
            shutil.rmtree(tmp, ignore_errors=True)  # a half-written step_N.tmp is never taken, so never kept either
            if not full:
                raise
            complete = self.complete()
            need = _tree_bytes(complete[-1]) if complete else _state_bytes(sharded) * policy.layout.world_size
            free = shutil.disk_usage(self.root).free
            raise CheckpointSpaceError(
                f"checkpoint of step {step}: no space left on the device of {self.root} (a checkpoint of this run "
                f"needs about {need / 2**20:.0f} MiB; {free / 2**20:.0f} MiB are free with the partial one removed); "
                f"the newest complete checkpoint is {complete[-1].name if complete else 'none'}: free space or move "
                "trainer.run_dir, then resume"
            ) from None

    def _complete(self, policy, tmp: Path, final: Path) -> None:
        """Rank 0 marks tmp complete, renames it to final and points `latest` at it; every rank waits for that."""
        if policy.layout.rank == 0:
            (tmp / COMPLETE).write_text(f"{policy.layout.world_size}\n")
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            latest_tmp = self.root / f"{LATEST}.tmp"
            latest_tmp.write_text(final.name + "\n")
            os.replace(latest_tmp, self.root / LATEST)  # last: a reader never sees a pointer to a partial save
            self._prune()
        policy.comm.barrier("a checkpoint's rename by rank 0")

    def _prune(self) -> None:
        complete = self.complete()
        for old in complete[: -self.keep_last]:
            shutil.rmtree(old, ignore_errors=True)

    # ---------------------------------------------------------------- find

    def complete(self) -> list[Path]:
        """Complete checkpoints, oldest first."""
        return complete_steps(self.root)

    def candidates(self) -> list[Path]:
        """What load tries, in order: the one `latest` names, then the other complete ones, newest first."""
        return step_candidates(self.root)

    def peek_trainer_state(self, rank: int) -> Optional[dict[str, Any]]:
        """The trainer state load() would most likely return (the first candidate with rank's state file), read
        without touching a model: for checks worth making before anything expensive starts. None if there is none."""
        for ckpt in self.candidates():
            try:
                return read_rank_state(rank_state_file(ckpt, rank))["trainer"]
            except Exception:  # noqa: BLE001 - unreadable: load() will fall back past it, and so do we
                continue
        return None

    # ---------------------------------------------------------------- load

    def load(self, policy, path: Optional[str | Path] = None) -> Optional[dict[str, Any]]:
        """Restore policy (model, optimizer, scheduler, RNG) from path or the newest usable checkpoint.

        Returns the saved step and this rank's trainer state ({"step": ..., "trainer": ...}), or
        None when the root holds no checkpoint at all. Raises CheckpointError when every candidate fails.
        """
        tried = [Path(path)] if path is not None else self.candidates()
        if not tried:
            return None
        from torch.distributed.checkpoint.api import CheckpointException

        failures = []
        for ckpt in tried:
            try:
                state = self._load_one(policy, ckpt)
            except (CheckpointMismatch, UnsafeCheckpoint):
                raise  # every older checkpoint of the run was saved the same way; one naming code was put there
            except (Exception, CheckpointException) as e:  # noqa: BLE001 - (a BaseException) try the previous one
                failures.append(f"{ckpt}: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
                log.warning("checkpoint %s is not usable (%s); trying the previous one", ckpt, failures[-1])
                continue
            if failures and policy.layout.rank == 0:
                log.warning("resumed from %s after %d unusable newer checkpoint(s)", ckpt, len(failures))
            return state
        raise CheckpointError("no usable checkpoint: " + "; ".join(failures))

    def _load_one(self, policy, ckpt: Path) -> dict[str, Any]:
        from megatron.core import dist_checkpointing

        if not (ckpt / COMPLETE).is_file():
            raise CheckpointError(f"{ckpt} is incomplete (no {COMPLETE} marker)")
        layout = policy.layout
        rank_file = rank_state_file(ckpt, layout.rank)
        saved_world = int((ckpt / COMPLETE).read_text().strip() or 0)
        if saved_world != layout.world_size or not rank_file.is_file():
            raise CheckpointError(
                f"{ckpt} was saved by {saved_world} ranks, this run has {layout.world_size}: "
                "convert it (tools/convert_megatron_to_hf.py) to change the layout"
            )
        state = read_rank_state(rank_file)
        check_layer_impl(state.get("layers"), layout, ckpt)
        _ensure_optimizer_state(policy.optimizer)
        model_sd, sharded = _sharded_state(policy, is_loading=True)
        with torch.no_grad():
            loaded = dist_checkpointing.load(sharded, str(ckpt / "dist"))
            for key, chunk in zip(model_sd, policy.model):
                unwrap(chunk).load_state_dict(loaded[key], strict=True)
            policy.optimizer.load_state_dict(loaded["optimizer"])
            _restore_adam_steps(policy.optimizer)
        policy.scheduler.load_state_dict(state["scheduler"])
        policy.optimizer_steps = state["optimizer_steps"]
        _set_rng_states(state["rng"])
        return {"step": state["step"], "trainer": state["trainer"]}
