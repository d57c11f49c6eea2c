"""Save and resume training in Megatron's layouts, legacy `torch` (the default) or `torch_dist`:

    RUN/checkpoints/latest_checkpointed_iteration.txt
    RUN/checkpoints/iter_%07d/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt  torch
    RUN/checkpoints/iter_%07d/{common.pt, metadata.json, .metadata, __R_0.distcp}   torch_dist

Beside Megatron's entries each checkpoint holds qlm's (checkpoint/formats/megatron/trainer_state.py): the optimizer
state per parameter, named and sharded like the weights (so a resume on another TP/PP/DP reshards it like the
weights), the LR-scheduler position, the data position and every data/context rank's RNG state. Under expert
parallelism the legacy folders are those Megatron writes (megatron.legacy.legacy_shard_ranks: expert-data-parallel
rank 0 of each EP x ETP position, plus any dense TP shard those miss), each with its dense TP shard and its EP rank's
experts; the experts' optimizer views travel in the same file. In torch_dist every rank writes the chunks it owns:
dense chunks from data/context rank 0 of each TP/PP position, routed experts' chunks from expert-data-parallel rank 0
of each EP/ETP/PP position (each chunk exactly once).

A checkpoint is written into a hidden directory that is renamed into place when complete; the `latest` pointer is
replaced last, atomically. A run killed at any moment therefore leaves only loadable checkpoints.
"""

from __future__ import annotations

import os
import random
import shutil
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from qlm_core.checkpoint.formats.megatron.args import make_args
from qlm_core.checkpoint.formats.megatron.format import TORCH, TORCH_DIST, open_megatron
from qlm_core.checkpoint.formats.megatron.legacy import (
    LATEST_FILE,
    SHARD_FILE,
    iteration_dir_name,
    legacy_writer,
    shard_dir_name,
    write_shard_file,
)
from qlm_core.checkpoint.formats.megatron.trainer_state import (
    OPTIMIZER_KEY,
    OPTIMIZER_VIEWS,
    RNG_KEY,
    SCHEDULER_KEY,
    TRAIN_STATE_KEY,
    rng_position_key,
    saved_rng_states,
    view_prefix,
)
from qlm_core.checkpoint.io.host_buffers import HostBuffers
from qlm_core.checkpoint.io.write_faults import as_write_os_error
from qlm_core.errors import QlmError
from qlm_core.models.layout import ModelLayout, TensorLayout, read_shard_tensor
from qlm_core.parallel.comm import group_size
from qlm_core.parallel.sharded_tensors import whole
from qlm_core.parallel.state import Grid
from qlm_core.train.engine import Engine
from qlm_core.train.lora import lora_state_dict

if TYPE_CHECKING:
    from torch.distributed.checkpoint.api import CheckpointException

    from qlm_core.checkpoint.formats.megatron.torch_dist_write import DistPart


class _NeverRaised(Exception):
    """Stands for torch_dist's CheckpointException while torch.distributed.checkpoint is not imported (only a
    torch_dist save or load imports it, and nothing else can raise it)."""


