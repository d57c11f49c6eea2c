"""LoRA: qlm's adapters equal PEFT's on the transformers model, train through Engine with only the adapters held
by the optimizer, give the one-process losses in every parallel layout (one torchrun launch, 4 gloo ranks), reload
at another TP/PP, and export merged (qlm convert mcore2hf) to a plain HF model with the same logits."""

import json
from pathlib import Path

import pytest
import torch
from conftest import run_worker_jobs
from parallel_cases import GLOBAL_BATCH, SEQ, SPEC, case_spec, make_batch
from workers.lora_worker import CASES, LORA, OPTIM, SAVED_CASE, STEPS, WORLD, logits_ids, lora_moe

from qlm_core.checkpoint.convert.hf_megatron import hf_to_mcore
from qlm_core.checkpoint.formats.hf.checkpoint import HFCheckpoint
from qlm_core.checkpoint.formats.hf.peft import export_peft
from qlm_core.checkpoint.formats.megatron.args import make_args
from qlm_core.checkpoint.formats.megatron.legacy import (
    SHARD_FILE,
    MegatronTorchCheckpoint,
    iteration_dir_name,
    shard_dir_name,
    write_latest,
    write_shard_file,
)
from qlm_core.checkpoint.formats.megatron.lora_args import all_lora_tensors, lora_args
from qlm_core.checkpoint.sources.lora import GlobalTensorSource, build_lora_shard, merged_source
from qlm_core.checkpoint.sources.random_init import RandomInitSource
from qlm_core.config import LoraConfig, OptimConfig, ParallelConfig
from qlm_core.models.gpt import GPTModel
from qlm_core.models.layout import (
    COLS,
    FC1,
    REPLICATED,
    ROWS,
    HFTensorSource,
    ModelLayout,
    build_shard,
    read_range,
)
from qlm_core.parallel.state import Grid
from qlm_core.train.engine import Batch, Engine
from qlm_core.train.lora import apply_lora, load_lora_state, lora_state_dict

ALL_TARGETS = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]


