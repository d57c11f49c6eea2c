"""The grid's rank arithmetic and the layout checks that run before any process group exists."""

import pytest
from parallel_cases import SPEC

from qlm_core.config import ParallelConfig
from qlm_core.errors import QlmError
from qlm_core.models.layout import ModelLayout
from qlm_core.parallel.state import ParallelSizes, resolve_sizes
from qlm_core.train.validate import validate_layout


def test_tp_is_fastest_then_cp_pp_dp():
    sizes = ParallelSizes(tp=2, pp=2, cp=2, dp=2)
    assert [sizes.coords(r)["tp"] for r in range(4)] == [0, 1, 0, 1]
    assert sizes.coords(2) == {"dp": 0, "pp": 0, "cp": 1, "tp": 0}
    assert sizes.coords(4) == {"dp": 0, "pp": 1, "cp": 0, "tp": 0}
    assert sizes.coords(8) == {"dp": 1, "pp": 0, "cp": 0, "tp": 0}
    assert all(sizes.rank_of(**sizes.coords(r)) == r for r in range(16))


def test_dp_is_derived_and_checked():
    assert resolve_sizes(16, tp=2, pp=2, cp=2).dp == 2
    with pytest.raises(QlmError, match="not divisible by tp\\*pp\\*cp"):
        resolve_sizes(6, tp=4)
    with pytest.raises(QlmError, match="world size 8 != dp\\*pp\\*cp\\*tp"):
        resolve_sizes(8, tp=2, dp=2)


@pytest.mark.parametrize("config,seq,message", [
    (dict(cp=3), 32, "not divisible by 2\\*cp"),
    (dict(tp=4, sp=True, cp=2), 36, "seq_length/cp = 18 is not divisible by tp = 4"),
    (dict(tp=2, sp=True), 33, "not divisible by tp"),
    (dict(tp=2, cp=4, cp_comm_type="a2a"), 32, "a2a needs heads"),
    (dict(vpp=2), 32, "vpp > 1 needs pp > 1"),
    (dict(pp=2, vpp=2, pp_schedule="1f1b"), 32, "needs an interleaved schedule"),
    (dict(overlap_param_gather=True), 32, "needs zero_stage 1 or 2"),
])
def test_bad_layouts_are_named(config, seq, message):
    sizes = resolve_sizes(ParallelConfig(**config).tp * ParallelConfig(**config).cp * ParallelConfig(**config).pp,
                          tp=config.get("tp", 1), pp=config.get("pp", 1), cp=config.get("cp", 1))
    with pytest.raises(QlmError, match=message):
        validate_layout(SPEC, ParallelConfig(**config), sizes, seq, 1, 8)


def test_global_batch_must_split_into_microbatches():
    with pytest.raises(QlmError, match="global_batch_size 6 is not divisible by micro_batch_size\\*dp = 4"):
        validate_layout(SPEC, ParallelConfig(), resolve_sizes(2), 32, 2, 6)


def test_heads_groups_and_layers_must_divide():
    with pytest.raises(QlmError, match="--tp 3"):
        ModelLayout(SPEC, tp=3)
    with pytest.raises(QlmError, match="4 layers cannot be split over 3"):
        ModelLayout(SPEC, pp=3)
    assert ModelLayout(SPEC, pp=3, first_stage_layers=2).stage_layer_counts == (2, 1, 1)


def test_launch_environment_from_torchrun_and_slurm(monkeypatch):
    from qlm_core.parallel.state import first_slurm_host, launch_env

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"):
        monkeypatch.delenv(name, raising=False)
    assert launch_env() == (0, 1, 0)
    monkeypatch.setenv("SLURM_PROCID", "5")
    monkeypatch.setenv("SLURM_NTASKS", "8")
    monkeypatch.setenv("SLURM_LOCALID", "1")
    assert launch_env() == (5, 8, 1)
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "2")
    assert launch_env() == (2, 4, 2)  # torchrun's variables win
    assert first_slurm_host("gpu[03-05,07],cpu1") == "gpu03"
    assert first_slurm_host("node7,node8") == "node7"
    assert first_slurm_host("a[1,3]") == "a1"


def test_bf16_engine_keeps_fp32_master_weights_and_tracks_fp32():
    """bf16 compute with fp32 master weights and fp32 gradient accumulation stays close to the fp32 run."""
    import torch
    from parallel_cases import GLOBAL_BATCH, SEQ, make_batch

    from qlm_core.parallel.state import Grid
    from qlm_core.train.engine import Batch, Engine

    losses = {}
    for dtype in (torch.float32, torch.bfloat16):
        engine = Engine(SPEC, ParallelConfig(), Grid.single(), micro_batch_size=2, global_batch_size=GLOBAL_BATCH,
                        seq_length=SEQ, dtype=dtype)
        batch = Batch(*make_batch(False))
        losses[dtype] = [engine.train_step(batch).loss for _ in range(3)]
        if dtype == torch.bfloat16:
            assert all(p.dtype == torch.bfloat16 for p in engine.params)
            assert all(p.main_grad.dtype == torch.float32 for p in engine.params)
            masters = [t for group in engine.optimizer.optimizer.param_groups for t in group["params"]]
            assert masters and all(t.dtype == torch.float32 for t in masters)
    # observed 3e-4; three steps move the loss by 0.1
    assert losses[torch.bfloat16] == pytest.approx(losses[torch.float32], abs=5e-3)
    assert losses[torch.bfloat16][-1] < losses[torch.bfloat16][0]


def test_non_finite_gradients_skip_the_update():
    import math

    import torch
    from parallel_cases import GLOBAL_BATCH, SEQ, make_batch

    from qlm_core.parallel.state import Grid
    from qlm_core.train.engine import Batch, Engine

    engine = Engine(SPEC, ParallelConfig(), Grid.single(), micro_batch_size=2, global_batch_size=GLOBAL_BATCH,
                    seq_length=SEQ)
    with torch.no_grad():
        engine.chunks[0].decoder.layers[0].mlp.linear_fc2.weight[0, 0] = float("inf")
    before = [p.detach().clone() for p in engine.params]
    result = engine.train_step(Batch(*make_batch(False)))
    assert result.skipped and not math.isfinite(result.grad_norm)
    assert all(torch.equal(a, b) or torch.isinf(a).any() for a, b in zip(before, engine.params, strict=True))


def test_an_sbatch_script_is_not_an_srun_task(monkeypatch):
    """The batch step of `sbatch --ntasks 8` sees SLURM_NTASKS and SLURM_PROCID too, but is one process: qlm must
    start the ranks itself there, and run as one rank only inside an srun step."""
    from qlm_cli.launch import under_launcher

    for name in ("RANK", "WORLD_SIZE", "SLURM_STEP_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_NTASKS", "8")
    monkeypatch.setenv("SLURM_PROCID", "0")
    assert not under_launcher()
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    assert under_launcher()
