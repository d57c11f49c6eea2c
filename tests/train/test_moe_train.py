"""Training MoE models: the tiny MoE recipe through `qlm train` reproduces its one-process losses and MoE figures at
ep2 x tp2 x SP x pp2 x dp2 (ZeRO 1, both overlaps: the CLI's one 8-rank run; each dimension alone: the Engine-level
parity suite's moe_* cases), metrics.jsonl carries the MoE terms, LoRA adapts attention and the shared expert, and
bad [moe] settings get one-line errors."""

from pathlib import Path

import pytest
import torch
from helpers import metrics, qlm_train
from parallel_cases import GLOBAL_BATCH, MOE, MOE_TRAINING, SEQ, make_batch

from qlm_core.config import LoraConfig, MoeConfig, OptimConfig, ParallelConfig
from qlm_core.errors import QlmError
from qlm_core.parallel.state import Grid
from qlm_core.train.engine import Batch, Engine

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "tiny-moe.toml"
SHORT = ["--set", "train.train_iters=10", "--set", "train.eval_interval=0", "--set", "train.micro_batch_size=4",
         "--set", "checkpoint.save_interval=0", "--set", "logging.tensorboard=false", "--set", "logging.plot=false"]
MOE_KEYS = ("moe_aux_loss", "moe_z_loss", "moe_load_max", "moe_load_min")


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("moe-cache")


@pytest.fixture(scope="module")
def baseline(tmp_path_factory, cache):
    run = tmp_path_factory.mktemp("moe-runs") / "base"
    qlm_train(RECIPE, "--output", run, "--set", f"data.cache_dir={cache!s}", *SHORT)
    return run


@pytest.mark.slow
def test_the_recipe_logs_the_moe_terms_and_its_loss_falls(baseline):
    lines = metrics(baseline)
    assert len(lines) == 10 and lines[-1]["loss"] < lines[0]["loss"]
    for line in lines:
        assert all(key in line for key in MOE_KEYS), line
        assert line["moe_aux_loss"] > 0 and line["moe_z_loss"] > 0
        assert line["moe_load_max"] >= 1 >= line["moe_load_min"] >= 0


@pytest.mark.distributed
def test_ep2_tp2_sp_pp2_dp2_zero1_reproduces_the_one_process_run(baseline, cache, tmp_path):
    layout = ["parallel.ep=2", "parallel.tp=2", "parallel.sp=true", "parallel.pp=2", "parallel.dp=2",
              "parallel.zero_stage=1", "parallel.overlap_grad_reduce=true", "parallel.overlap_param_gather=true"]
    sets = [arg for kv in layout for arg in ("--set", kv)]
    qlm_train(RECIPE, "--output", tmp_path / "run", "--set", f"data.cache_dir={cache!s}", *SHORT, *sets,
              timeout=900)
    ours, reference = metrics(tmp_path / "run"), metrics(baseline)
    assert [m["loss"] for m in ours] == pytest.approx([m["loss"] for m in reference], rel=1e-4)
    for mine, theirs in zip(ours, reference, strict=True):
        assert {k: mine[k] for k in MOE_KEYS} == pytest.approx({k: theirs[k] for k in MOE_KEYS}, rel=1e-4)


def test_lora_adapts_attention_and_the_shared_expert_only():
    engine = Engine(MOE, ParallelConfig(), Grid.single(), micro_batch_size=2, global_batch_size=GLOBAL_BATCH,
                    seq_length=SEQ, optim=OptimConfig(lr=1e-3), moe=MOE_TRAINING,
                    lora=LoraConfig(rank=4, target_modules=["linear_qkv", "linear_fc1", "linear_fc2"]))
    trainable = [n for n, p in engine.chunks[0].named_parameters() if p.requires_grad]
    assert "decoder.layers.0.mlp.shared_experts.linear_fc1.lora_A.weight" in trainable
    assert "decoder.layers.2.mlp.linear_fc2.lora_B.weight" in trainable  # the dense layer
    assert not any("local_experts" in n or "router" in n for n in trainable)
    assert sum("self_attention.linear_qkv.lora_" in n for n in trainable) == 2 * MOE.num_layers
    before = engine.chunks[0].decoder.layers[0].mlp.router.weight.clone()
    first = engine.train_step(Batch(*make_batch("plain")))
    for _ in range(3):
        last = engine.train_step(Batch(*make_batch("plain")))
    assert last.loss < first.loss and first.moe["moe_aux_loss"] > 0
    assert torch.equal(engine.chunks[0].decoder.layers[0].mlp.router.weight, before)  # frozen


