"""Megatron-Core `torch_dist` checkpoints, read side: latest_checkpointed_iteration.txt, iter_%07d/ or release/ holding
`metadata.json`, torch.distributed.checkpoint (DCP) files (`.metadata` + `__R_K.distcp`) and the common state.

The DCP holds GLOBAL tensors under Transformer-Engine names, per-layer tensors stacked on a new axis 0 of length
num_layers (`decoder.layers.self_attention.linear_qkv.weight` is [L, qkv_rows, H]; fc1 is [L, 2F, H] = full gate
then full up), each stored as chunks (Megatron writes one per layer and TP shard). Linear layers add byte objects
`decoder.layers.<linear>._extra_state/shard_<layer>_<L>`. The common state (args, iteration, ...) is `common.pt` up
to megatron-core 0.18; from 0.19 on it is the DCP byte object `common_state/shard_0_1`. Both are read.

qlm's trainer stores its per-parameter optimizer state beside the weights (trainer_state.py): `view=` reads one of
its views as if it were the weights. Megatron-LM loads such a checkpoint's weights and ignores the extra keys (its
default strictness, assume_ok_unexpected).

Reads stream: a range of one global tensor loads only the stored chunks that overlap it, and at most the chunks of
one per-layer tensor are kept between reads (consecutive reads of q, k and v hit them). `.metadata` is a pickle: it
is read with an unpickler that admits only DCP's metadata classes; chunks are read with torch.load(weights_only).
"""

from __future__ import annotations

import importlib
import io
import pickle
import re
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
)

from qlm_core.checkpoint.formats.megatron.legacy import HF_SIDE_DIR, check_no_leftovers, megatron_spec
from qlm_core.checkpoint.formats.megatron.torch_dist_files import DCP_METADATA_FILE, DIST_CONFIG_FILE, resolve_dist_dir
from qlm_core.checkpoint.formats.megatron.trainer_state import OPTIMIZER_VIEWS, view_prefix
from qlm_core.checkpoint.io.safe_load import ForeignObject, allowed_globals, safe_torch_load
from qlm_core.checkpoint.io.text import read_json_object
from qlm_core.errors import QlmError
from qlm_core.models.layout import LINEARS, MLA_TE_NORM_NAMES, TE_NORM_NAMES, ModelLayout, TensorLayout
from qlm_core.models.spec import ModelSpec

COMMON_FILE = "common.pt"
COMMON_STATE_KEY = "common_state/shard_0_1"  # megatron-core >= 0.19: the common dict inside the DCP files
DIST_CONFIG = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
               "common_backend_version": 1}
EXTRA_STATE_LINEARS = LINEARS  # each local-spec linear of a dense layer has an `_extra_state`
_LOCAL_TO_TE = {local: te for te, local in TE_NORM_NAMES.items()}
_MLA_LOCAL_TO_TE = {local: te for te, local in MLA_TE_NORM_NAMES.items()}
_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
# a multi-token prediction layer's transformer layer: its own keys (no layer axis), named as a decoder layer's below
_MTP_LAYER = re.compile(r"(mtp\.layers\.\d+\.transformer_layer)\.(.+)")
_EXPERT = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.(.+)")


def homogeneous(spec: ModelSpec) -> bool:
    """Megatron-Core stacks per-layer tensors on a layer axis only when every layer has the same modules; a model
    with dense and MoE layers (moe_layer_freq a list) keeps per-layer keys `decoder.layers.<N>.…`."""
    return spec.moe is None or not spec.moe.layer_pattern


def dist_key(name: str, stacked: bool = True, te_norms: bool = True,
             mla: bool = False) -> tuple[str, tuple[int, ...]]:
    """qlm's global tensor name -> (torch_dist key, index along the key's leading stacked axes): (layer,) for a
    layer's tensor, (layer, expert) for a routed expert's (key `decoder.layers.mlp.experts.experts.…`, the
    doubled `experts` is megatron-core's), () for the rest. `stacked` False: the per-layer keys of a non-homogeneous
    model, the layer in the key ((expert,) or () left). `te_norms` False: the norms under their module names
    (`pre_mlp_layernorm.weight`, as Transformer-Engine-spec MoE layers store it) instead of the fused names; `mla`:
    the fused names of a multi-latent attention layer (MLA_TE_NORM_NAMES)."""
    match, mtp = _LAYER.fullmatch(name), _MTP_LAYER.fullmatch(name)
    if match is None and mtp is None:
        return name, ()
    if mtp is not None:
        prefix, suffix, index = mtp.group(1), mtp.group(2), ()
    else:
        layer, suffix = int(match.group(1)), match.group(2)
        prefix = "decoder.layers" if stacked else f"decoder.layers.{layer}"
        index: tuple[int, ...] = (layer,) if stacked else ()
    expert = _EXPERT.fullmatch(suffix)
    if expert is not None:
        suffix, index = f"mlp.experts.experts.{expert.group(2)}", (*index, int(expert.group(1)))
    elif te_norms:
        suffix = (_MLA_LOCAL_TO_TE if mla else _LOCAL_TO_TE).get(suffix, suffix)
    return f"{prefix}.{suffix}", index


