"""DeepSpeed checkpoints (ROOT/latest + ROOT/<tag>/), read without importing deepspeed: the full weights of the
engine's module (a transformers model, so HF names), rebuilt from whatever the ZeRO stage left on disk.

What DeepSpeed (checked against 0.19.8 engines in tests/checkpoint/test_deepspeed.py) writes in a tag directory:
  mp_rank_00_model_states.pt    ZeRO 0-2. `module`: every state_dict tensor in the engine's dtype (bf16 runs: bf16);
                                `param_shapes`: one {name: shape} per optimizer group, in flattening order;
                                `shared_params` {alias: owner} (tied weights); `frozen_param_shapes` /
                                `frozen_param_fragments` (ZeRO 2: full tensors; ZeRO 0/1 keep frozen params only in
                                `module`); `buffer_names`, `dp_world_size`, `global_steps`, `ds_config`, `ds_version`.
  zero_pp_rank_R_mp_rank_00_model_states.pt    ZeRO 3, one per data-parallel rank R: `module` holds empty
                                placeholders, frozen fragments are rank R's padded slice, shared_params only in R=0.
  [bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt    ZeRO 1-3 (bf16_ in bf16 runs): `optimizer_state_dict` with
                                rank R's part of the fp32 master weights:
      ZeRO 1/2  single_partition_of_fp32_groups[g]: rank R's equal slice of group g's flat vector, which holds the
                params of param_shapes[g] in order, each followed by param_alignment_paddings[g][i] entries, and is
                padded at the end to a multiple of the world size.
      ZeRO 3    fp32_flat_groups: rank R's ceil(numel / world) entries of every param in param_shapes order (the
                last rank's slice zero-padded), the groups one after another.
  ZeRO 0 with bf16/fp16 keeps the fp32 masters in the model states' `optimizer.fp32_groups`, in optimizer order.
Optimizer files pickle a few DeepSpeed classes: they are read with weights_only=True into inert stand-ins.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from qlm_core.checkpoint.io.prefault import prefault
from qlm_core.checkpoint.io.safe_load import ForeignObject, safe_torch_load
from qlm_core.checkpoint.io.text import read_text_file
from qlm_core.errors import QlmError
from qlm_core.models.hf_experts import HFFiles, hf_packed_experts
from qlm_core.models.layout import ModelLayout

LATEST = "latest"
MODEL_FILE = "mp_rank_00_model_states.pt"
TIED_OUTPUT = "lm_head.weight"
MASTER, MODULE = "master", "module"  # views: fp32 master weights where the checkpoint has them, or module as saved
_ZERO3_MODEL = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")
_OPTIM = re.compile(r"^(bf16_|fp16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_FOREIGN = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
)


def ds_load(path: Path, mmap: bool = True):
    """torch.load(weights_only=True) with DeepSpeed's pickled classes read into inert stand-ins."""
    return safe_torch_load(path, mmap=mmap, extra_globals=[(ForeignObject, name) for name in _FOREIGN])


def _natural(name: str):
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _is_plain_name(tag: str) -> bool:
    """A directory name inside the checkpoint (no separators, not . or ..), as hf2ds --tag requires."""
    return "/" not in tag and "\\" not in tag and "\0" not in tag and tag not in (".", "..")


def _is_tag_dir(path: Path) -> bool:
    return path.is_dir() and any(p.name.endswith("_model_states.pt") for p in path.iterdir())


def list_tags(root: Path) -> list[str]:
    return sorted((p.name for p in root.iterdir() if _is_tag_dir(p)), key=_natural)


def resolve_tag_dir(root: Path, tag: str | None = None) -> Path:
    """The tag directory: `tag`, else the one `latest` names, else `root` itself when it is a tag directory."""
    if not root.is_dir():
        raise QlmError(f"{root} is not a directory", "point at the directory DeepSpeed's save_checkpoint wrote")
    if tag is not None:
        tag = tag.rstrip("/\\")  # shell completion adds the slash of a directory
        if not _is_plain_name(tag):
            raise QlmError(f"--tag {tag!r} is not a tag directory inside {root}",
                           "pass a plain name like global_step100")
        if not (root / tag).is_dir():
            raise QlmError(f"{root} has no tag {tag!r}", f"choose one of {', '.join(list_tags(root)) or 'none'}")
        return root / tag
    latest = root / LATEST
    if latest.is_file():
        tags = ", ".join(list_tags(root)) or "no tags found"
        named = read_text_file(latest, f"fix the file or pass --tag ({tags})").strip()
        if named and not _is_plain_name(named):
            raise QlmError(f"{latest} names {named!r}, which is not a tag directory inside {root}",
                           f"write a plain tag name into it or pass --tag ({tags})")
        if not named or not (root / named).is_dir():
            raise QlmError(f"{latest} names tag {named!r}, which does not exist",
                           f"fix the file or pass --tag ({', '.join(list_tags(root)) or 'no tags found'})")
        return root / named
    if _is_tag_dir(root):
        return root
    tags = list_tags(root)
    if tags:
        raise QlmError(f"{root} has no `latest` file",
                       f"pass --tag, one of {', '.join(tags)} (or point at the tag directory itself)")
    raise QlmError(f"{root} is not a DeepSpeed checkpoint (no `latest` file, no global_step*/ directories)",
                   "point at the directory DeepSpeed's save_checkpoint wrote")