def test_bad_moe_settings_get_one_line_errors():
    with pytest.raises(QlmError, match="needs parallel.pp = 1"):
        Engine(MOE, ParallelConfig(pp=2), Grid.single(), micro_batch_size=2, global_batch_size=GLOBAL_BATCH,
               seq_length=SEQ, moe=MoeConfig(aux_loss_type="transformers"))
    with pytest.raises(QlmError, match="moe.aux_loss_coeff"):
        Engine(MOE, ParallelConfig(), Grid.single(), micro_batch_size=2, global_batch_size=GLOBAL_BATCH,
               seq_length=SEQ, moe=MoeConfig(aux_loss_coeff=-1.0))
    with pytest.raises(QlmError, match="moe.capacity_factor with parallel.cp > 1"):
        Engine(MOE, ParallelConfig(cp=2), Grid.single(), micro_batch_size=2, global_batch_size=GLOBAL_BATCH,
               seq_length=SEQ, moe=MoeConfig(capacity_factor=1.5))


def test_the_transformers_variant_keeps_no_router_graph_without_a_coefficient():
    engine = Engine(MOE, ParallelConfig(), Grid.single(), micro_batch_size=2, global_batch_size=GLOBAL_BATCH,
                    seq_length=SEQ, moe=MoeConfig(aux_loss_type="transformers", z_loss_coeff=0.01))
    input_ids = make_batch("plain")[0][:2]
    engine.chunks[0](input_ids, torch.arange(SEQ)[None].expand(2, SEQ))
    assert engine.chunks[0].moe.tracker.pending == []


@pytest.mark.parametrize("sets, message", [
    (["moe.aux_loss_type=\"switch\""],
     "moe.aux_loss_type 'switch' is not one of megatron, sequence, global, transformers"),
    (["moe.capacity_factor=0"], "moe.capacity_factor must be > 0"),
    (["moe.experts=4"], "unknown key moe.experts"),
])
def test_bad_moe_recipe_keys_name_the_key(run_qlm, sets, message, tmp_path):
    args = [a for kv in sets for a in ("--set", kv)]
    code, _, stderr = run_qlm("train", RECIPE, *args, "--output", str(tmp_path / "run"))
    assert code != 0 and message in stderr, stderr


def test_a_mixed_dense_and_moe_torch_dist_checkpoint_reopens_with_its_optimizer_views(tmp_path):
    """A Qwen2-MoE-like model (a dense layer among MoE layers: per-layer torch_dist keys) with 8 experts over 4
    layers, so an expert axis cannot pass for a layer axis: the trainer's torch_dist checkpoint reopens in every view
    (its Adam states included) with the tensors the engine held."""
    import dataclasses

    from qlm_core.checkpoint.formats.megatron.format import open_megatron
    from qlm_core.checkpoint.formats.megatron.trainer_state import OPTIMIZER_VIEWS
    from qlm_core.models.layout import read_range
    from qlm_core.train.checkpointing import TrainState, save_checkpoint

    spec = MOE.replace(moe=dataclasses.replace(MOE.moe, num_experts=8))
    engine = Engine(spec, ParallelConfig(), Grid.single(), micro_batch_size=2, global_batch_size=GLOBAL_BATCH,
                    seq_length=SEQ, optim=OptimConfig(lr=1e-3), moe=MOE_TRAINING)
    engine.train_step(Batch(*make_batch("plain")))
    save_checkpoint(tmp_path, engine, TrainState(iteration=1), keep_last=1, extra_args={}, fmt="torch_dist")
    for view in ("model", *OPTIMIZER_VIEWS):
        ckpt = open_megatron(tmp_path, 1, view=view)
        fc1 = next(t for t in ckpt.layout.global_tensors if t.name.endswith("local_experts.7.linear_fc1.weight"))
        assert read_range(ckpt, fc1, 0, fc1.real_extent).shape == fc1.shape, view
    weights = open_megatron(tmp_path, 1)
    router = next(t for t in weights.layout.global_tensors if t.name == "decoder.layers.3.mlp.router.weight")
    assert torch.equal(read_range(weights, router, 0, 8), engine.chunks[0].decoder.layers[3].mlp.router.weight)
