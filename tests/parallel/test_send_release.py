"""SendRelease replayed over torch's own multi-chunk action orders (interleaved 1F1B and zero-bubble; no processes):
every rank runs its actions in order, a computation waits for the send it reads, and the release rule frees a sent
input gradient (a sent output) once something the previous (next) rank sent later has arrived. A release never
waits for a send the peer has not yet read (it would block), and at each rank's activation peak (most chunk forwards
in flight) only a few sends are held, whatever the number of micro-batches; profile/memory.py counts as many."""

import types

import pytest
from torch.distributed.pipelining.schedules import (
    BACKWARD_INPUT,
    FORWARD,
    FULL_BACKWARD,
    SEND_B,
    SEND_F,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    _add_send_recv,
)

from qlm_core.parallel.pipeline import SendRelease
from qlm_core.profile.memory import held_sends

SCHEDULES = {"interleaved_1f1b": ScheduleInterleaved1F1B, "zero_bubble": ScheduleInterleavedZeroBubble}


def action_orders(schedule: str, pp: int, vpp: int, microbatches: int) -> dict[int, list]:
    """torch's per-rank orders with their sends and receives, computed as its schedule's constructor does."""
    cls, rounds = SCHEDULES[schedule], max(1, microbatches // pp)
    shape = types.SimpleNamespace(n_local_stages=vpp, pp_group_size=pp, _n_microbatches=microbatches,
                                  microbatches_per_round=microbatches // rounds, number_of_rounds=rounds,
                                  _num_stages=pp * vpp)
    compute = {}
    for rank in range(pp):
        shape.rank = rank
        compute[rank] = cls._calculate_single_rank_operations(shape, rank)
    if cls is ScheduleInterleavedZeroBubble:
        shape.pipeline_order = compute
        compute = cls._add_bubbles_to_actions(shape, pp * vpp)
    compute = {rank: [a for a in actions if a is not None] for rank, actions in compute.items()}
    return _add_send_recv(compute, lambda stage: stage % pp, pp * vpp)


def replay(schedule: str, pp: int, vpp: int, microbatches: int) -> dict[int, tuple[int, int, int]]:
    """Per rank: (most chunk forwards in flight, sent gradients and sent outputs held at that moment)."""
    orders, last = action_orders(schedule, pp, vpp, microbatches), pp * vpp - 1
    position = dict.fromkeys(range(pp), 0)

    class Work:
        def __init__(self, peer: int, read_at: int):
            self.peer, self.read_at = peer, read_at

        def wait(self):  # a real wait would block until the peer has run the action that reads the send
            assert position[self.peer] > self.read_at, ("would block", schedule, pp, vpp, microbatches)

    gradients = {r: SendRelease.gradients(orders[(r - 1) % pp]) for r in range(pp)}
    outputs = {r: SendRelease.outputs(orders[(r + 1) % pp]) for r in range(pp)}
    posted, in_flight = set(), dict.fromkeys(range(pp), 0)
    peak = {r: (-1, 0, 0) for r in range(pp)}
    while any(position[r] < len(orders[r]) for r in range(pp)):
        moved = False
        for r in range(pp):
            while position[r] < len(orders[r]):
                action = orders[r][position[r]]
                stage, mb, kind = action.stage_index, action.microbatch_index, action.computation_type
                if kind == FORWARD and stage > 0 and ("F", stage - 1, mb) not in posted:
                    break
                if kind in (FULL_BACKWARD, BACKWARD_INPUT) and stage < last and ("B", stage + 1, mb) not in posted:
                    break
                if kind == SEND_F:
                    posted.add(("F", stage, mb))
                    release = outputs[r]
                    release.posted(stage, mb, [Work((r + 1) % pp, release.read_at[(stage + 1, mb)])])
                elif kind == SEND_B:
                    posted.add(("B", stage, mb))
                    release = gradients[r]
                    release.posted(stage, mb, [Work((r - 1) % pp, release.read_at[(stage - 1, mb)])])
                elif kind == FORWARD:
                    in_flight[r] += 1
                    if stage > 0:
                        gradients[r].received(stage, mb)
                elif kind in (FULL_BACKWARD, BACKWARD_INPUT):
                    in_flight[r] -= 1
                    if stage < last:
                        outputs[r].received(stage, mb)
                peak[r] = max(peak[r], (in_flight[r], len(gradients[r]._pending), len(outputs[r]._pending)))
                position[r] += 1
                moved = True
                if kind in (FORWARD, FULL_BACKWARD, BACKWARD_INPUT):
                    break  # one computation per rank per round
        assert moved, "the replay deadlocked"
    for r in range(pp):
        gradients[r].wait_all()
        outputs[r].wait_all()
    return peak


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize(("pp", "vpp", "microbatches"), [(2, 2, 8), (2, 2, 64), (4, 2, 64), (8, 8, 64), (4, 5, 64),
                                                         (35, 3, 280), (3, 2, 9)])
def test_releases_never_block_and_few_sends_are_held_at_the_activation_peak(schedule, pp, vpp, microbatches):
    peak = replay(schedule, pp, vpp, microbatches)
    for rank, (in_flight, gradients, outputs) in peak.items():
        assert (gradients, outputs) <= held_sends(schedule, pp, rank, in_flight), (rank, peak[rank])


def test_without_the_release_every_send_would_be_held_until_the_step_ends():
    """The rule is what bounds it: with no proofs (every received() ignored) the ranks hold far more."""
    original = SendRelease.received
    SendRelease.received = lambda self, stage, mb: None
    try:
        peak = replay("interleaved_1f1b", 2, 2, 64)
    finally:
        SendRelease.received = original
    assert peak[1][1] > 2 and peak[0][2] > 3