def _enum_value(value) -> int:
    """ZeroStageEnum comes back as a stand-in holding its value; files qlm writes hold a plain int."""
    return int(value.args[0]) if isinstance(value, ForeignObject) else int(value)


def _read_flat(pieces: list[torch.Tensor], start: int, stop: int) -> torch.Tensor:
    """Entries [start, stop) of the concatenation of the 1-D `pieces` (a view when one piece holds them)."""
    parts, offset = [], 0
    for piece in pieces:
        lo, hi = max(start, offset), min(stop, offset + piece.numel())
        if lo < hi:
            parts.append(piece[lo - offset:hi - offset])
            prefault(parts[-1])
        offset += piece.numel()
        if offset >= stop:
            break
    if sum(p.numel() for p in parts) != stop - start:
        raise QlmError(f"a flat fp32 partition ends before entry {stop}", "the optimizer files are truncated or mixed")
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _zero12_param(pieces, offset, numel, shape) -> torch.Tensor:
    return _read_flat(pieces, offset, offset + numel).view(shape)


def _zero3_param(rank_groups, offset, part, numel, shape) -> torch.Tensor:
    slices = [_read_flat(groups, offset, offset + part) for groups in rank_groups]
    return torch.cat(slices)[:numel].view(shape)


def _rounds_to(master: torch.Tensor, name: str, low: torch.Tensor, claimed: dict) -> bool:
    return name not in claimed and low.shape == master.shape and torch.equal(master.to(low.dtype), low)


@dataclass
class _Entry:
    shape: tuple[int, ...]
    dtype: torch.dtype
    where: str
    read: Callable[[], torch.Tensor]


