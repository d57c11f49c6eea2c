"""qlm profile counts multi-token prediction: its layers' saved bytes (the `mtp` region and their embeddings') and
its loss heads' equal the saved-tensor measurement byte for byte (one and two depths; recompute none, selective,
full and op; fp32 with whole logits, bf16 with the chunked loss); an in-process --probe of the DeepSeek-V3-shaped
model with an MTP layer allocates the predicted model states (its layers, the last stage's embedding copy) and
saves the predicted activations; the layers are frozen weights when they do not train."""

import pytest
import torch
from parallel_cases import MLA

from qlm_core.config import ParallelConfig
from qlm_core.hardware import gpu_spec
from qlm_core.parallel.state import Grid
from qlm_core.profile.case import ProfileCase
from qlm_core.profile.measure import SavedTensorMeter
from qlm_core.profile.memory import activation_inputs
from qlm_core.profile.mtp_terms import mtp_head_bytes, mtp_layer_bytes
from qlm_core.profile.probe import probe
from qlm_core.profile.states import model_state_bytes
from qlm_core.train.engine import Batch, Engine

SEQ = 64
MODES = [("none", ()), ("selective", ("core_attn", "mlp")), ("full", ()), ("op", ())]


def regions(spec, parallel, dtype, chunk):
    engine = Engine(spec, parallel, Grid.single(), micro_batch_size=2, global_batch_size=2, seq_length=SEQ,
                    dtype=dtype, loss_chunk_tokens=chunk)
    ids = torch.randint(0, spec.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(0))
    with SavedTensorMeter(engine.chunks) as meter:
        engine.train_step(Batch(ids, ids.roll(-1, 1)))
    return meter.peak_by_region


@pytest.mark.parametrize("dtype, chunk", [(torch.float32, 0), (torch.bfloat16, 32)], ids=["fp32-whole", "bf16-chunked"])
@pytest.mark.parametrize("recompute, modules", MODES, ids=[m for m, _ in MODES])
def test_mtp_bytes_equal_saved_tensors(recompute, modules, dtype, chunk):
    parallel = ParallelConfig(recompute=recompute, recompute_modules=list(modules or ("core_attn",)))
    without = regions(MLA.replace(mtp_num_layers=0), parallel, dtype, chunk)
    for depths in (1, 2):
        spec = MLA.replace(mtp_num_layers=depths)
        case = ProfileCase(spec=spec, model_name="tiny-mla", parallel=parallel, seq_len=SEQ, micro_batch_size=2,
                           global_batch_size=2, num_gpus=1, dtype="fp32" if dtype == torch.float32 else "bf16",
                           loss_chunk_tokens=chunk)
        x = activation_inputs(case, "cpu")
        measured = regions(spec, parallel, dtype, chunk)
        assert measured["mtp"] > 0 and mtp_layer_bytes(x, recompute) > 0
        assert mtp_layer_bytes(x, recompute) == measured["mtp"] + measured["embedding"] - without["embedding"]
        assert mtp_head_bytes(x) == measured["head"] - without["head"]


def test_probe_of_an_mtp_model_measures_what_is_predicted():
    case = ProfileCase(spec=MLA.replace(mtp_num_layers=2), model_name="tiny-mla",
                       parallel=ParallelConfig(zero_stage=1), seq_len=128, global_batch_size=2,
                       num_gpus=1)
    result = probe(case, gpu_spec("a100-80g"), steps=1)
    for key in ("weights", "grads", "optimizer"):
        assert result.predicted[key] == result.measured[key], key
    for key in ("activations", "logits_loss"):
        assert result.predicted[key] == pytest.approx(result.measured[key], rel=0.01), key


def test_mtp_layers_that_do_not_train_are_frozen_weights():
    """A preference run (or a zero weight) runs no multi-token prediction: its layers hold weights, no gradients or
    optimizer state; the last stage of a pipeline also holds the embedding's copy either way."""
    parallel = ParallelConfig(pp=2)
    trained, frozen = (ProfileCase(spec=MLA, model_name="tiny-mla", parallel=parallel, num_gpus=2,
                                   mtp_loss_scaling_factor=scale) for scale in (0.1, 0.0))
    assert trained.trains_mtp and not frozen.trains_mtp
    last = [model_state_bytes(case.layout(), 1, dtype=torch.bfloat16, zero_stage=0, shards=1,
                              mtp_trainable=case.trains_mtp) for case in (trained, frozen)]
    assert last[0].weights == last[1].weights and last[0].grads > last[1].grads
    without = model_state_bytes(ProfileCase(spec=MLA.replace(mtp_num_layers=0), model_name="m", parallel=parallel,
                                            num_gpus=2).layout(), 1, dtype=torch.bfloat16, zero_stage=0, shards=1)
    assert last[1].weights > without.weights


def test_mtp_adds_its_layers_and_logits_to_the_last_stages_time_and_to_the_model_flops():
    from qlm_core.models.flops import flops_per_sequence, mtp_flops_per_token
    from qlm_core.profile.efficiency import Efficiency
    from qlm_core.profile.timing import microbatch_times

    gpu = gpu_spec("h100-sxm")
    parallel = ParallelConfig(pp=2, tp=2, sp=True)
    cases = {name: ProfileCase(spec=spec, model_name=name, parallel=parallel, seq_len=4096, num_gpus=4,
                               mtp_loss_scaling_factor=scale)
             for name, spec, scale in (("with", MLA, 0.1), ("without", MLA.replace(mtp_num_layers=0), 0.1),
                                       ("frozen", MLA, 0.0))}
    times = {name: [microbatch_times(case, gpu, Efficiency(), stage) for stage in (0, 1)]
             for name, case in cases.items()}
    assert times["with"][0] == times["without"][0]  # the first stage runs no multi-token prediction
    assert times["frozen"][1] == times["without"][1]
    for key in ("compute", "tp_comm"):
        assert times["with"][1][key] > times["without"][1][key], key
    extra = flops_per_sequence(MLA, 4096) - flops_per_sequence(MLA.replace(mtp_num_layers=0), 4096)
    assert extra == pytest.approx(3 * 4096 * mtp_flops_per_token(MLA, 4096), rel=1e-12) and extra > 0


@pytest.mark.parametrize("name", ["deepseek-v3-256gpu.toml", "glm-4.5-air-lora-16gpu.toml"])
def test_the_deepseek_v3_class_recipes_dry_run_and_fit(name, run_qlm):
    """The search's picks (DeepSeek-V3 on 256 H100s, GLM-4.5-Air with LoRA on 16): each dry-runs and fits 80 GiB,
    its MTP layer counted (trained in the first, frozen but run under LoRA in the second)."""
    from pathlib import Path

    from qlm_core.config import load_recipe
    from qlm_core.profile.case import build_case, validate_case
    from qlm_core.profile.memory import estimate_memory

    recipe = Path(__file__).resolve().parents[2] / "recipes" / name
    code, _, err = run_qlm("train", recipe, "--dry-run")
    assert code == 0, err
    case = build_case(load_recipe(recipe))
    validate_case(case)
    assert case.spec.mtp_num_layers == 1 and case.trains_mtp
    assert estimate_memory(case, gpu_spec("h100").memory_gib).fits