def primary_key(name: str, spec: ModelSpec, stacked: bool) -> tuple[str, tuple[int, ...]]:
    """Where the local spec's sharded_state_dict puts `name`: the fused-norm names of grouped-query attention's
    layers (its keys map), the modules' own names in multi-latent attention's (whose local spec maps none)."""
    return dist_key(name, stacked, te_norms=spec.mla is None)


def te_spec_norm_key(name: str, spec: ModelSpec, stacked: bool) -> str | None:
    """The key the other spec stores a norm under, when it differs from primary_key's; None for every other
    tensor. Writers store it beside the primary key, so a torch_dist checkpoint loads into either spec
    (Megatron-LM's default strictness accepts the key the other spec does not use): an MoE layer's
    pre_mlp_layernorm (its own module under Transformer Engine, not fused into linear_fc1); with multi-latent
    attention, the q and kv latents' norms and a dense layer's pre_mlp_layernorm (fused under Transformer Engine)."""
    match, mtp = _LAYER.fullmatch(name), _MTP_LAYER.fullmatch(name)
    if match is None and mtp is None:
        return None
    suffix = (match or mtp).group(2)
    moe_layer = spec.is_moe_layer(int(match.group(1)) if match else spec.num_layers)
    if spec.mla is not None:
        if suffix == "pre_mlp_layernorm.weight" and moe_layer:
            return None  # its own module under both specs
        fused = dist_key(name, stacked, te_norms=True, mla=True)[0]
        return fused if fused != primary_key(name, spec, stacked)[0] else None
    if suffix != "pre_mlp_layernorm.weight" or not moe_layer:
        return None
    return dist_key(name, stacked, te_norms=False)[0]


def dist_key_candidates(name: str, mla: bool = False) -> list[tuple[str, tuple[int, ...]]]:
    """Every (key, index) a torch_dist checkpoint may hold `name` under, the local spec's stacked key first
    (`mla`: a multi-latent attention model's, whose local spec keeps its norms' module names)."""
    order = (False, True) if mla else (True, False)
    return list(dict.fromkeys(dist_key(name, stacked, te, mla) for te in order for stacked in (True, False)))


def extra_state_key(linear: str, layer: int | None, num_layers: int, num_experts: int = 0,
                    stacked: bool = True) -> str:
    """The ShardedObject key of `linear`'s `_extra_state` in `layer` (a local-spec module path, routed experts as
    `mlp.experts.local_experts.<e>.linear_fc1`; `layer` None: `linear` is a global module path, e.g. a
    multi-token prediction layer's): `<key>/shard_<offset>_<shape>` over the stacked axes."""
    stacked = stacked and layer is not None
    name = f"{linear}._extra_state" if layer is None else f"decoder.layers.{layer}.{linear}._extra_state"
    key, index = dist_key(name, stacked)
    shape = ((num_layers,) if stacked else ()) + ((num_experts,) if len(index) > stacked else ())
    offset, size = ".".join(map(str, index)) or "0", ".".join(map(str, shape)) or "1"
    return f"{key}/shard_{offset}_{size}"


def extra_state_keys(spec: ModelSpec) -> list[str]:
    """Every `_extra_state` object a model's torch_dist checkpoint holds (megatron-core requires them on load)."""
    layout, stacked = ModelLayout(spec), homogeneous(spec)
    experts = spec.moe.num_experts if spec.moe is not None else 0
    mtp = [f"mtp.layers.{depth}.{suffix[: -len('._extra_state')]}" for depth in range(spec.mtp_num_layers)
           for suffix, tensor in layout.mtp_entries(depth) if tensor is None]
    return [extra_state_key(linear, layer, spec.num_layers, experts, stacked)
            for layer in range(spec.num_layers) for linear in layout.layer_linears(layer)] + [
        extra_state_key(linear, None, spec.num_layers, experts) for linear in mtp]


# ---- safe metadata ---------------------------------------------------------------------------------------------

_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.planner",
                "torch.distributed.checkpoint.filesystem")
