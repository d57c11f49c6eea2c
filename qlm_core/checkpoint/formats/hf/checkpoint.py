"""Hugging Face checkpoints: lazy safetensors reads (only the slices asked for) and sharded safetensors writes."""

from __future__ import annotations

import json
import math
import re
import shutil
import struct
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from qlm_core.checkpoint.formats.hf import fp8, mxfp4
from qlm_core.checkpoint.io.safe_load import safe_torch_load
from qlm_core.checkpoint.io.text import read_json_object
from qlm_core.dtypes import HF_DTYPE_NAMES, set_hf_config_dtype
from qlm_core.errors import QlmError
from qlm_core.models.families import FAMILIES
from qlm_core.models.hf_experts import PackedView, hf_packed_experts, packed_expert_slab, packed_in_files
from qlm_core.models.layout import hf_copies, without_absent_mtp
from qlm_core.models.spec import SUPPORTED_MODEL_TYPES, ModelSpec

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
INDEX_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
_BUFFERS = ("rotary_emb.inv_freq",)  # non-persistent buffers older transformers saved
_ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "F8_E8M0": torch.float8_e8m0fnu,
}


def _naturals(value) -> bool:
    """A list of non-negative ints (a safetensors header's shape or data_offsets)."""
    return isinstance(value, list) and all(type(n) is int and n >= 0 for n in value)


def is_hf_dir(path: Path) -> bool:
    return (path / "config.json").exists() and any(
        p.suffix in (".safetensors", ".bin") for p in path.iterdir()
    )


CONFIG_FIX = "restore the model's config.json (UTF-8 JSON, as transformers saves it)"
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
_SIZES = _REQUIRED + ("num_key_value_heads", "head_dim", "max_position_embeddings")


def read_config(path: str | Path) -> dict:
    """config.json of a model directory (or the file itself), checked to be a UTF-8 JSON object whose layer counts
    agree with each other."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.exists():
        raise QlmError(f"no config.json in {path}", "point at a Hugging Face model directory")
    config = read_json_object(file, CONFIG_FIX)
    if config.get("model_type") in SUPPORTED_MODEL_TYPES:  # (others: ModelSpec names the supported ones)
        family = FAMILIES[config["model_type"]]
        aliases = dict(family.config_aliases)  # OPT's ffn_dim
        sizes = [size for size in _SIZES if size not in family.unread_config]  # BLOOM's MLP width: 4 h, unstated
        older = dict(family.read_aliases)  # BLOOM-176B's n_embed
        for key in (aliases.get(size, size) for size in sizes):
            value = config.get(key, config.get(older.get(key, key)))
            fix = f"set {key} to the model's size (as transformers saves it)"
            if value is None and key in _REQUIRED:
                raise QlmError(f"{file} lacks {key}", fix)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise QlmError(f"{file} has {key} {value!r}, not a positive integer", fix)
    layers, types = config.get("num_hidden_layers"), config.get("layer_types")
    if isinstance(types, list) and isinstance(layers, int) and len(types) != layers:
        raise QlmError(f"{file} says num_hidden_layers {layers} but lists {len(types)} layer_types",
                       "make num_hidden_layers and layer_types agree (as many layer_types as layers)")
    return config


def _safetensors_header(file: Path) -> tuple[dict, int]:
    """Parse the header and check the file is long enough for every tensor it declares (catches truncation).
    Returns the header and the file offset where tensor data starts."""
    fix = "re-download or re-export it"
    try:
        size = file.stat().st_size
        with open(file, "rb") as fh:
            (length,) = struct.unpack("<Q", fh.read(8))
            if 8 + length > size:
                raise QlmError(f"{file} is not a safetensors file or is truncated (its header claims {length} "
                               f"bytes, the file has {size})", fix)
            header = json.loads(fh.read(length))
    except (OSError, struct.error, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise QlmError(f"{file} is not a readable safetensors file ({exc})", fix) from None
    if not isinstance(header, dict) or not all(
        isinstance(info, dict) and _naturals(info.get("data_offsets")) and len(info["data_offsets"]) == 2
        and _naturals(info.get("shape")) for key, info in header.items() if key != "__metadata__"
    ):
        raise QlmError(f"{file} has a malformed safetensors header", fix)
    header.pop("__metadata__", None)
    end = max((info["data_offsets"][1] for info in header.values()), default=0)
    if 8 + length + end > size:
        raise QlmError(
            f"{file} is truncated ({size} bytes, its header needs {8 + length + end})", "re-download or re-export it"
        )
    for name, info in header.items():  # a shape that disagrees with its byte range would read the wrong bytes
        dtype = _ST_DTYPES.get(info.get("dtype"))
        if dtype is None:
            raise QlmError(f"{file}: tensor {name} has dtype {info.get('dtype')!r}, which safetensors does not "
                           f"define (one of {', '.join(_ST_DTYPES)})", fix)
        start, stop = info["data_offsets"]
        if stop < start or stop - start != math.prod(info["shape"]) * dtype.itemsize:
            raise QlmError(f"{file}: tensor {name} claims shape {info['shape']} ({info['dtype']}) but its byte range "
                           f"[{start}, {stop}) holds {stop - start} bytes", fix)
    _check_tiling(file, header, fix)
    return header, 8 + length


def _check_tiling(file: Path, header: dict, fix: str):
    """The tensors' byte ranges must cover the data area exactly once, as safetensors writes them (and as
    transformers checks): two ranges that overlap would make one tensor read the other's bytes."""
    ranges = sorted((info["data_offsets"][0], info["data_offsets"][1], name) for name, info in header.items())
    covered, last = 0, None
    for start, stop, name in ranges:
        if start < covered and last is not None and stop > start:
            raise QlmError(f"{file}: the header gives tensor {name} the bytes [{start}, {stop}), which overlap tensor "
                           f"{last[2]}'s [{last[0]}, {last[1]}) (one of the two entries is wrong)", fix)
        if start > covered:
            raise QlmError(f"{file}: the header leaves bytes [{covered}, {start}) to no tensor, before tensor {name} "
                           "(an entry's offsets are wrong)", fix)
        covered, last = max(covered, stop), (start, stop, name)


