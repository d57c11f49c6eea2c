"""SendRelease replayed over torch's own interleaved-1F1B action orders (no processes): every rank runs its actions in
order, a computation waits for the send it reads, and the release rule frees a sent input gradient (a sent output)
once something the previous (next) rank sent later has arrived. At each rank's activation peak (most chunk forwards
in flight) at most two sent gradients and three sent outputs (on the last rank: as many as it has forwards in flight)
are still held, whatever pp, vpp and the number of micro-batches; profile/memory.py counts that many."""

import types

import pytest
from torch.distributed.pipelining.schedules import (
    BACKWARD_INPUT,
    FORWARD,
    FULL_BACKWARD,
    SEND_B,
    SEND_F,
    ScheduleInterleaved1F1B,
    _add_send_recv,
)

from qlm_core.parallel.pipeline import SendRelease


class Work:
    def wait(self):
        pass


def action_orders(pp: int, vpp: int, microbatches: int) -> dict[int, list]:
    rounds = max(1, microbatches // pp)
    shape = types.SimpleNamespace(n_local_stages=vpp, pp_group_size=pp, _n_microbatches=microbatches,
                                  microbatches_per_round=microbatches // rounds)
    compute = {r: ScheduleInterleaved1F1B._calculate_single_rank_operations(shape, r) for r in range(pp)}
    return _add_send_recv(compute, lambda stage: stage % pp, pp * vpp)


def replay(pp: int, vpp: int, microbatches: int) -> dict[int, tuple[int, int, int]]:
    """Per rank: (most chunk forwards in flight, sent gradients and sent outputs held at that moment)."""
    orders, last = action_orders(pp, vpp, microbatches), pp * vpp - 1
    release = {r: SendRelease.gradients(orders[(r - 1) % pp]) for r in range(pp)}
    outputs = {r: SendRelease.outputs(orders[(r + 1) % pp]) for r in range(pp)}
    position, posted = dict.fromkeys(range(pp), 0), set()
    in_flight, peak = dict.fromkeys(range(pp), 0), {r: (-1, 0, 0) for r in range(pp)}
    while any(position[r] < len(orders[r]) for r in range(pp)):
        moved = False
        for r in range(pp):
            while position[r] < len(orders[r]):
                action = orders[r][position[r]]
                if action is None:
                    position[r] += 1
                    continue
                stage, mb, kind = action.stage_index, action.microbatch_index, action.computation_type
                if kind == FORWARD and stage > 0 and ("F", stage - 1, mb) not in posted:
                    break
                if kind in (FULL_BACKWARD, BACKWARD_INPUT) and stage < last and ("B", stage + 1, mb) not in posted:
                    break
                if kind == SEND_F:
                    posted.add(("F", stage, mb))
                    outputs[r].posted(stage, mb, [Work()])
                elif kind == SEND_B:
                    posted.add(("B", stage, mb))
                    release[r].posted(stage, mb, [Work()])
                elif kind == FORWARD:
                    in_flight[r] += 1
                    if stage > 0:
                        release[r].received(stage, mb)
                elif kind in (FULL_BACKWARD, BACKWARD_INPUT):
                    in_flight[r] -= 1
                    if stage < last:
                        outputs[r].received(stage, mb)
                peak[r] = max(peak[r], (in_flight[r], len(release[r]._pending), len(outputs[r]._pending)))
                position[r] += 1
                moved = True
                if kind in (FORWARD, FULL_BACKWARD, BACKWARD_INPUT):
                    break  # one computation per rank per round
        assert moved, "the replay deadlocked"
    return peak


@pytest.mark.parametrize(("pp", "vpp", "microbatches"), [(2, 2, 8), (2, 2, 64), (4, 2, 64), (8, 8, 64), (4, 5, 64),
                                                         (35, 3, 280)])
def test_few_sends_are_held_at_the_activation_peak(pp, vpp, microbatches):
    peak = replay(pp, vpp, microbatches)
    assert all(gradients <= 2 for _, gradients, _ in peak.values()), peak
    # the last rank's outputs go to rank 0, whose gradients for them come last: it keeps those it has in flight
    assert all(outputs <= (in_flight if r == pp - 1 else 3) for r, (in_flight, _, outputs) in peak.items()), peak


def test_without_the_release_every_gradient_would_be_held_until_the_step_ends():
    """The rule is what bounds it: with no proofs (every received() ignored) the ranks hold far more."""
    original = SendRelease.received
    SendRelease.received = lambda self, stage, mb: None
    try:
        peak = replay(2, 2, 64)
    finally:
        SendRelease.received = original
    assert peak[1][1] > 2 and peak[0][2] > 3