_PLAIN_CLASSES = {("collections", "OrderedDict"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
                  ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath")}  # storage_meta.checkpoint_id


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's `.metadata` pickle, admitting only its own dataclasses and enums, torch sizes, dtypes and layouts.
    Megatron's planner classes (pickled into `all_local_plans`) become inert stand-ins."""

    def find_class(self, module, name):
        if module in _DCP_MODULES:
            found = getattr(importlib.import_module(module), name, None)
            if isinstance(found, type):
                return found
        if module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)):
            return getattr(torch, name)
        if (module, name) == ("torch.serialization", "_get_layout"):
            return torch.serialization._get_layout
        if (module, name) in _PLAIN_CLASSES:
            return getattr(importlib.import_module(module), name)
        if module.startswith("megatron."):
            return ForeignObject
        raise pickle.UnpicklingError(f"GLOBAL {module}.{name} is not allowed in DCP metadata")


class SafeFileSystemReader(FileSystemReader):
    """FileSystemReader whose metadata is read with _MetadataUnpickler instead of plain pickle."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        path = Path(self.path) / DCP_METADATA_FILE
        try:
            with open(path, "rb") as fh:
                metadata = _MetadataUnpickler(fh).load()
        except FileNotFoundError:
            raise QlmError(f"{path} is missing (the save did not finish)", "copy the complete checkpoint") from None
        except pickle.UnpicklingError as exc:
            raise QlmError(f"{path} is not DCP metadata ({exc})", "qlm reads torch.distributed.checkpoint metadata "
                           "only") from None
        except (EOFError, ValueError, TypeError, AttributeError, IndexError) as exc:
            raise QlmError(f"{path} is truncated or corrupt ({type(exc).__name__})", "re-copy the checkpoint") from None
        if not isinstance(metadata, Metadata):
            raise QlmError(f"{path} does not hold DCP metadata", "re-copy the checkpoint")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        return metadata


def check_storage_files(directory: Path, metadata: Metadata):
    """Every file the metadata points into exists and is long enough: a missing rank file or a truncated .distcp
    is an error before anything is read or written."""
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        path = directory / name
        if not path.exists():
            raise QlmError(f"{directory} lacks {name}", "copy the complete checkpoint (every __R_K.distcp file)")
        if path.stat().st_size < size:
            raise QlmError(f"{path} is truncated ({path.stat().st_size} of at least {size} bytes)",
                           "re-copy the checkpoint")


def load_from_bytes(data: bytes, what: str):
    """A torch-serialized object held in a DCP byte item, with weights_only=True and qlm's allow-list."""
    try:
        with torch.serialization.safe_globals(allowed_globals()):
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise QlmError(f"{what} holds a Python object qlm does not load ({str(exc).splitlines()[0]})",
                       "re-save the checkpoint without it") from None
    except (RuntimeError, EOFError, OSError) as exc:
        raise QlmError(f"{what} is truncated or corrupt ({type(exc).__name__})", "re-copy the checkpoint") from None


class _IntoBuffers(LoadPlanner):
    """Reads a given plan straight into given tensors (dest_index.fqn -> tensor) and keeps byte items as bytes."""

    def __init__(self, targets: dict[str, torch.Tensor]):
        self.targets, self.blobs = targets, {}

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):
        pass

    def create_local_plan(self):
        raise NotImplementedError

    def create_global_plan(self, global_plan):
        return global_plan

    def finish_plan(self, central_plan):
        return central_plan

    def load_bytes(self, read_item, value):
        self.blobs[read_item.dest_index.fqn] = value.read()

    def resolve_tensor(self, read_item):
        return self.targets[read_item.dest_index.fqn]

    def commit_tensor(self, read_item, tensor):
        pass


# ---- the reader ------------------------------------------------------------------------------------------------