def _dcp_failure() -> type[BaseException]:
    api = sys.modules.get("torch.distributed.checkpoint.api")
    return api.CheckpointException if api is not None else _NeverRaised


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
    """This process's RNG states, numpy's array as a tensor: plain torch.load(weights_only=True) reads it back (as
    megatron-core loads a torch_dist common.pt)."""
    kind, keys, position, has_gauss, cached_gaussian = np.random.get_state()
    state = {"python": random.getstate(), "torch": torch.get_rng_state(),
             "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), position, has_gauss, cached_gaussian)}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict):
    random.setstate(state["python"])
    kind, keys, *rest = state["numpy"]
    keys = keys.numpy() if isinstance(keys, torch.Tensor) else keys
    np.random.set_state((kind, keys.astype(np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _gather_objects(value, group: ProcessGroup | None) -> list:
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


def _host_copy(host: HostBuffers | None, key, tensor: torch.Tensor) -> torch.Tensor:
    """A copy of `tensor` on the host with a storage of its own: a clone, or (asynchronous saves) the reused
    buffer of `key`."""
    return tensor.detach().cpu().clone() if host is None else host.copy(key, tensor)


def model_states(engine: Engine, host: HostBuffers | None = None) -> list[dict]:
    """Each chunk's weights in the compute dtype, copied (ZeRO 1/2 params are views of a shared buffer, ZeRO 3
    params are shards: both need a copy of their own). LoRA runs store only the adapters."""
    states = []
    for index, chunk in enumerate(engine.chunks):
        state = {}
        full = lora_state_dict(chunk) if engine.lora is not None and engine.lora.rank > 0 else chunk.state_dict()
        buffers = {name for name, _ in chunk.named_buffers()}  # keep their dtype (the routers' fp32 expert bias)
        for name, value in full.items():
            if isinstance(value, torch.Tensor):
                dtype = value.dtype if name in buffers else engine.dtype
                value = _host_copy(host, ("model", index, name), whole(value).detach().to(dtype))
            state[name] = value
        states.append(state)
    return states


def first_error(error: str | None) -> str | None:
    """Every rank's error text (None: fine) gathered: the first one, the same on every rank (so all stop together
    instead of waiting for a rank that failed)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return error
    return _gathered_first(error, None)  # torch's None: the default group


def first_error_in(error: str | None, group: ProcessGroup | None) -> str | None:
    """first_error over `group`, a group of every rank (qlm's None: this process alone)."""
    return error if group_size(group) == 1 else _gathered_first(error, group)


def _gathered_first(error: str | None, group: ProcessGroup | None) -> str | None:
    errors = [None] * dist.get_world_size(group)
    dist.all_gather_object(errors, error, group=group)
    return next((e for e in errors if e is not None), None)


def _write_failure(path: Path, exc: BaseException) -> str:
    if isinstance(exc, _dcp_failure()):  # torch_dist: the ranks' exceptions, gathered by dcp
        exc = next((e for e in _flatten_failures(exc) if isinstance(e, OSError)), exc)
    if isinstance(exc, OSError):
        where = exc.filename or path
        return f"{where}: {exc.strerror or exc}"
    return f"{path}: {exc}"


def _flatten_failures(exc: CheckpointException) -> list[BaseException]:
    found = []
    for failure in exc.failures.values():
        found.append(failure[0] if isinstance(failure, tuple) else failure)
    return found


def _is_write_error(exc: BaseException) -> bool:
    """An OSError (disk full, permission, I/O), directly or inside torch_dist's gathered CheckpointException; any
    other exception is a bug and propagates."""
    if isinstance(exc, OSError):
        return True
    return isinstance(exc, _dcp_failure()) and any(isinstance(e, OSError) for e in _flatten_failures(exc))


def latest_iteration(root: Path) -> int | None:
    """The iteration RUN/checkpoints/latest_checkpointed_iteration.txt names, None without one (or unreadable)."""
    try:
        text = (Path(root) / LATEST_FILE).read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return int(text) if text.isdigit() else None


def _stop_on_failure(error: str | None, root: Path, staging: Path, iteration: int, rank: int):
    raise_write_failure(first_error(error), root, staging, iteration, rank)


def raise_write_failure(error: str | None, root: Path, staging: Path, iteration: int, rank: int):
    """The QlmError for checkpoint `iteration` when the ranks agreed on an `error`; its staging removed."""
    if error is None:
        return
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
    kept = latest_iteration(root)
    intact = (f"the last complete checkpoint (iteration {kept}) is intact" if kept is not None
              else "no earlier checkpoint was complete")
    raise QlmError(f"checkpoint iteration {iteration} could not be written ({error}); nothing of it was kept",
                   f"free space on that disk or fix its permissions, then rerun the same command to resume: {intact}")


REPLACED_SUFFIX = ".replaced"  # RUN/checkpoints/.iter_N.replaced: iter_N set aside while a new iter_N moves in


def recover_replaced(root: Path):
    """Finish a swap that a kill interrupted: an iter_N set aside is dropped when the new iter_N is in place, and
    put back when it is not (before the checkpoints are read or written)."""
    for replaced in Path(root).glob(f".iter_*{REPLACED_SUFFIX}"):
        final = replaced.with_name(replaced.name[1:-len(REPLACED_SUFFIX)])
        if final.exists():
            shutil.rmtree(replaced, ignore_errors=True)
            continue
        try:
            os.replace(replaced, final)
        except FileNotFoundError:
            pass  # another rank put it back first


def save_checkpoint(root: Path, engine: Engine, train_state: TrainState, keep_last: int, extra_args: dict,
                    fmt: str = TORCH):
    """Write into RUN/checkpoints/.iter_N.partial/iter_N, rename it into place, then replace the latest pointer. A
    write error (disk full, permission) on any rank removes the partial directory on every rank's agreement and
    raises one QlmError; the latest pointer still names the last complete checkpoint."""
    write = snapshot_checkpoint(root, engine, train_state, extra_args, fmt)
    _stop_on_failure(write.write_files(), write.root, write.staging, write.iteration, write.rank)
    error = write.publish(keep_last) if write.rank == 0 else None
    _stop_on_failure(error, write.root, write.staging, write.iteration, write.rank)


@dataclass
class CheckpointWrite:
    """One checkpoint, snapshotted: what is left to do is writing its files into the staging directory
    (write_files, on every rank) and moving it into place (publish, on rank 0), on any thread."""

    root: Path
    iteration: int
    rank: int
    fmt: str
    target: Path  # the file this rank writes (legacy) or the iteration directory (torch_dist), for error lines
    legacy: tuple | None = None  # (models, args, extra) of this rank's model_optim_rng.pt, None: writes none
    dist_parts: tuple | None = None  # (layout, parts, args, common) for save_torch_dist_collectively

    @property
    def name(self) -> str:
        return iteration_dir_name(self.iteration)

    @property
    def staging(self) -> Path:
        return self.root / f".{self.name}.partial"

    def write_files(self, process_group: ProcessGroup | None = None) -> str | None:
        """This rank's files: None, or the write error's text (disk full, permission, I/O); any other exception is
        a bug and propagates. `process_group`: the one torch_dist's DCP coordinates over (None: the default)."""
        try:
            if self.dist_parts is not None:
                from qlm_core.checkpoint.formats.megatron.torch_dist_write import save_torch_dist_collectively

                layout, parts, args, common = self.dist_parts
                save_torch_dist_collectively(self.staging / self.name, layout, parts, args, self.iteration, common,
                                             process_group=process_group)
            elif self.legacy is not None:
                models, args, extra = self.legacy
                write_shard_file(self.target, models, args, self.iteration, extra)
        except (OSError, _dcp_failure(), RuntimeError) as exc:  # RuntimeError: torch.save on a full disk
            exc = as_write_os_error(exc, self.target) or exc
            if not _is_write_error(exc):
                raise
            return _write_failure(self.target, exc)
        return None

    def publish(self, keep_last: int) -> str | None:
        """Rank 0, once every rank's files are written: the directory renamed into place, then the latest pointer
        replaced, then old checkpoints pruned. None, or the write error's text."""
        root, name = self.root, self.name
        final, pointer = root / name, root / f".{LATEST_FILE}.tmp"
        try:
            pointer.write_text(str(self.iteration))  # first: a failure here has moved nothing yet
            replaced = None
            if final.exists():  # a checkpoint of this iteration from an earlier trajectory: set aside, then dropped
                replaced = root / f".{name}{REPLACED_SUFFIX}"
                os.replace(final, replaced)
            try:
                os.replace(self.staging / name, final)
            except OSError:
                if replaced is not None:
                    os.replace(replaced, final)
                raise
            self.staging.rmdir()
            os.replace(pointer, root / LATEST_FILE)
            if replaced is not None:
                shutil.rmtree(replaced, ignore_errors=True)
            _prune(root, keep_last, keep=final)
        except OSError as exc:
            pointer.unlink(missing_ok=True)
            return _write_failure(pointer, exc)
        return None


def snapshot_checkpoint(root: Path, engine: Engine, train_state: TrainState, extra_args: dict, fmt: str = TORCH,
                        host: HostBuffers | None = None) -> CheckpointWrite:
    """The staging directory made (rank 0; stale ones of killed runs removed) and this rank's part of checkpoint
    `train_state.iteration` copied to the host: every collective of a save but the writing's own happens here, on
    the calling (training) thread, so what remains touches no training state. `host`: reused host buffers (an
    asynchronous save), else fresh copies."""
    g = engine.grid
    root = Path(root)
    write = CheckpointWrite(root, train_state.iteration, g.rank, fmt, target=root)
    write.target = write.staging / write.name
    error = None
    if g.rank == 0:
        try:
            recover_replaced(root)
            for stale in root.glob(".iter_*.partial"):
                shutil.rmtree(stale, ignore_errors=True)
            write.target.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            error = _write_failure(write.staging, exc)
    _stop_on_failure(error, root, write.staging, write.iteration, g.rank)
    into = None
    if host is not None:
        pinned = engine.optimizer.params[0].device.type != "cpu" if engine.optimizer.params else False

        def into(index: int, shape: tuple[int, ...]) -> list[torch.Tensor]:
            # the keys the snapshot copies under below: it then finds them held, and copies nothing
            return [host.buffer((view, index), shape, torch.float32, pinned) for view in OPTIMIZER_VIEWS]
    param_states, step = engine.optimizer.full_param_states(into)  # collectives: every rank takes part
    models = model_states(engine, host)
    args = make_args(engine.layout, engine.dtype, iteration=train_state.iteration,
                     consumed_train_samples=train_state.consumed_samples, **extra_args)
    scheduler = {"num_steps": train_state.iteration}
    if fmt == TORCH_DIST:
        args.ckpt_format = TORCH_DIST
        common = {OPTIMIZER_KEY: {"step": step}, TRAIN_STATE_KEY: asdict(train_state),
                  RNG_KEY: _rng_by_position(g), SCHEDULER_KEY: scheduler}
        write.dist_parts = (engine.layout, _owned_parts(engine, models, param_states, host), args, common)
    else:
        rng = _gather_objects(_rng_state(), g.dp_cp_group)
        rank_dir = legacy_shard_dir(g, engine.layout.pp)
        if rank_dir is not None:
            optimizer = {"step": step, **{view: [{} for _ in engine.chunks] for view in OPTIMIZER_VIEWS}}
            for index, ((chunk, param_name), state) in enumerate(zip(_named_trainable(engine), param_states,
                                                                     strict=True)):
                for view in OPTIMIZER_VIEWS:
                    optimizer[view][chunk][param_name] = _host_copy(host, (view, index), state[view])
            extra = {OPTIMIZER_KEY: optimizer, TRAIN_STATE_KEY: asdict(train_state), RNG_KEY: rng,
                     SCHEDULER_KEY: scheduler}
            write.target = write.staging / write.name / rank_dir / SHARD_FILE
            write.legacy = (models, args, extra)
    if host is not None:
        host.finish()
    return write


def legacy_shard_dir(g: Grid, pp: int) -> str | None:
    """The legacy rank folder this rank writes (megatron_legacy.legacy_writer), None when it writes none."""
    s = g.sizes
    stage_index = (g.dp_rank * s.cp + g.cp_rank) * s.tp + g.tp_rank
    position = legacy_writer(stage_index, s.tp, s.ep, s.etp)
    if position is None:
        return None
    tp_rank, ep_rank = position
    return shard_dir_name(tp_rank, g.pp_rank, pp, ep_rank, s.ep)


def _rng_by_position(g) -> dict[str, list]:
    """Every rank's RNG state, as "TP_PP" -> [state of each data x context rank] (the torch layout's per-file list)."""
    states = [_rng_state()]
    if dist.is_initialized() and dist.get_world_size() > 1:
        states = [None] * dist.get_world_size()
        dist.all_gather_object(states, _rng_state())
    by_position: dict[str, list] = {}
    for rank, state in enumerate(states):
        c = g.sizes.coords(rank)
        slots = by_position.setdefault(rng_position_key(c["tp"], c["pp"]), [None] * (g.sizes.dp * g.sizes.cp))
        slots[c["dp"] * g.sizes.cp + c["cp"]] = state
    return by_position


class _LocalShards:
    """This rank's tensors as a TensorSource of the global tensors, for the ranges this rank holds: its TP part of
    a dense tensor, its expert-TP part of a routed expert's."""

    def __init__(self, tensors: dict[str, torch.Tensor], layout: ModelLayout, tp_rank: int, etp_rank: int):
        self.tensors, self.layout, self.tp_rank, self.etp_rank = tensors, layout, tp_rank, etp_rank

    def read_into(self, tensor: TensorLayout, start: int, stop: int, out: torch.Tensor):
        offset, rank = 0, self.etp_rank if tensor.expert else self.tp_rank
        for begin, end in tensor.tp_ranges(self.layout.split_size(tensor), rank):
            if begin <= start and stop <= end:
                out.copy_(self.tensors[tensor.name].narrow(tensor.axis, offset + start - begin, stop - start))
                return
            offset += end - begin
        raise KeyError(f"{tensor.name}[{start}:{stop}] is not held by TP rank {self.tp_rank} / ETP rank "
                       f"{self.etp_rank}")


def _owned_parts(engine: Engine, models: list[dict], param_states: list[dict],
                 host: HostBuffers | None = None) -> list[DistPart]:
    """The weights and optimizer views this rank writes: of the tensors its stage (and EP rank) holds, the dense
    chunks of its TP rank when it is data/context rank 0, the routed experts' chunks of its expert-TP rank when it
    is expert-data-parallel rank 0; every chunk is written by exactly one rank."""
    from qlm_core.checkpoint.formats.megatron.torch_dist_write import DistPart

    g, layout = engine.grid, engine.layout
    dense_writer, expert_writer = g.dp_rank == 0 and g.cp_rank == 0, g.expert_coords["edp"] == 0
    if not (dense_writer or expert_writer):
        return []
    global_name = {}  # (chunk, state_dict name) -> global tensor name
    for chunk in range(len(engine.chunks)):
        for state_name, tensor in layout.stored_tensors(g.pp_rank, chunk, engine.lora, g.ep_rank):
            global_name[chunk, state_name] = tensor.name
    weights = {global_name[c, n]: t for c, model in enumerate(models) for n, t in model.items()
               if (c, n) in global_name}
    views = {view: {} for view in OPTIMIZER_VIEWS}
    for index, ((chunk, param_name), state) in enumerate(zip(_named_trainable(engine), param_states, strict=True)):
        for view in OPTIMIZER_VIEWS:
            value = state[view].detach().float()
            # a synchronous save writes before the next step: the optimizer's own host tensors need no copy
            views[view][global_name[chunk, param_name]] = value.cpu() if host is None else host.copy((view, index),
                                                                                                      value)

    def mine(held: dict):
        """Which chunks this rank writes of the tensors `held` (buffers have weights but no optimizer views)."""
        def owns(chunk) -> bool:
            if chunk.tensor.name not in held:
                return False
            if chunk.tensor.expert:
                return expert_writer and chunk.tp_rank == g.etp_rank
            return dense_writer and chunk.tp_rank == g.tp_rank
        return owns

    def local(tensors):
        return _LocalShards(tensors, layout, g.tp_rank, g.etp_rank)

    parts = [DistPart("", local(weights), engine.dtype, mine(weights))]
    parts += [DistPart(view_prefix(view), local(views[view]), torch.float32, mine(views[view]))
              for view in OPTIMIZER_VIEWS]
    return parts


def _prune(root: Path, keep_last: int, keep: Path):
    if keep_last <= 0:
        return
    iterations = sorted(p for p in root.glob("iter_*") if p.is_dir())
    for old in iterations[:-keep_last]:
        if old != keep:
            shutil.rmtree(old, ignore_errors=True)


def has_checkpoint(root: Path) -> bool:
    return (Path(root) / LATEST_FILE).exists()


def saved_iterations(root: Path) -> list[int]:
    """The iterations of the complete checkpoints under RUN/checkpoints (iter_N directories)."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(int(p.name[5:]) for p in root.glob("iter_*") if p.is_dir() and p.name[5:].isdigit())


def resume_iteration(root: Path, load_iteration: int | None = None) -> int | None:
    """The iteration a resumed run starts from: `load_iteration` (checkpoint.load_iteration) when set, else the one
    the latest file names; None when RUN/checkpoints holds no checkpoint. A missing iteration, a latest file that
    names one that is not there, or checkpoints without a latest file are errors naming what is there."""
    root = Path(root)
    if root.is_dir():
        recover_replaced(root)
    iterations = saved_iterations(root)
    have = ", ".join(map(str, iterations)) or "none"
    latest = root / LATEST_FILE
    if load_iteration is not None:
        if load_iteration not in iterations:
            raise QlmError(f"checkpoint.load_iteration = {load_iteration} is not among the checkpoints in {root} "
                           f"(iterations: {have})", "set checkpoint.load_iteration to one of them, or remove it to "
                           "resume from the latest")
        return load_iteration
    if not latest.exists():
        if iterations:
            raise QlmError(f"{root} holds checkpoints (iterations: {have}) but no {LATEST_FILE}",
                           "set checkpoint.load_iteration to the one to resume from, or start over with --force")
        return None
    try:
        text = latest.read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise QlmError(f"{latest} cannot be read ({exc})", "write the iteration to resume from into it, or set "
                       "checkpoint.load_iteration") from None
    if not text.isdigit():
        raise QlmError(f"{latest} holds {text[:40]!r}, not an iteration number",
                       f"write one of the saved iterations ({have}) into it, or set checkpoint.load_iteration")
    if int(text) not in iterations:
        raise QlmError(f"{latest} names iteration {int(text)}, which is not in {root} (iterations: {have})",
                       "set checkpoint.load_iteration to one of them, or write one into the file")
    return int(text)


def saved_layout(source) -> str:
    """`tp.. pp.. dp..` of the run that wrote a checkpoint (dp from its per-rank RNG states, cp from its recipe)."""
    import tomllib

    cp = 1
    recipe = getattr(source.args, "qlm_recipe", None)
    if isinstance(recipe, str):
        try:
            cp = int(tomllib.loads(recipe).get("parallel", {}).get("cp", 1)) or 1
        except (tomllib.TOMLDecodeError, TypeError, ValueError):
            cp = 1
    rng = saved_rng_states(source, 0, 0)
    dp = f"dp{max(1, len(rng) // cp)}" if isinstance(rng, list) and rng else "dp?"
    ep = getattr(source.args, "expert_model_parallel_size", 1) or 1
    etp = getattr(source.args, "expert_tensor_parallel_size", None) or source.tp
    experts = (f" ep{ep}" if ep > 1 else "") + (f" etp{etp}" if etp != source.tp else "")
    return f"tp{source.tp} pp{source.pp} {dp}{experts}"


def describe_resume(root: Path, iteration: int) -> str:
    """"resuming from iteration N (layout tp.. pp.. dp..)" for the run header and the dry run."""
    return f"resuming from iteration {iteration} (layout {saved_layout(open_megatron(root, iteration))})"


def _load_buffers(engine: Engine, source, tensors: list[dict]) -> None:
    """The module buffers a checkpoint holds (the routers' expert biases): read with the weights; no optimizer
    state restores them."""
    for chunk, held in zip(engine.chunks, tensors, strict=True):
        buffers = dict(chunk.named_buffers())
        for name, tensor in held.items():
            if tensor.buffer:
                buffers[name].copy_(read_shard_tensor(tensor, engine.layout.split_size(tensor), engine.grid.tp_rank,
                                                      source))


def load_checkpoint(root: Path, engine: Engine, iteration: int | None = None) -> tuple[TrainState, str]:
    """Restore weights (through the optimizer's fp32 masters), optimizer state, RNG and data position from
    checkpoint `iteration` (None: the latest), whatever TP/PP/DP it was written with. Returns the train state and
    "resuming from iteration N (layout ...)"."""
    g = engine.grid
    source = open_megatron(root, iteration, spec=engine.spec)
    engine_layout = engine.layout
    names = _named_trainable(engine)
    tensors = [dict(engine_layout.stored_tensors(g.pp_rank, c, engine.lora, g.ep_rank))
               for c in range(len(engine.chunks))]
    states = [{} for _ in names]
    step = 0
    for view in OPTIMIZER_VIEWS:
        view_source = open_megatron(root, iteration, spec=engine.spec, view=view)
        for index, (chunk, param_name) in enumerate(names):
            tensor = tensors[chunk][param_name]
            rank = g.etp_rank if tensor.expert else g.tp_rank
            states[index][view] = read_shard_tensor(tensor, engine_layout.split_size(tensor), rank, view_source,
                                                    torch.float32).to(g.device)
        step = view_source.extra_state(OPTIMIZER_KEY)["step"]
    engine.optimizer.load_full_param_states(states, step)
    _load_buffers(engine, source, tensors)
    train_state = TrainState(**source.extra_state(TRAIN_STATE_KEY))
    same_grid = (source.tp, source.pp) == (engine_layout.tp, engine_layout.pp)
    saved_rng = saved_rng_states(source, g.tp_rank, g.pp_rank) if same_grid else None
    if saved_rng is not None and len(saved_rng) == group_size(g.dp_cp_group):
        _set_rng_state(saved_rng[g.dp_rank * engine.config.cp + g.cp_rank])
    return train_state, f"resuming from iteration {train_state.iteration} (layout {saved_layout(source)})"