class DeepSpeedCheckpoint:
    """One tag of a DeepSpeed checkpoint, opened for lazy (mmap) reads of full HF-named tensors. Offers the
    dtype(name) / read_into(name, axis, start, stop, out) reads that layout.HFTensorSource streams from."""

    def __init__(self, root: str | Path, tag: str | None = None, view: str = MASTER,
                 allow_low_precision: bool = False):
        """`allow_low_precision`: a ZeRO 1/2 checkpoint of a bf16/fp16 run whose optimizer files (the fp32
        masters) are missing is read from its module weights (with a warning) instead of refused."""
        self.root = Path(root)
        self.dir = resolve_tag_dir(self.root, tag)
        self.tag = self.dir.name
        self.view = view
        names = {p.name for p in self.dir.iterdir() if p.is_file()}
        self._refuse_model_parallel(names)
        zero3_files = sorted((n for n in names if _ZERO3_MODEL.match(n)), key=_natural)
        model_file = self.dir / (zero3_files[0] if zero3_files else MODEL_FILE)
        if not model_file.exists():
            raise QlmError(f"{self.dir} has no {MODEL_FILE}", "copy the complete checkpoint (or pass another --tag)")
        self.state = ds_load(model_file)
        self._need(self.state, "module", model_file)
        self.global_steps = self.state.get("global_steps")
        self.ds_version = self.state.get("ds_version")
        self.dp_world_size = int(self.state.get("dp_world_size") or 1)
        self.entries: dict[str, _Entry] = {}
        self.aliases: dict[str, str] = dict(self.state.get("shared_params") or {})
        self.buffers = set(self.state.get("buffer_names") or [])
        self.optimizer_files: list[Path] = []
        self._optimizer_states: dict[Path, dict] = {}
        self.notes: list[str] = []
        self.warnings: list[str] = []  # what was lost, printed as warning lines
        module = self.state["module"]
        self.module_dtype = next((t.dtype for t in module.values() if torch.is_tensor(t) and t.is_floating_point()),
                                 torch.float32)
        if view == MODULE:
            if zero3_files:
                raise QlmError(f"{self.dir} is a ZeRO-3 checkpoint, whose module holds no weights",
                               "read its fp32 partitions (the default view)")
            self.zero_stage = None
        elif zero3_files:
            self.zero_stage = 3
            self._open_zero3(zero3_files)
        else:
            optimizers = self._optimizer_files(names)
            self.zero_stage = self._zero12_stage(optimizers) if optimizers else 0
            if optimizers:
                self._open_zero12(optimizers)
            else:
                self._check_masters_present(allow_low_precision)
        self._add_module_tensors(module)
        self._cache: list[tuple[str, torch.Tensor]] = []

    # ---- discovery -------------------------------------------------------------------------------------------------

    def _need(self, state: dict, key: str, file: Path):
        if not isinstance(state, dict) or key not in state:
            raise QlmError(f"{file} has no {key!r} entry", "is it a checkpoint written by DeepSpeed's save_checkpoint?")
        return state[key]

    def _refuse_model_parallel(self, names: set[str]):
        if any(n.startswith("layer_") and n.endswith("model_states.pt") for n in names):
            raise QlmError(f"{self.dir} is a Megatron-DeepSpeed pipeline checkpoint (layer_*-model_states.pt)",
                           "qlm reads DeepSpeed checkpoints of HF (transformers) modules")
        ranks = {m.group(1) for n in names if (m := re.search(r"mp_rank_(\d+)", n))}
        if ranks - {"00"}:
            raise QlmError(f"{self.dir} holds tensor/pipeline-parallel files (mp_rank_{max(ranks)})",
                           "qlm reads DeepSpeed checkpoints with model-parallel size 1")

    def _optimizer_files(self, names: set[str]) -> list[Path]:
        """Rank 0..N-1's optimizer files; the bf16_ prefix that matches the run's config wins if both exist."""
        prefixes = sorted({m.group(1) or "" for n in names if (m := _OPTIM.match(n))})
        if not prefixes:
            return []
        config = self.state.get("ds_config")
        bf16 = isinstance(config, dict) and bool((config.get("bf16") or {}).get("enabled"))
        prefix = "bf16_" if bf16 and "bf16_" in prefixes else prefixes[-1 if bf16 else 0]
        first = self.dir / f"{prefix}zero_pp_rank_0_mp_rank_00_optim_states.pt"
        if not first.exists():
            raise QlmError(f"{self.dir} lacks {first.name}", "copy the complete checkpoint")
        osd = self._optimizer_state(first)
        count = osd.get("partition_count", self.dp_world_size)
        count = max(count) if isinstance(count, (list, tuple)) else int(count)
        files = [self.dir / f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(count)]
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise QlmError(f"{self.dir} lacks {', '.join(missing)} (the run had {count} data-parallel ranks)",
                           "copy the complete checkpoint")
        return files

    def _check_masters_present(self, allow: bool):
        """A ZeRO 1/2 run keeps its fp32 masters only in the optimizer files: without them a bf16/fp16 run's
        module is all there is, and reading it as "fp32" would hide the lost precision."""
        config = self.state.get("ds_config")
        stage = (config.get("zero_optimization") or {}).get("stage") if isinstance(config, dict) else None
        if stage is None:  # DeepSpeed saves param_shapes only under ZeRO
            stage = 2 if self.state.get("param_shapes") else 0
        try:
            stage = _enum_value(stage)
        except (TypeError, ValueError):
            return
        if stage not in (1, 2) or self.module_dtype == torch.float32:
            return
        low = str(self.module_dtype).replace("torch.", "")
        bf16 = isinstance(config, dict) and bool((config.get("bf16") or {}).get("enabled"))
        expected = [f"{'bf16_' if bf16 else ''}zero_pp_rank_{r}_mp_rank_00_optim_states.pt"
                    for r in range(self.dp_world_size)]
        listed = ", ".join(expected[:2]) + (", ..." if len(expected) > 2 else "")
        if not allow:
            raise QlmError(f"{self.dir} is a ZeRO-{stage} {low} checkpoint without its optimizer files ({listed}), "
                           "which hold the fp32 master weights",
                           f"copy them too, or convert the {low} module weights with ds2hf / ds2mcore "
                           "--allow-bf16-weights (fp32 precision is lost)")
        self.zero_stage = stage
        self.warnings.append(f"{self.dir} lacks its optimizer files ({listed}): converted the {low} module "
                             "weights, fp32 precision was lost")

    def _optimizer_state(self, file: Path) -> dict:
        if file not in self._optimizer_states:  # memory-mapped: only the tensors read later are paged in
            self._optimizer_states[file] = self._need(ds_load(file), "optimizer_state_dict", file)
        return self._optimizer_states[file]

    def _zero12_stage(self, files: list[Path]) -> int:
        osd = self._optimizer_state(files[0])
        stage = _enum_value(self._need(osd, "zero_stage", files[0]))
        if stage not in (1, 2):
            raise QlmError(f"{files[0]} says ZeRO stage {stage} but {self.dir} has no zero_pp_rank_*_model_states.pt",
                           "copy the complete checkpoint")
        return stage

    # ---- ZeRO 1/2 --------------------------------------------------------------------------------------------------

    def _open_zero12(self, files: list[Path]):
        self.optimizer_files = files
        states = [self._optimizer_state(f) for f in files]
        partitions = [self._need(s, "single_partition_of_fp32_groups", f) for s, f in zip(states, files, strict=True)]
        paddings = states[0].get("param_alignment_paddings")
        world = len(files)
        for group, shapes in enumerate(self._param_shapes()):
            pieces = [partitions[rank][group] for rank in range(world)]
            offset = 0
            for i, (name, shape) in enumerate(shapes.items()):
                numel = math.prod(shape)
                self.entries[name] = _Entry(tuple(shape), pieces[0].dtype, f"fp32 partitions, group {group}",
                                            partial(_zero12_param, pieces, offset, numel, tuple(shape)))
                offset += numel + (paddings[group][i] if paddings else 0)
            available = sum(p.numel() for p in pieces)
            align = 2 * world  # DeepSpeed pads each group by up to 2 x world entries
            if math.ceil(offset / align) != math.ceil(available / align):
                raise QlmError(f"the fp32 partitions of group {group} hold {available} entries but param_shapes "
                               f"need {offset}", "the model and optimizer files are from different runs")
        self._add_frozen(self.state, full=True)

    # ---- ZeRO 3 ----------------------------------------------------------------------------------------------------

    def _open_zero3(self, model_files: list[str]):
        files = self._optimizer_files({p.name for p in self.dir.iterdir()})
        if not files:
            raise QlmError(f"{self.dir} has no zero_pp_rank_*_optim_states.pt, which hold ZeRO-3's weights",
                           "copy the complete checkpoint")
        world = len(files)
        expected = [f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(world)]
        missing = [n for n in expected if n not in model_files]
        if missing:
            raise QlmError(f"{self.dir} lacks {', '.join(missing)} (the run had {world} data-parallel ranks)",
                           "copy the complete checkpoint")
        self.optimizer_files = files
        rank_groups = [self._need(self._optimizer_state(f), "fp32_flat_groups", f) for f in files]
        offset = 0
        for shapes in self._param_shapes():
            for name, shape in shapes.items():
                numel = math.prod(shape)
                part = math.ceil(numel / world)
                self.entries[name] = _Entry(tuple(shape), rank_groups[0][0].dtype, "fp32 partitions (ZeRO-3)",
                                            partial(_zero3_param, rank_groups, offset, part, numel, tuple(shape)))
                offset += part
        available = sum(t.numel() for t in rank_groups[0])
        if offset != available:
            raise QlmError(f"the ZeRO-3 partitions hold {available} entries per rank but param_shapes need {offset}",
                           "the model and optimizer files are from different runs")
        rank_states = [self.state] + [ds_load(self.dir / name) for name in expected[1:]]
        self._add_frozen(self.state, full=False, rank_states=rank_states)

    # ---- frozen params, module tensors, tied weights ---------------------------------------------------------------

    def _param_shapes(self) -> list[dict]:
        shapes = self.state.get("param_shapes")
        if not shapes:
            raise QlmError(f"{self.dir} has optimizer partitions but no param_shapes", "copy the complete checkpoint")
        return shapes if isinstance(shapes, list) else [shapes]

    def _add_frozen(self, state: dict, full: bool, rank_states: list[dict] | None = None):
        for name, shape in (state.get("frozen_param_shapes") or {}).items():
            shape = tuple(shape)
            if full:
                tensor = state["frozen_param_fragments"][name]
                self.entries[name] = _Entry(shape, tensor.dtype, "frozen", lambda t=tensor, s=shape: t.view(s))
            else:
                frags = [s["frozen_param_fragments"][name] for s in rank_states]
                read = partial(_zero3_param, [[f] for f in frags], 0, frags[0].numel(), math.prod(shape), shape)
                self.entries[name] = _Entry(shape, frags[0].dtype, "frozen (ZeRO-3 fragments)", read)

    def _add_module_tensors(self, module: dict):
        """Everything else the module holds in full: ZeRO 0 weights, ZeRO 1 frozen params, buffers; tensors sharing
        storage with an earlier one are aliases (ZeRO 0 records no shared_params)."""
        seen: dict[tuple, str] = {}
        masters = self._zero0_masters(module) if self.zero_stage == 0 and self.view == MASTER else {}
        for name, tensor in module.items():
            if not torch.is_tensor(tensor) or name in self.aliases:
                continue
            key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
            if tensor.numel() and key in seen and name not in self.entries:
                self.aliases[name] = seen[key]
                continue
            seen.setdefault(key, name)
            if name in self.entries or not tensor.numel():
                continue
            if name in masters:
                self.entries[name] = _Entry(tuple(tensor.shape), masters[name].dtype, "fp32 master (optimizer)",
                                            lambda t=masters[name]: t)
            else:
                where = "buffer" if name in self.buffers else "module"
                self.entries[name] = _Entry(tuple(tensor.shape), tensor.dtype, where, lambda t=tensor: t)

    def _zero0_masters(self, module: dict) -> dict[str, torch.Tensor]:
        """ZeRO 0 with bf16/fp16 keeps fp32 masters by optimizer position only. Each group lists its params in
        module order, so a master belongs to the next unclaimed param of its shape whose value it rounds to (frozen
        params have no master and are skipped). If they do not line up, the module's weights are read instead."""
        optimizer = self.state.get("optimizer")
        groups = optimizer.get("fp32_groups") if isinstance(optimizer, dict) else None
        if not groups or self.module_dtype == torch.float32:
            return {}
        candidates = [(n, t) for n, t in module.items()
                      if torch.is_tensor(t) and t.is_floating_point()
                      and n not in self.buffers and n not in self.aliases]
        found: dict[str, torch.Tensor] = {}
        for group in groups:
            j = 0
            for master in group:
                while j < len(candidates) and not _rounds_to(master, *candidates[j], found):
                    j += 1
                if j == len(candidates):
                    self.notes.append(f"the fp32 masters of this ZeRO-0 run do not line up with its module: read the "
                                      f"module's {str(self.module_dtype).replace('torch.', '')} weights")
                    return {}
                found[candidates[j][0]] = master
        return found

    # ---- reads -----------------------------------------------------------------------------------------------------

    def _entry(self, name: str) -> _Entry:
        seen = set()
        while name in self.aliases and name not in self.entries and name not in seen:
            seen.add(name)
            name = self.aliases[name]
        if name not in self.entries:
            raise QlmError(f"tensor {name} is missing from {self.dir}", "the checkpoint does not match the config")
        return self.entries[name]

    @property
    def names(self) -> list[str]:
        return list(self.entries) + [a for a in self.aliases if a not in self.entries]

    def has(self, name: str) -> bool:
        try:
            self._entry(name)
        except QlmError:
            return False
        return True

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entry(name).shape

    def dtype(self, name: str) -> torch.dtype:
        return self._entry(name).dtype

    def where(self, name: str) -> str:
        return self._entry(name).where if name in self.entries else f"tied to {self.aliases[name]}"

    def read(self, name: str) -> torch.Tensor:
        """The full tensor (possibly a view of the memory-mapped file: copy it before keeping it). The last two
        are cached, since a Megatron shard reads one HF tensor in several ranges."""
        for cached, tensor in self._cache:
            if cached == name:
                return tensor
        tensor = self._entry(name).read()
        prefault(tensor)
        self._cache = [(name, tensor)] + self._cache[:1]
        return tensor

    def read_into(self, name: str, axis: int, start: int, stop: int, out: torch.Tensor):
        out.copy_(self.read(name).narrow(axis, start, stop - start))

    def check_layout(self, layout: ModelLayout):
        """Every tensor the config implies must be here with its shape, and no parameter may be left over."""
        # transformers' state_dict (MoE experts fused where its model fuses them), or per-expert as an older qlm wrote
        fused = any(self.has(name) for name in hf_packed_experts(layout.spec).shapes)
        expected = HFFiles(layout, state_dict=fused).shapes
        for name, shape in expected.items():
            if not self.has(name):
                raise QlmError(f"tensor {name} is missing from {self.dir}",
                               "pass --config of the model this run trained (a run saved with "
                               "exclude_frozen_parameters=True lacks its frozen weights)")
            if self.shape(name) != tuple(shape):
                raise QlmError(f"tensor {name} has shape {list(self.shape(name))} but the config implies {list(shape)}",
                               "pass --config of the model this run trained")
        ignorable = self.buffers | ({TIED_OUTPUT} if layout.spec.tie_word_embeddings else set())
        extra = sorted(set(self.names) - set(expected) - ignorable)
        if extra:
            raise QlmError(f"{self.dir} holds tensors the config does not describe ({', '.join(extra[:3])}"
                           f"{', ...' if len(extra) > 3 else ''})", "pass --config of the model this run trained")