class TorchDistCheckpoint:
    """A torch_dist checkpoint as a TensorSource of global tensors (see layout.py). It has no TP/PP of its own:
    `tp`/`pp` are the sizes it was saved with (from its args), `layout` is the global one-rank view."""

    ckpt_format = "torch_dist"

    vpp = 1
    lora = None
    holds_base = True

    def __init__(self, root: str | Path, iteration: int | None = None, spec: ModelSpec | None = None,
                 view: str = "model"):
        self.root = Path(root)
        if not self.root.is_dir():
            raise QlmError(f"{self.root} is not a directory", "point at a Megatron checkpoint directory")
        if view != "model" and view not in OPTIMIZER_VIEWS:
            raise ValueError(f"view must be model or one of {OPTIMIZER_VIEWS}, not {view!r}")
        self.view = view
        self.dir, self.iteration = resolve_dist_dir(self.root, iteration)
        self._check_config()
        self._reader = SafeFileSystemReader(str(self.dir))
        self.metadata = self._reader.read_metadata()
        check_storage_files(self.dir, self.metadata)
        self._reader.set_up_storage_reader(self.metadata, True)
        self.tensors = {k: v for k, v in self.metadata.state_dict_metadata.items()
                        if isinstance(v, TensorStorageMetadata)}
        self.common = self._load_common()
        self.args = self.common.get("args")
        if self.args is None:
            raise QlmError(f"{self.dir} has no args in its common state", "qlm needs Megatron's args to know the "
                           "architecture")
        self.tp = getattr(self.args, "tensor_model_parallel_size", 1) or 1
        self.pp = getattr(self.args, "pipeline_model_parallel_size", 1) or 1
        self.spec = spec or self._spec()
        embedding = self._tensor_meta("embedding.word_embeddings.weight")
        self.dtype = embedding.properties.dtype
        divisible = getattr(self.args, "make_vocab_size_divisible_by", 128) or 128
        self.layout = ModelLayout(self.spec, make_vocab_size_divisible_by=divisible, padded_vocab=embedding.size[0])
        if view != "model" and not self.holds_optimizer():
            raise QlmError(f"{self.dir} holds no optimizer state ({view})",
                           "resume from a checkpoint written by qlm train, or start the optimizer afresh")
        self._check_tensors()
        self._cache_owner: tuple[str, int | None] | None = None
        self._cache: dict[int, torch.Tensor] = {}

    # ---- discovery -------------------------------------------------------------------------------------------

    def _check_config(self):
        config_file = self.dir / DIST_CONFIG_FILE
        if not config_file.exists():
            raise QlmError(f"{self.dir} lacks {DIST_CONFIG_FILE} (the save did not finish)", "copy the complete "
                           "checkpoint")
        backend = read_json_object(config_file, "re-copy the checkpoint").get("sharded_backend")
        if backend != "torch_dist":
            raise QlmError(f"{self.dir} uses the {backend!r} sharded backend", "qlm reads torch_dist checkpoints; "
                           "re-save it with --ckpt-format torch_dist")

    def _load_common(self) -> dict:
        common_file = self.dir / COMMON_FILE
        if common_file.exists():
            common = safe_torch_load(common_file)
        elif isinstance(self.metadata.state_dict_metadata.get(COMMON_STATE_KEY), BytesStorageMetadata):
            common = load_from_bytes(self.read_bytes(COMMON_STATE_KEY), f"{self.dir} {COMMON_STATE_KEY}")
            common = common[0] if isinstance(common, list) and common else common
        else:
            raise QlmError(f"{self.dir} has neither {COMMON_FILE} nor a {COMMON_STATE_KEY} object",
                           "copy the complete checkpoint")
        if not isinstance(common, dict):
            raise QlmError(f"the common state of {self.dir} is not a dict", "is it a Megatron checkpoint?")
        return common

    def _spec(self) -> ModelSpec:
        return megatron_spec(self.root, self.args)

    def _tensor_meta(self, key: str) -> TensorStorageMetadata:
        if key not in self.tensors:
            raise QlmError(f"{self.dir} lacks the tensor {key}", "the checkpoint is incomplete or not a GPT model")
        return self.tensors[key]

    def _check_tensors(self):
        if self.view == "model":  # a weight key no tensor of the architecture reads would be dropped silently
            # (a tensor's other candidate keys are the same tensor under another spec's name: MoE norms are written
            # under both the local and the Transformer-Engine spec's key)
            mla = self.layout.spec.mla is not None
            used = {key for tensor in self.layout.global_tensors
                    for key, _ in dist_key_candidates(tensor.stored_name, mla)}
            weights = [k for k in self.tensors if k.startswith(("embedding.", "decoder.", "mtp.", "output_layer."))]
            side = self.root / HF_SIDE_DIR / "config.json"
            check_no_leftovers(self.dir, weights, used, self._described_as() or
                               (str(side) if side.exists() else "the args"))
        for tensor in self.layout.global_tensors:
            if tensor.buffer and self.view != "model":  # buffers have no optimizer state
                continue
            key, expected = self._key(tensor)[0], self.expected_size(tensor)
            found = tuple(self._tensor_meta(key).size)
            if found != expected:
                raise QlmError(f"{self.dir}: {key} is {list(found)}, the args describe {list(expected)}",
                               "the checkpoint does not match its args (or hf/config.json)")

    def _described_as(self) -> str | None:
        """What describes the architecture when not the checkpoint's own args (ConfiguredTorchDist says)."""
        return None

    def expected_size(self, tensor: TensorLayout) -> tuple[int, ...]:
        """The global size the key holding `tensor` must have: its stacked axes (layers unless the key is a
        per-layer one, then experts) and the tensor's shape."""
        key, index = self._key(tensor)
        key = key.removeprefix("" if self.view == "model" else view_prefix(self.view))
        per_layer = re.match(r"(?:.*/)?(decoder|mtp)\.layers\.\d+\.", key) is not None
        axes = ([] if per_layer else [self.spec.num_layers]) + ([self.spec.moe.num_experts] if self.spec.moe else [])
        return (*axes[: len(index)], *tensor.shape)

    def holds(self, tensor: TensorLayout) -> bool:
        """True when this view stores `tensor` (an optimizer view has no entries for frozen parameters)."""
        return self._key(tensor)[0] in self.tensors

    def holds_optimizer(self) -> bool:
        """True when qlm's trainer stored its optimizer views beside the weights."""
        return view_prefix(OPTIMIZER_VIEWS[0]) + "embedding.word_embeddings.weight" in self.tensors

    def extra_state(self, key: str, tp_rank: int = 0, pp_rank: int = 0):
        """An entry of the common state (e.g. `opt_param_scheduler`), or None."""
        return self.common.get(key)

    # ---- reads -----------------------------------------------------------------------------------------------

    def _key(self, tensor: TensorLayout) -> tuple[str, tuple[int, ...]]:
        """Where `tensor` is stored: the first candidate key present (the local spec's stacked one, else the
        per-layer keys of a non-homogeneous model, else the Transformer-Engine spec's norm names), and its index
        along the key's stacked axes."""
        prefix = "" if self.view == "model" else view_prefix(self.view)
        candidates = dist_key_candidates(tensor.stored_name, self.layout.spec.mla is not None)
        for key, index in candidates:
            meta = self.tensors.get(prefix + key)
            if meta is not None and len(meta.size) == len(index) + len(tensor.shape):
                return prefix + key, index
        return prefix + candidates[0][0], candidates[0][1]

    def read_bytes(self, key: str) -> bytes:
        index = MetadataIndex(key)
        item = ReadItem(LoadItemType.BYTE_IO, index, torch.Size([0]), index, torch.Size([0]), torch.Size([0]))
        planner = _IntoBuffers({})
        self._read(LoadPlan([item]), planner)
        return planner.blobs[key]

    def _read(self, plan: LoadPlan, planner: LoadPlanner):
        try:
            self._reader.read_data(self._reader.prepare_local_plan(plan), planner).wait()
        except (RuntimeError, EOFError, OSError, pickle.UnpicklingError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise QlmError(f"a .distcp file in {self.dir} is truncated or corrupt ({first})",
                           "re-copy the checkpoint") from None

    def _chunk(self, key: str, index: int) -> torch.Tensor:
        chunk = self.tensors[key].chunks[index]
        if index not in self._cache:
            out = torch.empty(tuple(chunk.sizes), dtype=self.tensors[key].properties.dtype)
            where = MetadataIndex(key, chunk.offsets, index)
            zeros = torch.Size([0] * len(chunk.sizes))
            item = ReadItem(LoadItemType.TENSOR, where, zeros, where, zeros, torch.Size(chunk.sizes))
            self._read(LoadPlan([item]), _IntoBuffers({key: out}))
            self._cache[index] = out
        return self._cache[index]

    def stored_dtype(self, tensor: TensorLayout) -> torch.dtype:
        return self.tensors[self._key(tensor)[0]].properties.dtype

    def read_into(self, tensor: TensorLayout, start: int, stop: int, out: torch.Tensor):
        key, index = self._key(tensor)
        lo = [0] * len(tensor.shape)
        hi = list(tensor.shape)
        lo[tensor.axis], hi[tensor.axis] = start, stop
        lo, hi = [*index, *lo], [*(i + 1 for i in index), *hi]  # the stacked axes
        out = out[(None,) * len(index)]
        if self._cache_owner != (key, index):
            self._cache_owner, self._cache = (key, index), {}
        for index, chunk in enumerate(self.tensors[key].chunks):
            begin = [max(a, o) for a, o in zip(lo, chunk.offsets, strict=True)]
            end = [min(b, o + s) for b, o, s in zip(hi, chunk.offsets, chunk.sizes, strict=True)]
            if any(b >= e for b, e in zip(begin, end, strict=True)):
                continue
            piece = self._chunk(key, index)
            target = out
            for dim, (b, e) in enumerate(zip(begin, end, strict=True)):
                piece = piece.narrow(dim, b - chunk.offsets[dim], e - b)
                target = target.narrow(dim, b - lo[dim], e - b)
            target.copy_(piece)
