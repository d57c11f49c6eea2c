"""Hugging Face checkpoints: lazy safetensors reads (only the slices asked for) and sharded safetensors writes."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from qlm_core.checkpoint.io.safe_load import safe_torch_load
from qlm_core.dtypes import HF_DTYPE_NAMES, set_hf_config_dtype
from qlm_core.errors import QlmError
from qlm_core.models.spec import ModelSpec, read_hf_config

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
INDEX_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
_ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


def is_hf_dir(path: Path) -> bool:
    return (path / "config.json").exists() and any(
        p.suffix in (".safetensors", ".bin") for p in path.iterdir()
    )


def _safetensors_header(file: Path) -> tuple[dict, int]:
    """Parse the header and check the file is long enough for every tensor it declares (catches truncation).
    Returns the header and the file offset where tensor data starts."""
    try:
        with open(file, "rb") as fh:
            (length,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(length))
        size = file.stat().st_size
    except (OSError, struct.error, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise QlmError(f"{file} is not a readable safetensors file ({exc})", "re-download or re-export it") from None
    header.pop("__metadata__", None)
    end = max((info["data_offsets"][1] for info in header.values()), default=0)
    if 8 + length + end > size:
        raise QlmError(
            f"{file} is truncated ({size} bytes, its header needs {8 + length + end})", "re-download or re-export it"
        )
    return header, 8 + length


class HFCheckpoint:
    """An HF model directory opened for lazy reads."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_dir():
            raise QlmError(f"{self.path} is not a directory", "point --hf at a Hugging Face model directory")
        self.config = read_hf_config(self.path)
        self.spec = ModelSpec.from_hf_config(self.config)
        self._files: dict[str, Path] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._dtypes: dict[str, torch.dtype] = {}
        self._data_offsets: dict[str, int] = {}  # absolute file offset of each safetensors tensor's bytes
        self._bin_cache: dict[Path, dict] = {}
        self._scan()

    def _scan(self):
        files = sorted(self.path.glob("*.safetensors"))
        if files:
            for file in files:
                header, data_start = _safetensors_header(file)
                for name, info in header.items():
                    self._files[name] = file
                    self._shapes[name] = tuple(info["shape"])
                    self._dtypes[name] = _ST_DTYPES.get(info["dtype"], torch.float32)
                    self._data_offsets[name] = data_start + info["data_offsets"][0]
            return
        files = sorted(self.path.glob("pytorch_model*.bin"))
        if not files:
            raise QlmError(f"no *.safetensors or pytorch_model*.bin weights in {self.path}", "add the weight files")
        for file in files:
            for name, tensor in self._load_bin(file).items():
                self._files[name] = file
                self._shapes[name] = tuple(tensor.shape)
                self._dtypes[name] = tensor.dtype

    def _load_bin(self, file: Path) -> dict:
        if file not in self._bin_cache:
            self._bin_cache[file] = safe_torch_load(file, mmap=True)
        return self._bin_cache[file]

    @property
    def names(self) -> list[str]:
        return list(self._files)

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
        """Every tensor the config implies must exist with that shape, before anything is written."""
        for name, shape in expected.items():
            if name not in self._shapes:
                raise QlmError(f"tensor {name} is missing from {self.path}", "the weights do not match config.json")
            if self._shapes[name] != tuple(shape):
                raise QlmError(
                    f"tensor {name} has shape {list(self._shapes[name])} but config.json implies {list(shape)}",
                    "the weights do not match config.json",
                )

    def read(self, name: str, axis: int = 0, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        """Entries [start, stop) of tensor `name` along `axis` (all when start is None), reading only those bytes."""
        file = self._files.get(name)
        if file is None:
            raise QlmError(f"tensor {name} is missing from {self.path}", "the weights do not match config.json")
        index = slice(start, stop)
        if file.suffix != ".safetensors":
            tensor = self._load_bin(file)[name]
            return (tensor if start is None else tensor.narrow(axis, start, stop - start)).clone()
        try:
            with safe_open(file, framework="pt") as fh:
                sl = fh.get_slice(name)
                view = sl[index] if axis == 0 else sl[:, index]
                # The slice is a view into the memory-mapped file: copy out just its elements, so that nothing
                # keeps the mapping alive and torch.save does not write the whole underlying tensor.
                return torch.empty(view.shape, dtype=view.dtype).copy_(view)
        except Exception as exc:  # safetensors raises its own error types
            raise QlmError(f"cannot read {name} from {file} ({exc})", "re-download or re-export it") from None

    def read_into(self, name: str, axis: int, start: int, stop: int, out: torch.Tensor):
        """Copy entries [start, stop) along `axis` into `out`. Row ranges of safetensors files are read with one
        readinto straight into `out` (twice as fast as copying out of the memory map)."""
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
    else:
        config = spec.to_hf_config(HF_DTYPE_NAMES[dtype])
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