class HFCheckpoint:
    """An HF model directory opened for lazy reads."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_dir():
            raise QlmError(f"{self.path} is not a directory", "point --hf at a Hugging Face model directory")
        self.config = read_config(self.path)
        self.spec = ModelSpec.from_hf_config(self.config)
        self._files: dict[str, Path] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._dtypes: dict[str, torch.dtype] = {}
        self._data_offsets: dict[str, int] = {}  # absolute file offset of each safetensors tensor's bytes
        self._stored: dict[str, str] = {}  # qlm's name -> the files' key, where they differ (OPT's decoder.*)
        self._bin_cache: dict[Path, dict] = {}
        # per-expert name -> where it lies in a packed tensor (transformers-5's fused MoE layout, gpt-oss's), read as
        # the per-expert tensors the layout asks for
        self._fused: dict[str, PackedView] = {}
        self._mxfp4: dict[str, tuple[str, str]] = {}  # gpt-oss's MXFP4 experts: packed name -> (blocks, scales)
        self._slab: tuple[tuple[str, int], torch.Tensor] | None = None  # the last expert slab read (gate, then up)
        self._fp8: dict[str, str] = {}  # FP8 weights (name -> their scale grid's name), read dequantised
        self.notes: list[str] = []  # what reading does beyond copying (FP8 dequantisation)
        self._scan()
        self._find_mtp()
        self._find_mxfp4()
        self._alias_fused_experts()
        self._find_fp8()

    def _check_index(self):
        """A sharded model's index names every weight file: one deleted or never copied is an error here."""
        index = self.path / INDEX_FILES[0]
        if not index.exists():
            return
        weight_map = read_json_object(index, "restore model.safetensors.index.json").get("weight_map")
        if not isinstance(weight_map, dict):
            raise QlmError(f"{index} has no weight_map", "restore model.safetensors.index.json")
        missing = sorted({str(f) for f in weight_map.values() if not (self.path / str(f)).is_file()})
        if missing:
            raise QlmError(f"{self.path} lacks {', '.join(missing)}, which {index.name} lists",
                           "copy the complete model (every shard the index names)")

    def _scan(self):
        self._check_index()
        files = sorted(self.path.glob("*.safetensors"))
        if files:
            for file in files:
                header, data_start = _safetensors_header(file)
                for key, info in header.items():
                    name = self._name_of(key)
                    self._files[name] = file
                    self._shapes[name] = tuple(info["shape"])
                    self._dtypes[name] = _ST_DTYPES.get(info["dtype"], torch.float32)
                    self._data_offsets[name] = data_start + info["data_offsets"][0]
            return
        files = sorted(self.path.glob("pytorch_model*.bin"))
        if not files:
            raise QlmError(f"no *.safetensors or pytorch_model*.bin weights in {self.path}", "add the weight files")
        for file in files:
            for key, tensor in self._load_bin(file).items():
                name = self._name_of(key)
                self._files[name] = file
                self._shapes[name] = tuple(tensor.shape)
                self._dtypes[name] = tensor.dtype

    def _name_of(self, key: str) -> str:
        """A stored key as the layout names it: OPT's releases were saved from OPTModel, whose keys lack the
        `model.` of OPTForCausalLM's (transformers adds it on load, as base_model_prefix)."""
        if FAMILIES[self.spec.model_type].hf_names and key.startswith("decoder."):
            self._stored["model." + key] = key
            return "model." + key
        return key

    def _find_mtp(self):
        """config.json may count multi-token prediction layers the weights do not hold (transformers saves none:
        its models drop them): the model is then read without them, and says so."""
        self.spec, note = without_absent_mtp(self.spec, self._shapes.__contains__)
        if note:
            self.notes.append(note)

    def _alias_fused_experts(self):
        """Every per-expert tensor the layout asks for, read from a packed tensor when the files hold that layout.
        A packed tensor must have exactly the config's shape (a row or an expert more would be left unread), and no
        tensor may be stored both ways (which copy counts would be a guess)."""
        views, packed_shapes = hf_packed_experts(self.spec)
        if packed_in_files(self.spec):  # the only form of these files: name what is missing as the files would
            missing = [name for name in packed_shapes if name not in self._shapes]
            if missing:
                raise QlmError(f"tensor {missing[0]} is missing from {self.path}",
                               "the weights do not match config.json")
        for name, view in views.items():
            if view.packed not in self._shapes:
                continue
            if name in self._shapes:
                raise QlmError(f"{self.path} holds {name} twice: on its own and inside {view.packed}",
                               "keep one layout of the experts (transformers' fused tensors or the per-expert ones)")
            shape, wanted = self._shapes[view.packed], packed_shapes[view.packed]
            if shape != wanted:
                raise QlmError(f"{view.packed} in {self.path} is {list(shape)} but config.json implies {list(wanted)} "
                               "([experts, rows, columns])", "the weights do not match config.json")
            self._shapes[name] = view.shape
            self._fused[name] = view
            self._dtypes[name] = self._dtypes[view.packed]

    def _find_mxfp4(self):
        """gpt-oss as released: each packed expert weight as MXFP4 `<name>_blocks` [E, rows, columns / 32, 16]
        (two 4-bit values a byte) and `<name>_scales` [E, rows, columns / 32] (a power of two per 32 values), rows
        the output features; read dequantised, as the [E, columns, rows] tensor transformers holds."""
        for blocks in [n for n in self._shapes if n.endswith(mxfp4.BLOCKS)]:
            name = blocks[: -len(mxfp4.BLOCKS)]
            scales = name + mxfp4.SCALES
            if name in self._shapes:
                raise QlmError(f"{self.path} holds {name} twice: as it is and as MXFP4 {blocks}",
                               "keep one copy of the expert weights")
            if scales not in self._shapes:
                raise QlmError(f"{self.path}: the MXFP4 tensor {blocks} has no {scales} beside it",
                               "restore the checkpoint's scale tensors")
            shape = mxfp4.dequantised_shape(blocks, self._shapes[blocks], self._shapes[scales])
            self._mxfp4[name] = (blocks, scales)
            self._shapes[name], self._dtypes[name] = shape, mxfp4.DEQUANTISED_DTYPE
        if self._mxfp4:
            self.notes.append(f"{len(self._mxfp4)} MXFP4 expert weights dequantised to "
                              f"{str(mxfp4.DEQUANTISED_DTYPE).removeprefix('torch.')}")

    def _find_fp8(self):
        """The weights stored as FP8 with block scales: each reads as DEQUANTISED_DTYPE (or the dtype asked for),
        its scale grid hidden from the tensor list. An FP8 weight without its scale grid is an error."""
        block = fp8.block_size(self.config)
        quantised = [n for n, dt in self._dtypes.items() if dt in fp8.FP8_DTYPES]
        if not quantised:
            return
        if block is None:
            raise QlmError(f"{self.path} stores {len(quantised)} FP8 tensors ({quantised[0]}, ...) but config.json has "
                           "no fp8 quantization_config", "restore the released config.json (its quantization_config)")
        for name in quantised:
            scale = fp8.scale_name(name)
            if not name.endswith(".weight") or scale not in self._shapes:
                raise QlmError(f"{self.path}: the FP8 tensor {name} has no {fp8.SCALE_SUFFIX} beside it",
                               "restore the checkpoint's scale tensors")
            fp8.check_scale_shape(name, self._shapes[name], self._shapes[scale], block)
            self._fp8[name] = scale
            self._dtypes[name] = fp8.DEQUANTISED_DTYPE
        self._block = block
        self.notes.append(f"{len(quantised)} FP8 weights dequantised ({block[0]}x{block[1]} block scales) to "
                          f"{str(fp8.DEQUANTISED_DTYPE).removeprefix('torch.')} or the dtype asked for")

    def _load_bin(self, file: Path) -> dict:
        if file not in self._bin_cache:
            self._bin_cache[file] = safe_torch_load(file, mmap=True)
        return self._bin_cache[file]

    @property
    def names(self) -> list[str]:
        """The tensors the files hold (a fused MoE layout's fused tensors, not the per-expert views of them; FP8
        weights, not their scale grids)."""
        scales = set(self._fp8.values())
        return [n for n in self._files if n not in scales]

    def file_of(self, name: str) -> Path:
        return self._files[name]

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[name]

    def dtype(self, name: str) -> torch.dtype:
        return self._dtypes[name]

    @property
    def weights_dtype(self) -> torch.dtype:
        """The dtype most of the weights are stored in."""
        counts: dict[torch.dtype, int] = {}
        for dt in self._dtypes.values():
            counts[dt] = counts.get(dt, 0) + 1
        return max(counts, key=counts.get)

    def check_shapes(self, expected: dict[str, tuple[int, ...]]):
        """Every tensor the config implies must exist with that shape, and no other may be left over (it would be
        dropped silently), before anything is written (a tied model may still hold its lm_head.weight copy)."""
        ignorable = ("lm_head.weight",) if self.spec.tie_word_embeddings else ()
        copies = hf_copies(self.spec)
        for name, shape in expected.items():
            if name not in self._shapes and name in copies:
                continue  # a multi-token prediction layer's copy of the embedding or the output layer: written only
            if name not in self._shapes:
                raise QlmError(f"tensor {name} is missing from {self.path}", "the weights do not match config.json")
            if self._shapes[name] != tuple(shape):
                raise QlmError(
                    f"tensor {name} has shape {list(self._shapes[name])} but config.json implies {list(shape)}",
                    "the weights do not match config.json",
                )
        fused = {view.packed for view in self._fused.values()} | set(self._fp8.values()) \
            | {part for parts in self._mxfp4.values() for part in parts}
        extra = [n for n in self._shapes
                 if n not in expected and n not in ignorable and n not in fused and not n.endswith(_BUFFERS)]
        if extra:
            layers = sorted({int(m.group(1)) for n in extra if (m := re.search(r"\.layers\.(\d+)\.", n))})
            what = f"layers {', '.join(map(str, layers))} and " if layers else ""
            last = self.spec.num_layers + self.spec.mtp_num_layers
            if layers and min(layers) >= last and any(n.endswith(".eh_proj.weight") for n in extra):
                raise QlmError(f"{self.path} holds multi-token prediction layer(s) from model.layers.{last}.* that "
                               f"config.json does not count (it says {self.spec.mtp_num_layers}); converting "
                               "would drop them", "set num_nextn_predict_layers to the layers the weights hold")
            raise QlmError(
                f"{self.path} holds {what}{len(extra)} tensors config.json does not describe "
                f"({', '.join(extra[:3])}{', ...' if len(extra) > 3 else ''})",
                "fix config.json (num_hidden_layers and the sizes) to match the weights",
            )

    def check_model(self):
        """check_shapes against everything config.json describes (for readers that do not build a layout)."""
        from qlm_core.models.layout import ModelLayout

        layout = ModelLayout(self.spec)
        self.check_shapes({name: layout.hf_shape(name) for name in layout.hf_tensors})

    def read(self, name: str, axis: int = 0, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        """Entries [start, stop) of tensor `name` along `axis` (all when start is None), reading only those bytes."""
        if name in self._fp8:
            return self._read_dequantised(name, axis, start, stop, self._dtypes[name])
        if name in self._fused:
            return self._read_fused(name, axis, start, stop)
        index = slice(start, stop)
        return self._read_index(name, (index,) if axis == 0 else (slice(None), index))

    def _read_index(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        file = self._files.get(name)
        if file is None:
            raise QlmError(f"tensor {name} is missing from {self.path}", "the weights do not match config.json")
        key = self._stored.get(name, name)
        if file.suffix != ".safetensors":
            return self._load_bin(file)[key][index].clone()
        try:
            with safe_open(file, framework="pt") as fh:
                view = fh.get_slice(key)[index]
                # The slice is a view into the memory-mapped file: copy out just its elements, so that nothing
                # keeps the mapping alive and torch.save does not write the whole underlying tensor.
                return torch.empty(view.shape, dtype=view.dtype).copy_(view)
        except Exception as exc:  # safetensors raises its own error types
            raise QlmError(f"cannot read {name} from {file} ({exc})", "re-download or re-export it") from None

    def _read_fused(self, name: str, axis: int, start: int | None, stop: int | None) -> torch.Tensor:
        """A per-expert tensor out of its packed tensor (the whole packed tensor when the view's expert is None),
        entries [start, stop) of it along `axis`."""
        view = self._fused[name]
        if view.expert is None:
            return self.read(view.packed, axis, start, stop)
        if start is None:
            start, stop = 0, view.shape[axis]
        experts = slice(view.expert, view.expert + 1)
        if view.packed not in self._mxfp4 and not view.transposed and view.step == 1:  # only the bytes asked for
            first = view.first
            if axis == 0:
                return self._read_index(view.packed, (experts, slice(first + start, first + stop)))[0]
            return self._read_index(view.packed, (experts, slice(first, first + view.shape[0]), slice(start, stop)))[0]
        slab = self._expert_slab(view.packed, view.expert)
        return packed_expert_slab(slab, view).narrow(axis, start, stop - start).contiguous()

    def _expert_slab(self, packed: str, expert: int) -> torch.Tensor:
        """packed[expert], dequantised when the files hold it as MXFP4; the last one is kept (gpt-oss's gate and up
        are two views of one slab, read one after the other)."""
        if self._slab is not None and self._slab[0] == (packed, expert):
            return self._slab[1]
        if packed not in self._mxfp4:
            slab = self._read_index(packed, (slice(expert, expert + 1),))[0]
        else:
            blocks, scales = (self._read_index(part, (slice(expert, expert + 1),))[0] for part in self._mxfp4[packed])
            slab = mxfp4.dequantise(blocks, scales, self._dtypes[packed]).t()
        self._slab = ((packed, expert), slab)
        return slab

    def _read_dequantised(self, name: str, axis: int, start: int | None, stop: int | None,
                          dtype: torch.dtype) -> torch.Tensor:
        """An FP8 weight's entries [start, stop) along `axis`, times their blocks' scales, in `dtype`."""
        start = 0 if start is None else start
        index = slice(start, stop)
        quantised = self._read_index(name, (index,) if axis == 0 else (slice(None), index))
        return fp8.dequantise(quantised, self._read_index(self._fp8[name], (slice(None),)), self._block, axis, start,
                              dtype)

    def byte_span(self, name: str, start: int, stop: int) -> tuple[Path, int, int] | None:
        """(file, offset, bytes) of rows [start, stop) of a safetensors tensor, which lie contiguous in the file;
        None when the tensor is not stored that way (a .bin file, a view of a fused expert tensor)."""
        if name not in self._data_offsets or name in self._fp8:
            return None
        shape = self._shapes[name]
        row_bytes = self._dtypes[name].itemsize * math.prod(shape[1:])
        return self._files[name], self._data_offsets[name] + start * row_bytes, (stop - start) * row_bytes

    def read_into(self, name: str, axis: int, start: int, stop: int, out: torch.Tensor):
        """Copy entries [start, stop) along `axis` into `out`. Row ranges of safetensors files are read with one
        readinto straight into `out` (twice as fast as copying out of the memory map)."""
        if name in self._fp8:  # straight into the dtype asked for (fp32: no bf16 rounding on the way)
            out.copy_(self._read_dequantised(name, axis, start, stop, out.dtype))
            return
        direct = (
            axis == 0 and name in self._data_offsets and out.is_contiguous() and out.dtype == self._dtypes.get(name)
        )
        if not direct:
            out.copy_(self.read(name, axis, start, stop))
            return
        row_bytes = out.element_size() * (out.numel() // max(out.shape[0], 1) if out.dim() else 1)
        buffer = memoryview(out.view(torch.uint8).numpy()).cast("B")
        with open(self._files[name], "rb", buffering=0) as fh:
            fh.seek(self._data_offsets[name] + start * row_bytes)
            done = 0
            while done < len(buffer):
                n = fh.readinto(buffer[done:])
                if not n:
                    raise QlmError(f"{self._files[name]} ended inside {name}", "re-download or re-export it")
                done += n


def copy_side_files(src: Path, dst: Path):
    """Copy config, generation config and tokenizer files (everything that is not weights)."""
    dst.mkdir(parents=True, exist_ok=True)
    for item in src.iterdir():
        if item.is_file() and item.suffix not in WEIGHT_SUFFIXES and item.name not in INDEX_FILES:
            shutil.copy2(item, dst / item.name)


def write_hf_config(out: Path, side_dir: Path | None, spec: ModelSpec, dtype: torch.dtype,
                    copy=copy_side_files):
    """OUT/config.json: the one in `side_dir` (copied with its side files by `copy`) at `dtype`, or, without one,
    made from `spec`."""
    if side_dir is not None and (side_dir / "config.json").exists():
        copy(side_dir, out)
        config = set_hf_config_dtype(json.loads((out / "config.json").read_text()), dtype)
        if fp8.block_size(config) is not None or mxfp4.is_mxfp4(config):  # what is written is dequantised
            del config["quantization_config"]
    else:
        config = spec.to_hf_config(HF_DTYPE_NAMES[dtype])
    from qlm_core.checkpoint.formats.hf.tokens import add_special_tokens  # eos ids + generation_config.json

    config = add_special_tokens(out, config, side_dir if side_dir is not None and side_dir.is_dir() else None)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def plan_hf_shards(sizes: dict[str, int], max_shard_bytes: int) -> list[list[str]]:
    """Group tensors (in order) into files of at most max_shard_bytes (a larger single tensor gets its own file)."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, size in sizes.items():
        if shards[-1] and used + size > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


def shard_file_names(count: int) -> list[str]:
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def write_hf_shard(path: Path, tensors: dict[str, torch.Tensor]):
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata={"format": "pt"})


def write_hf_index(out: Path, weight_map: dict[str, str], total_bytes: int):
    index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
