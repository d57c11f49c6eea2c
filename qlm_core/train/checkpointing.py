"""Save and resume training in Megatron's legacy layout:

    RUN/checkpoints/latest_checkpointed_iteration.txt
    RUN/checkpoints/iter_%07d/mp_rank_TT[_PPP]/model_optim_rng.pt

Each file holds Megatron's entries (args, checkpoint_version, iteration, model / model0..) and qlm's: the optimizer
state per parameter, named and sharded like the weights (so a resume on another TP/PP/DP reshards it like the
weights), the LR-scheduler position, the data position and every data/context rank's RNG state.

A checkpoint is written into a hidden directory that is renamed into place when complete; the `latest` pointer is
replaced last, atomically. A run killed at any moment therefore leaves only loadable checkpoints.
"""

from __future__ import annotations

import os
import random
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from ..checkpoint.layout import read_shard_tensor
from ..checkpoint.mcore import (
    LATEST_FILE,
    OPTIMIZER_KEY,
    SHARD_FILE,
    MegatronTorchCheckpoint,
    iteration_dir_name,
    shard_dir_name,
    write_shard_file,
)
from ..checkpoint.megatron_args import make_args
from ..parallel.comm import group_size
from .engine import Engine
from .lora import lora_state_dict

TRAIN_STATE_KEY = "qlm_train_state"
RNG_KEY = "rng_state"
STATE_VIEWS = ("master", "exp_avg", "exp_avg_sq")


@dataclass
class TrainState:
    iteration: int = 0  # optimizer steps completed
    consumed_samples: int = 0
    skipped_in_row: int = 0
    skipped_total: int = 0


def _barrier():
    if dist.is_initialized():
        dist.barrier()


def _rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict):
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _gather_objects(value, group) -> list:
    if group_size(group) == 1:
        return [value]
    out = [None] * group_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


def _named_trainable(engine: Engine) -> list[tuple[int, str]]:
    """(chunk, state_dict name) of each entry of engine.params, in the same order."""
    names = {}
    for index, chunk in enumerate(engine.chunks):
        for name, param in chunk.named_parameters():
            names[id(param)] = (index, name)
    return [names[id(p)] for p in engine.params]


def _model_states(engine: Engine) -> list[dict]:
    """Each chunk's weights in the compute dtype, cloned (ZeRO 1/2 params are views of a shared buffer, ZeRO 3
    params are shards: both need a copy of their own). LoRA runs store only the adapters."""
    states = []
    for chunk in engine.chunks:
        state = {}
        full = lora_state_dict(chunk) if engine.lora is not None and engine.lora.rank > 0 else chunk.state_dict()
        for name, value in full.items():
            if isinstance(value, torch.Tensor):
                value = value.full_tensor() if hasattr(value, "full_tensor") else value
                value = value.detach().to(engine.dtype).cpu().clone()
            state[name] = value
        states.append(state)
    return states


def save_checkpoint(root: Path, engine: Engine, train_state: TrainState, keep_last: int, extra_args: dict):
    g = engine.grid
    root = Path(root)
    name = iteration_dir_name(train_state.iteration)
    staging = root / f".{name}.partial"
    if g.rank == 0:
        for stale in root.glob(".iter_*.partial"):
            shutil.rmtree(stale, ignore_errors=True)
        staging.mkdir(parents=True, exist_ok=True)
    _barrier()
    param_states, step = engine.optimizer.full_param_states()  # collectives: every rank takes part
    models = _model_states(engine)
    rng = _gather_objects(_rng_state(), g.dp_cp_group)
    if g.dp_rank == 0 and g.cp_rank == 0:
        optimizer = {"step": step, **{view: [{} for _ in engine.chunks] for view in STATE_VIEWS}}
        for (chunk, param_name), state in zip(_named_trainable(engine), param_states):
            for view in STATE_VIEWS:
                optimizer[view][chunk][param_name] = state[view].detach().cpu().clone()
        args = make_args(engine.layout, engine.dtype, iteration=train_state.iteration,
                         consumed_train_samples=train_state.consumed_samples, **extra_args)
        extra = {OPTIMIZER_KEY: optimizer, TRAIN_STATE_KEY: asdict(train_state), RNG_KEY: rng,
                 "opt_param_scheduler": {"num_steps": train_state.iteration}}
        file = staging / name / shard_dir_name(g.tp_rank, g.pp_rank, engine.layout.pp) / SHARD_FILE
        write_shard_file(file, models, args, train_state.iteration, extra)
    _barrier()
    if g.rank == 0:
        final = root / name
        if final.exists():
            shutil.rmtree(final)
        os.replace(staging / name, final)
        staging.rmdir()
        pointer = root / f".{LATEST_FILE}.tmp"
        pointer.write_text(str(train_state.iteration))
        os.replace(pointer, root / LATEST_FILE)
        _prune(root, keep_last, keep=final)
    _barrier()


def _prune(root: Path, keep_last: int, keep: Path):
    if keep_last <= 0:
        return
    iterations = sorted(p for p in root.glob("iter_*") if p.is_dir())
    for old in iterations[:-keep_last]:
        if old != keep:
            shutil.rmtree(old, ignore_errors=True)


def has_checkpoint(root: Path) -> bool:
    return (Path(root) / LATEST_FILE).exists()


def load_checkpoint(root: Path, engine: Engine) -> TrainState:
    """Restore weights (through the optimizer's fp32 masters), optimizer state, RNG and data position from the
    latest checkpoint, whatever TP/PP/DP it was written with."""
    g = engine.grid
    source = MegatronTorchCheckpoint(root, spec=engine.spec)
    engine_layout = engine.layout
    names = _named_trainable(engine)
    tensors = [dict(shard_tensor_layouts(engine, g.pp_rank, c)) for c in range(len(engine.chunks))]
    states = [{} for _ in names]
    step = 0
    for view in STATE_VIEWS:
        view_source = MegatronTorchCheckpoint(root, spec=engine.spec, view=view)
        for index, (chunk, param_name) in enumerate(names):
            tensor = tensors[chunk][param_name]
            states[index][view] = read_shard_tensor(tensor, engine_layout.tp, g.tp_rank, view_source,
                                                    torch.float32).to(g.device)
        step = view_source.extra_state(OPTIMIZER_KEY)["step"]
    engine.optimizer.load_full_param_states(states, step)
    train_state = TrainState(**source.extra_state(TRAIN_STATE_KEY))
    saved_rng = source.extra_state(RNG_KEY, g.tp_rank, g.pp_rank) if (source.tp, source.pp) == (
        engine_layout.tp, engine_layout.pp) else None
    if saved_rng is not None and len(saved_rng) == group_size(g.dp_cp_group):
        _set_rng_state(saved_rng[g.dp_rank * engine.config.cp + g.cp_rank])
    return train_state


def shard_tensor_layouts(engine: Engine, pp_rank: int, chunk: int):
    """(state_dict name, TensorLayout) of every tensor a chunk holds (weights; LoRA adapters when present)."""
    layout, lora = engine.layout, engine.lora
    entries = list(layout.shard_entries(pp_rank, chunk))
    if lora is not None and lora.rank > 0:
        entries += layout.lora_shard_entries(pp_rank, chunk, lora.rank, lora.target_modules)
    return [(name, tensor) for name, tensor in entries if tensor is not None]
