"""The Enums of the options that take one of a fixed set of values. Each is built from where qlm_core defines the
values, so Typer lists them in --help and refuses any other with exit code 2, and a new value needs no CLI edit."""

from __future__ import annotations

from collections.abc import Iterable
from enum import Enum

from qlm_core.config import (
    CheckpointFormat,
    ConvertTargetName,
    CpCommType,
    PpSchedule,
    RecomputeMode,
    TrainDtype,
    choices,
)
from qlm_core.config import (
    EvalBackend as EvalBackendName,
)
from qlm_core.config import (
    WeightDtype as WeightDtypeName,
)
from qlm_core.hardware import GPUS


def enum_of(name: str, values: Iterable) -> type[Enum]:
    """A str Enum whose members are named and valued by the given values, in their order."""
    return Enum(name, [(str(v), str(v)) for v in values], type=str, module=__name__)


def value_of(member: Enum | None) -> str | None:
    """The plain value the core takes (None stays None)."""
    return None if member is None else member.value


CpComm = enum_of("CpComm", choices(CpCommType))
PipelineSchedule = enum_of("PipelineSchedule", choices(PpSchedule))
Recompute = enum_of("Recompute", choices(RecomputeMode))
ComputeDtype = enum_of("ComputeDtype", choices(TrainDtype))
WeightDtype = enum_of("WeightDtype", choices(WeightDtypeName))
MegatronFormat = enum_of("MegatronFormat", choices(CheckpointFormat))
ConvertTarget = enum_of("ConvertTarget", choices(ConvertTargetName))
Gpu = enum_of("Gpu", GPUS)
EvalBackend = enum_of("EvalBackend", choices(EvalBackendName))
