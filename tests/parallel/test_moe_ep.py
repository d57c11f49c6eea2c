"""Expert parallelism beyond the parity suite's layouts: LoRA at ep2 reproduces one process, the dispatch plan's
splits and expert-major order, and the layout rules' one-line errors; the global-batch load-balancing loss counts
every data rank's tokens."""

import json

import pytest
from conftest import run_worker_jobs
from parallel_cases import GLOBAL_BATCH, MOE, MOE_TRAINING, SEQ
from workers.moe_ep_worker import first_step_moe, lora_losses

from qlm_core.config import ParallelConfig
from qlm_core.errors import QlmError
from qlm_core.parallel.state import Grid, resolve_sizes
from qlm_core.train.engine import Engine


@pytest.fixture(scope="module")
def ep_run(tmp_path_factory):
    return run_worker_jobs("moe_ep_worker.py", 2, tmp_path_factory.mktemp("moe_ep"), timeout=300)


@pytest.mark.distributed
def test_lora_at_ep2_reproduces_one_process(ep_run):
    out, code, errors = ep_run
    assert (out / "lora_ep2.json").exists(), f"worker exit {code}: {errors}"
    got = json.loads((out / "lora_ep2.json").read_text())
    assert got == pytest.approx(lora_losses(ParallelConfig(), Grid.single()), rel=1e-5)


@pytest.mark.distributed
def test_the_dispatch_plan_exchanges_counts_and_orders_rows_by_expert(ep_run):
    out, code, errors = ep_run
    plans = [json.loads((out / f"plan.rank{r}.json").read_text()) for r in (0, 1)]
    # rank r sends r+1 rows to each expert: 2(r+1) to each ep rank; it receives 2 from rank 0 and 4 from rank 1
    assert [p["input_splits"] for p in plans] == [[2, 2], [4, 4]]
    assert [p["output_splits"] for p in plans] == [[2, 4], [2, 4]]
    assert [p["expert_counts"] for p in plans] == [[3, 3], [3, 3]]
    # received: [src0 e0, src0 e1, src1 e0 e0, src1 e1 e1] -> e0 rows (0, 2, 3) then e1 rows (1, 4, 5)
    assert plans[0]["to_expert_major"] == [0, 2, 3, 1, 4, 5]


@pytest.mark.distributed
def test_the_global_loss_counts_every_data_ranks_tokens(ep_run):
    """At dp2 with one micro-batch per rank, fᵢ is over both ranks' rows: the sum of the two ranks' parts is the
    micro-batch loss of one process holding both rows, which enters the objective halved (one over dp)."""
    out, code, errors = ep_run
    assert (out / "global_dp2.json").exists(), f"worker exit {code}: {errors}"
    got = json.loads((out / "global_dp2.json").read_text())
    one_process = first_step_moe(ParallelConfig(), Grid.single(), MOE_TRAINING, rows=4)
    assert got["moe_aux_loss"] == pytest.approx(one_process["moe_aux_loss"] / 2, rel=1e-5)
    assert got["moe_z_loss"] == pytest.approx(one_process["moe_z_loss"], rel=1e-5)


@pytest.mark.parametrize("parallel, world, message", [
    (dict(ep=3), 3, "parallel.ep = 3 does not divide the model's 4 experts"),
    (dict(ep=2, tp=2), 4, "needs sequence parallelism"),
    (dict(ep=2, etp=3), 6, "parallel.etp = 3 does not divide the experts' ffn size 32"),
])
def test_expert_layouts_the_model_cannot_take_get_one_line_errors(parallel, world, message):
    config = ParallelConfig(**parallel)
    sizes = resolve_sizes(world, tp=config.tp, ep=config.ep, etp=config.etp)
    with pytest.raises(QlmError, match=message):
        Engine(MOE, config, Grid(sizes), micro_batch_size=1, global_batch_size=24, seq_length=SEQ)


def test_ep_needs_an_moe_model_and_a_dividing_grid():
    from parallel_cases import SPEC

    with pytest.raises(QlmError, match="needs a Mixture-of-Experts model"):
        Engine(SPEC, ParallelConfig(ep=2), Grid(resolve_sizes(2, ep=2)), micro_batch_size=1,
               global_batch_size=GLOBAL_BATCH, seq_length=SEQ)
    with pytest.raises(QlmError, match="ep\\*etp = 4\\*1 does not divide dp\\*cp\\*tp"):
        resolve_sizes(2, ep=4, etp=1)


def test_capacity_under_ep_and_tp_is_refused():
    """Each SP rank would drop by its own share of the micro-batch (Megatron's per-rank rule), not as one process."""
    from qlm_core.config import MoeConfig

    config = ParallelConfig(ep=2, tp=2, sp=True)
    with pytest.raises(QlmError, match="moe.capacity_factor with expert parallelism under tp > 1"):
        Engine(MOE, config, Grid(resolve_sizes(4, tp=2, ep=2)), micro_batch_size=1, global_batch_size=GLOBAL_BATCH,
               seq_length=SEQ, moe=MoeConfig(capacity_factor=1.0))

