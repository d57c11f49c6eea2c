"""What a pipeline layout must satisfy, checked by the recipe's validation and the profile without importing
torch.distributed.pipelining (it brings torch._dynamo: seconds of start-up)."""

from __future__ import annotations

from qlm_core.config import PpSchedule, choices

MULTI_CHUNK_SCHEDULES = ("interleaved_1f1b", "zero_bubble")  # several chunks (virtual stages) per rank


def min_microbatches(name: str, pp: int) -> tuple[int, int]:
    """(least, multiple): the micro-batches per step that torch's schedule `name` needs on pp stages: at least
    `least` and a multiple of `multiple`. 1F1B needs one micro-batch per stage in flight (Schedule1F1B refuses
    fewer); the multi-chunk schedules run rounds of pp micro-batches (ScheduleInterleaved1F1B and
    ScheduleInterleavedZeroBubble refuse counts that are not whole rounds); GPipe takes any count."""
    if pp == 1 or name == "gpipe":
        return 1, 1
    if name in MULTI_CHUNK_SCHEDULES:
        return pp, pp
    return pp, 1


def validate_schedule(name: str, pp: int, vpp: int, num_microbatches: int) -> None:
    assert name in choices(PpSchedule), f"pp_schedule {name!r}"  # the recipe's schema checked it (config.py)
    if vpp > 1 and name not in MULTI_CHUNK_SCHEDULES:
        raise ValueError(f"vpp {vpp} needs an interleaved schedule (interleaved_1f1b or zero_bubble), not {name}")
    if name == "interleaved_1f1b" and vpp < 2:
        raise ValueError("interleaved_1f1b needs vpp >= 2")
    least, multiple = min_microbatches(name, pp)
    if num_microbatches < least or num_microbatches % multiple:
        raise ValueError(f"pp_schedule {name} on pp = {pp} stages needs "
                         + (f"a multiple of {multiple}" if multiple > 1 else f"at least {least}")
                         + f" micro-batches per step, this layout has {num_microbatches}")


def validate_recompute(schedule: str, pp: int, recompute: str) -> None:
    """torch's selective checkpointing (recompute = "op") lets a region be recomputed once; zero-bubble's weight pass
    would recompute each layer a second time after the input-gradient pass."""
    if pp > 1 and schedule == "zero_bubble" and recompute == "op":
        raise ValueError('recompute "op" cannot run under pp_schedule zero_bubble (its weight pass recomputes each '
                         "layer a second time, which torch's selective checkpointing refuses)")