def qlm_lora_model(hf_dir: Path, config: LoraConfig, seed: int = 3) -> tuple[GPTModel, ModelLayout]:
    """The HF model loaded into qlm (one process) with adapters whose B is random, so that every adapter matters."""
    hf = HFCheckpoint(hf_dir)
    layout = ModelLayout(hf.spec)
    model = GPTModel(hf.spec, padded_vocab=layout.padded_vocab)
    model.load_state_dict(build_shard(layout, 0, 0, 0, HFTensorSource(hf)))
    apply_lora([model], config, model.parallel, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    return model.eval(), layout


def token_ids(vocab: int, rows: int = 2, seq: int = 20) -> torch.Tensor:
    return torch.randint(0, vocab, (rows, seq), generator=torch.Generator().manual_seed(11))


def test_adapter_layouts_follow_their_base_weights():
    layout = ModelLayout(SPEC, tp=2)
    tensors = {t.name.split("layers.1.", 1)[1]: t for t in layout.lora_tensors(1, 4, ALL_TARGETS)}
    weights = {t.name.split("layers.1.", 1)[1]: t for t in layout.layer_tensors(1)}
    assert list(tensors) == [f"{m}.lora_{f}.weight" for m in ("self_attention.linear_proj", "self_attention.linear_qkv",
                                                              "mlp.linear_fc1", "mlp.linear_fc2") for f in "AB"]
    qkv_b, qkv_w = tensors["self_attention.linear_qkv.lora_B.weight"], weights["self_attention.linear_qkv.weight"]
    assert qkv_b.split == ROWS and qkv_b.shape == (SPEC.qkv_rows, 4)
    def rows(tensor):
        return [(s.start, s.stop, s.hf_start) for s in tensor.segments]

    assert rows(qkv_b) == rows(qkv_w)
    assert qkv_b.segments[0].hf_name == "model.layers.1.self_attn.q_proj.lora_B.weight"
    qkv_a = tensors["self_attention.linear_qkv.lora_A.weight"]
    assert qkv_a.split == REPLICATED
    assert {s.hf_name.split(".")[-3] for s in qkv_a.segments} == {"q_proj", "k_proj", "v_proj"}
    assert tensors["mlp.linear_fc1.lora_B.weight"].split == FC1
    fc2_a = tensors["mlp.linear_fc2.lora_A.weight"]
    assert fc2_a.split == COLS and fc2_a.shape == (4, 96)
    assert tensors["mlp.linear_fc2.lora_B.weight"].split == REPLICATED
    entries = ModelLayout(SPEC, tp=2, pp=2).lora_shard_entries(1, 0, 4, ["linear_qkv"])
    assert [name for name, _ in entries][:2] == ["decoder.layers.0.self_attention.linear_qkv.lora_A.weight",
                                                "decoder.layers.0.self_attention.linear_qkv.lora_B.weight"]
    assert entries[0][1].name == "decoder.layers.2.self_attention.linear_qkv.lora_A.weight"


@pytest.mark.parametrize("kind, targets", [("qwen2", ALL_TARGETS), ("qwen2_tied", ["linear_qkv", "linear_fc2"]),
                                           ("glm4", ALL_TARGETS),  # GLM-4: one gate_up_proj adapter
                                           ("opt", ALL_TARGETS),  # OPT: out_proj, fc1, fc2
                                           ("bloom", ALL_TARGETS)])  # BLOOM: one query_key_value adapter
def test_peft_export_gives_qlm_logits(kind, targets, hf_models, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    config = LoraConfig(rank=4, alpha=8.0, dropout=0.1, target_modules=targets)
    model, layout = qlm_lora_model(hf_models[kind], config)
    out = export_peft(layout, GlobalTensorSource(lora_state_dict(model)), config, tmp_path / "peft",
                      base_model_name_or_path=str(hf_models[kind]))
    saved = json.loads((out / "adapter_config.json").read_text())
    assert saved["peft_type"] == "LORA" and saved["r"] == 4 and saved["lora_alpha"] == 8.0
    expected_modules = {"linear_qkv": ["q_proj", "k_proj", "v_proj"], "linear_proj": ["o_proj"],
                        "linear_fc1": ["gate_up_proj"] if kind == "glm4" else ["gate_proj", "up_proj"],
                        "linear_fc2": ["down_proj"]}
    if kind == "opt":
        expected_modules.update(linear_proj=["out_proj"], linear_fc1=["fc1"], linear_fc2=["fc2"])
    if kind == "bloom":
        expected_modules.update(linear_qkv=["query_key_value"], linear_proj=["dense"], linear_fc1=["dense_h_to_4h"],
                                linear_fc2=["dense_4h_to_h"])
    assert sorted(saved["target_modules"]) == sorted(m for t in targets for m in expected_modules[t])
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(hf_models[kind]), out).eval()
    ids = token_ids(layout.spec.vocab_size)
    with torch.no_grad():
        ours, theirs = model(ids), peft_model(ids).logits
        with peft_model.disable_adapter():
            base = peft_model(ids).logits
    assert (ours - base).abs().max() > 1e-2  # the adapters change the model...
    assert (ours - theirs).abs().max() <= 1e-5  # ...exactly as PEFT applies them


def test_engine_trains_only_the_adapters(hf_models):
    hf = HFCheckpoint(hf_models["qwen2"])
    engine = Engine(hf.spec, ParallelConfig(), Grid.single(), micro_batch_size=2, global_batch_size=4, seq_length=16,
                    optim=OptimConfig(lr=1e-2, weight_decay=0.0), source=HFTensorSource(hf),
                    lora=LoraConfig(rank=4, alpha=8.0, dropout=0.05))
    named = dict(engine.chunks[0].named_parameters())
    adapters = {id(p) for n, p in named.items() if ".lora_" in n}
    assert len(adapters) == 2 * 4 * hf.spec.num_layers
    assert {id(p) for p in engine.params} == adapters
    assert {id(p) for p in engine.optimizer.params} == adapters
    assert {id(p) for g in engine.optimizer.optimizer.param_groups for p in g["params"]} == adapters
    assert all(not p.requires_grad for n, p in named.items() if ".lora_" not in n)
    base = {n: p.detach().clone() for n, p in named.items() if ".lora_" not in n}
    tokens = torch.randint(0, hf.spec.vocab_size, (4, 17), generator=torch.Generator().manual_seed(5))
    batch = Batch(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
    losses = [engine.train_step(batch).loss for _ in range(6)]
    assert losses[-1] < losses[0] - 0.05, losses
    assert all(torch.equal(p, base[n]) for n, p in named.items() if n in base)
    assert all(p.abs().max() > 0 for n, p in named.items() if ".lora_B." in n)


# ---- multi-rank ------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def parallel_run(tmp_path_factory):
    return run_worker_jobs("lora_worker.py", WORLD, tmp_path_factory.mktemp("lora"), timeout=600)


@pytest.fixture(scope="module")
def reference():
    """One process, per model of the cases: the losses and the trained adapters (global names = its state_dict
    names)."""
    out = {}
    for data in sorted({case.data for case in CASES.values()}):
        engine = Engine(case_spec(data), ParallelConfig(), Grid.single(), micro_batch_size=GLOBAL_BATCH,
                        global_batch_size=GLOBAL_BATCH, seq_length=SEQ, optim=OPTIM, seed=1234, lora=LORA,
                        moe=lora_moe(case_spec(data)))
        input_ids, labels, _, _ = make_batch(False)
        losses = [engine.train_step(Batch(input_ids, labels)).loss for _ in range(STEPS)]
        out[data] = losses, lora_state_dict(engine.chunks[0])
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("case", CASES)
def test_lora_layout_matches_one_process(case, reference, parallel_run):
    out, code, errors = parallel_run
    result = out / f"{case}.json"
    assert result.exists(), f"worker exit {code}: {errors}"
    ref_losses, ref_adapters = reference[CASES[case].data]
    run = json.loads(result.read_text())
    losses = run["losses"]
    assert losses == pytest.approx(ref_losses, rel=1e-4), case
    assert run["optimizer_params"] == run["trainable_params"], case  # frozen base weights carry no optimizer state
    assert losses[-1] < losses[0]
    saved = MegatronTorchCheckpoint(out / case)
    tensors = {t.name: t for t in all_lora_tensors(saved.layout, saved.lora)}
    assert set(tensors) == set(ref_adapters)
    for name, expected in ref_adapters.items():
        actual = read_range(saved, tensors[name], 0, expected.shape[tensors[name].axis])
        error = (actual - expected).norm() / expected.norm()
        assert error <= 1e-4, (case, name, error.item())  # Adam turns fp32 reduction-order noise into ~1e-5


@pytest.mark.distributed
def test_adapters_saved_at_tp2_pp2_load_at_tp1(parallel_run):
    out, code, errors = parallel_run
    assert (out / "logits.pt").exists(), f"worker exit {code}: {errors}"
    saved = MegatronTorchCheckpoint(out / SAVED_CASE)
    assert saved.lora is not None and saved.lora.rank == LORA.rank and not saved.holds_base
    layout = ModelLayout(SPEC)
    model = GPTModel(SPEC, padded_vocab=layout.padded_vocab)
    model.load_state_dict(build_shard(layout, 0, 0, 0, RandomInitSource(layout, seed=1234)))
    apply_lora([model], LORA, model.parallel, seed=0)  # a different init: everything must come from the file
    load_lora_state([model], saved)
    with torch.no_grad():
        ours = model.eval()(logits_ids())
    theirs = torch.load(out / "logits.pt", weights_only=True)
    assert (ours - theirs).abs().max() <= 1e-5


@pytest.mark.distributed
def test_lora_layer_sends_only_rank_sized_activations(parallel_run):
    """On top of the base layer's collectives (width h = 64), the adapters add only width-r (4) ones: with SP an
    all-gather after A of qkv/fc1 and a reduce-scatter after A of proj/fc2 (and their transposes in backward);
    without SP two r-wide all-reduces in forward and nothing in backward (A reads the base's copy_to_tp input)."""
    out, code, errors = parallel_run
    assert (out / "collectives.json").exists(), f"worker exit {code}: {errors}"
    counts = json.loads((out / "collectives.json").read_text())
    r, h = LORA.rank, SPEC.hidden_size
    assert counts["no_sp"]["forward"] == [["all_reduce", r]] * 2 + [["all_reduce", h]] * 2
    assert counts["no_sp"]["backward"] == [["all_reduce", h]] * 2
    assert counts["sp"]["forward"] == [["all_gather", r]] * 2 + [["all_gather", h]] * 2 + \
        [["reduce_scatter", r]] * 2 + [["reduce_scatter", h]] * 2
    assert counts["sp"]["backward"] == [["all_gather", r]] * 2 + [["all_gather", h]] * 4 + \
        [["reduce_scatter", r]] * 2 + [["reduce_scatter", h]] * 2


# ---- merged export ---------------------------------------------------------------------------------------------------


def write_adapter_checkpoint(root: Path, layout: ModelLayout, adapters, config: LoraConfig, base: Path):
    """What a LoRA run at layout's TP/PP saves: per rank only its adapter shards, args naming the base."""
    args = make_args(layout, torch.float32, **lora_args(config, base=str(base)))
    for pp_rank in range(layout.pp):
        for tp_rank in range(layout.tp):
            chunks = [build_lora_shard(layout, tp_rank, pp_rank, c, adapters, config) for c in range(layout.vpp)]
            file = root / iteration_dir_name(None) / shard_dir_name(tp_rank, pp_rank, layout.pp) / SHARD_FILE
            write_shard_file(file, chunks, args, None)
    write_latest(root, None)


@pytest.mark.parametrize("base_format", ["hf", "mcore"])
def test_mcore2hf_writes_lora_run_merged(base_format, hf_models, tmp_path, run_qlm):
    from transformers import AutoModelForCausalLM

    config = LoraConfig(rank=4, alpha=16.0, target_modules=ALL_TARGETS)
    model, layout = qlm_lora_model(hf_models["qwen2"], config)
    adapters = GlobalTensorSource(lora_state_dict(model))
    base_dir = hf_models["qwen2"]
    if base_format == "mcore":  # the base itself a Megatron checkpoint (at another TP than the adapters)
        base_dir = hf_to_mcore(hf_models["qwen2"], tmp_path / "base_mcore", tp=4, verify=False).out
    run = tmp_path / "lora_run"
    write_adapter_checkpoint(run, ModelLayout(layout.spec, tp=2, pp=2), adapters, config, base_dir)

    base = HFTensorSource(HFCheckpoint(hf_models["qwen2"]))
    merged = merged_source(base, adapters, layout, config)
    for suffix in ("1.self_attention.linear_qkv.weight", "2.mlp.linear_fc2.weight"):  # rows, then columns
        tensor = next(t for t in layout.global_tensors if t.name.endswith(suffix))
        whole = read_range(merged, tensor, 0, tensor.shape[tensor.axis])
        part = read_range(merged, tensor, 5, 37)  # computed on its own, from those rows of B (columns of A)
        assert torch.allclose(part, whole.narrow(tensor.axis, 5, 32), rtol=0, atol=1e-6)

    code, stdout, stderr = run_qlm("convert", "mcore2hf", "--mcore", run, "--out", tmp_path / "merged", "--verify")
    assert code == 0, stdout + stderr
    merged_hf = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert (tmp_path / "merged" / "tokenizer.json").exists()
    ids = token_ids(layout.spec.vocab_size)
    with torch.no_grad():
        assert (merged_hf(ids).logits - model(ids)).abs().max() <= 1e-5


def test_mcore2hf_of_adapters_without_a_base_says_what_is_missing(tmp_path):
    from qlm_core.checkpoint.convert.hf_megatron import mcore_to_hf
    from qlm_core.checkpoint.sources.lora import LoraInitSource
    from qlm_core.errors import QlmError

    layout = ModelLayout(SPEC, tp=2)
    args = make_args(layout, torch.float32, **lora_args(LORA, base=None))
    for tp_rank in range(2):
        shard = build_lora_shard(layout, tp_rank, 0, 0, LoraInitSource(), LORA)
        write_shard_file(tmp_path / "run" / "release" / shard_dir_name(tp_rank, 0, 1) / SHARD_FILE, [shard], args, None)
    write_latest(tmp_path / "run", None)
    with pytest.raises(QlmError, match="qlm_lora_base"):
        mcore_to_hf(tmp_path / "run", tmp_path / "out")


@pytest.mark.parametrize("base_format", ["mcore", "relative_hf"])
def test_mcore2peft_export_loads_with_auto_peft(base_format, hf_models, tmp_path, run_qlm):
    """adapter_config.json's base_model_name_or_path is an HF directory that loads: the run's HF base (a path
    relative to the checkpoint made absolute), or a Megatron base exported as HF into OUT/base."""
    import shutil

    from peft import AutoPeftModelForCausalLM

    config = LoraConfig(rank=4, alpha=16.0, target_modules=ALL_TARGETS)
    model, layout = qlm_lora_model(hf_models["qwen2"], config)
    adapters = GlobalTensorSource(lora_state_dict(model))
    if base_format == "mcore":
        base = hf_to_mcore(hf_models["qwen2"], tmp_path / "base_mcore", tp=2, verify=False).out
    else:
        shutil.copytree(hf_models["qwen2"], tmp_path / "hf_base")
        base = Path("..") / "hf_base"  # relative to the run's checkpoint root, as a recipe may name it
    write_adapter_checkpoint(tmp_path / "run", ModelLayout(layout.spec, tp=2), adapters, config, base)
    code, stdout, stderr = run_qlm("convert", "mcore2peft", "--mcore", tmp_path / "run", "--out", tmp_path / "peft")
    assert code == 0, stdout + stderr
    saved = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert Path(saved["base_model_name_or_path"]).is_absolute()
    peft_model = AutoPeftModelForCausalLM.from_pretrained(tmp_path / "peft").eval()
    ids = token_ids(layout.spec.vocab_size)
    with torch.no_grad():
        assert (peft_model(ids).logits - model(ids)).abs().max() <= 1e-5
