"""torch.load with weights_only=True, plus the few non-tensor classes Megatron files pickle.

Megatron's `args` is an argparse.Namespace; its RNG state holds numpy arrays; newer versions also pickle a few of
their enums and config dataclasses. qlm does not import megatron: those classes are read into a stand-in that
keeps their constructor arguments and state, which is all a converter needs.
"""

from __future__ import annotations

import argparse
import pathlib
import pickle
import re
import types
import zipfile
from pathlib import Path

import numpy
import torch

from qlm_core.errors import QlmError


class ForeignObject:
    """Stand-in for a Megatron/DeepSpeed class: remembers how it was built, never runs its code."""

    def __init__(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs

    def __setstate__(self, state):
        self.state = state

    def __repr__(self):
        return f"ForeignObject{self.args or ''}"


_FOREIGN_CLASSES = (
    "megatron.core.enums.ModelType",
    "megatron.core.transformer.enums.AttnBackend",
    "megatron.core.transformer.enums.AttnMaskType",
    "megatron.core.transformer.enums.CudaGraphModule",
    "megatron.core.transformer.enums.CudaGraphScope",
    "megatron.core.transformer.enums.InferenceCudaGraphScope",
    "megatron.core.optimizer.optimizer_config.OptimizerConfig",
    "megatron.core.optimizer.OptimizerConfig",
    "megatron.core.rerun_state_machine.RerunDiagnostic",
    "megatron.core.rerun_state_machine.RerunMode",
    "megatron.core.rerun_state_machine.RerunState",
)


def _numpy_globals() -> list:
    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # numpy 1.x
        from numpy.core.multiarray import _reconstruct
    # Files written under numpy 1.x name numpy.core, under 2.x numpy._core.
    allowed = [numpy.ndarray, numpy.dtype]
    allowed += [(_reconstruct, f"{module}.multiarray._reconstruct") for module in ("numpy.core", "numpy._core")]
    for dtype_cls in ("UInt32DType", "Float64DType", "Float32DType", "Int64DType", "BoolDType"):
        if hasattr(numpy.dtypes, dtype_cls):
            allowed.append(getattr(numpy.dtypes, dtype_cls))
    return allowed


def allowed_globals() -> list:
    return [
        argparse.Namespace,
        types.SimpleNamespace,
        pathlib.PosixPath,
        torch._C.Generator,
        *_numpy_globals(),
        *[(ForeignObject, name) for name in _FOREIGN_CLASSES],
    ]


def safe_torch_load(path: str | Path, *, mmap: bool = False, extra_globals: list | None = None,
                    map_location: str = "cpu"):
    """Load a torch file with weights_only=True and qlm's allow-list; one-line errors for bad files. `map_location`
    "meta": the structure without the bytes (each storage's file offset in `_checkpoint_offset`)."""
    path = Path(path)
    if mmap and path.is_file() and not zipfile.is_zipfile(path):
        mmap = False  # torch's pre-1.6 (non-zip) format, which Megatron-LM of that age wrote, cannot be mapped
    try:
        with torch.serialization.safe_globals(allowed_globals() + list(extra_globals or [])):
            return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except FileNotFoundError:
        raise QlmError(f"{path} does not exist", "check the checkpoint path") from None
    except pickle.UnpicklingError as exc:
        found = re.search(r"GLOBAL ([\w.]+)", str(exc))
        what = f"the class {found.group(1)}" if found else "a Python object"
        raise QlmError(f"{path} holds {what}, which qlm does not load (weights_only=True)",
                       "re-save the checkpoint without it") from None
    except (RuntimeError, EOFError, zipfile.BadZipFile, OSError) as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        first_line = first_line.split(". ")[0]  # torch goes on with advice that does not fit one line
        raise QlmError(f"{path} is truncated or corrupt ({first_line})", "re-copy or re-save it") from None
