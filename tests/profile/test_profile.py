"""qlm profile in one process: the activation formula and model-state bytes against the real model, the pipeline
in-flight counts, the seed defaults, the layout search on the seed's question, and the CLI (tables, --json keys,
--plot, an in-process --probe, one-line errors)."""

import json
from pathlib import Path

import pytest
import torch
from parallel_cases import SPEC

from qlm_core.config import LoraConfig, OptimConfig, ParallelConfig, load_recipe
from qlm_core.hardware import gpu_spec
from qlm_core.models.gpt import GPTModel, ParallelOptions
from qlm_core.parallel.state import Grid
from qlm_core.profile.activations import ActivationInputs, forward_terms, head_terms, layer_bytes
from qlm_core.profile.case import build_case, validate_case
from qlm_core.profile.measure import SavedTensorMeter, measure_model_states
from qlm_core.profile.memory import inflight_chunk_forwards
from qlm_core.profile.search import search
from qlm_core.profile.states import model_state_bytes
from qlm_core.train.engine import Batch, Engine
from qlm_core.train.lora import apply_lora

REPO = Path(__file__).resolve().parents[2]
MHA = SPEC.replace(num_query_groups=4)
SEQ, BATCH = 64, 2


def _ids(spec, rows=BATCH, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, spec.vocab_size, (rows, SEQ + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("spec", [SPEC, MHA], ids=["gqa", "mha"])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_layer_activations_match_saved_tensors(recompute, spec, dtype):
    model = GPTModel(spec, parallel=ParallelOptions(recompute=recompute), num_layers=3, dtype=dtype)
    ids, labels = _ids(spec)
    with SavedTensorMeter(model) as meter:
        loss = model(ids, labels=labels).sum()
    x = ActivationInputs(spec, SEQ, BATCH, dtype_bytes=dtype.itemsize, padded_vocab=model.padded_vocab, device="cpu")
    measured = meter.layer_bytes()
    assert layer_bytes(x, recompute) == pytest.approx(measured["layer1"], rel=0.05)
    # layer 0 also holds the forward's RoPE tables; the loss region is the head's
    assert layer_bytes(x, recompute) + forward_terms(x, False)["rope cos/sin"] == pytest.approx(measured["layer0"],
                                                                                                 rel=0.05)
    assert sum(head_terms(x).values()) == pytest.approx(meter.first_seen["head"], rel=0.05)
    loss.backward()
    assert meter.live_bytes == 0  # everything saved was released by backward


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("chunk", [0, 48], ids=["whole-logits", "chunked"])
@pytest.mark.parametrize("lora_rank", [0, 4])
def test_loss_head_matches_saved_tensors(chunk, dtype, lora_rank):
    """The loss region as built: the whole logits' fp32 softmax, or the chunked loss (48 does not divide the 128
    tokens) keeping only its input, log-sum-exp and targets; with LoRA the output layer is frozen."""
    model = GPTModel(SPEC, num_layers=1, dtype=dtype, loss_chunk_tokens=chunk)
    if lora_rank:
        apply_lora([model], LoraConfig(rank=lora_rank), model.parallel)
    ids, labels = _ids(SPEC)
    with SavedTensorMeter(model) as meter:
        loss = model(ids, labels=labels).sum()
    x = ActivationInputs(SPEC, SEQ, BATCH, dtype_bytes=dtype.itemsize, padded_vocab=model.padded_vocab, device="cpu",
                         lora_rank=lora_rank, loss_chunk_tokens=chunk)
    assert x.chunked_loss == bool(chunk)
    assert sum(head_terms(x).values()) == pytest.approx(meter.first_seen["head"], rel=0.05)
    loss.backward()
    assert meter.live_bytes == 0


def _engine(parallel: ParallelConfig, dtype, lora_rank=0, spec=SPEC):
    lora = LoraConfig(rank=lora_rank, target_modules=["linear_qkv", "linear_fc2"]) if lora_rank else None
    engine = Engine(spec, parallel, Grid.single(), micro_batch_size=1, global_batch_size=2, seq_length=SEQ,
                    dtype=dtype, optim=OptimConfig(lr=1e-3), lora=lora)
    engine.train_step(Batch(*_ids(spec)))
    return engine


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("lora_rank", [0, 4])
def test_model_states_equal_allocation_one_process(dtype, lora_rank):
    parallel = ParallelConfig()
    engine = _engine(parallel, dtype, lora_rank)
    predicted = model_state_bytes(engine.layout, 0, dtype=dtype, zero_stage=0, shards=1, lora_rank=lora_rank,
                                  lora_targets=["linear_qkv", "linear_fc2"])
    measured = measure_model_states(engine)
    assert {"weights": predicted.weights, "grads": predicted.grads, "optimizer": predicted.optimizer} == measured


def test_lora_layer_activations_match():
    engine = _engine(ParallelConfig(), torch.bfloat16, lora_rank=4)
    model = engine.chunks[0]
    ids, labels = _ids(SPEC)
    with SavedTensorMeter(model) as meter:
        model(ids, torch.arange(SEQ)[None].expand(BATCH, SEQ))
    x = ActivationInputs(SPEC, SEQ, BATCH, dtype_bytes=2, device="cpu", lora_rank=4,
                         lora_targets=("linear_qkv", "linear_fc2"))
    assert layer_bytes(x) == pytest.approx(meter.layer_bytes()["layer1"], rel=0.05)


def test_inflight_counts_follow_the_schedules():
    assert [inflight_chunk_forwards("1f1b", 4, 1, 8, r) for r in range(4)] == [4, 3, 2, 1]
    assert inflight_chunk_forwards("1f1b", 4, 1, 2, 0) == 2
    assert inflight_chunk_forwards("gpipe", 4, 1, 8, 0) == 8
    for p, v in ((2, 2), (4, 2), (4, 4)):  # Megatron's factor: 1 + (p-1)/(p v) stage-equivalents of p micro-batches
        chunks = inflight_chunk_forwards("interleaved_1f1b", p, v, 4 * p, 0)
        assert chunks / v == pytest.approx(p * (1 + (p - 1) / (p * v)))
    assert inflight_chunk_forwards("zero_bubble", 4, 1, 8, 0) == 4


def test_defaults_are_the_seed_recipe():
    default = build_case()
    recipe = build_case(load_recipe(REPO / "recipes" / "qwen2-7b-128k.toml"), num_gpus=32)
    for case in (default, recipe):
        validate_case(case)
    assert default.model_name == "qwen2-7b" and recipe.spec == default.spec
    for key in ("seq_len", "micro_batch_size", "global_batch_size", "dtype", "num_gpus"):
        assert getattr(default, key) == getattr(recipe, key), key
    for key in ("tp", "cp", "pp", "sp", "zero_stage", "recompute", "cp_comm_type", "overlap_grad_reduce"):
        assert getattr(default.parallel, key) == getattr(recipe.parallel, key), key
    assert build_case(tp=2, cp=4).sizes.dp == 4


def test_profile_counts_the_chunked_loss(run_qlm):
    """The 7B 128k recipe's loss runs in chunks of 2048 of its 32768 tokens per rank: the loss region keeps its input,
    log-sum-exp and targets, not the fp32 softmax; --loss-chunk-tokens 0 gives that softmax back."""
    from qlm_core.profile.probe import scale_down

    recipe = REPO / "recipes" / "qwen2-7b-128k.toml"
    docs = {}
    for extra in ([], ["--loss-chunk-tokens", "0"]):
        code, out, err = run_qlm("profile", recipe, *extra, "--json")
        assert code == 0, err
        docs[bool(extra)] = json.loads(out)
    chunked, whole = docs[False], docs[True]
    assert chunked["layout"]["loss_chunk_tokens"] == 2048 and whole["layout"]["loss_chunk_tokens"] == 0
    tokens, vocab = 131072 // 4, 152064 // 4
    assert whole["memory"]["components_gib"]["logits_loss"] > 4 * vocab * tokens / 2**30
    assert chunked["memory"]["components_gib"]["logits_loss"] < 0.05 * whole["memory"]["components_gib"]["logits_loss"]
    case = build_case(load_recipe(recipe), num_gpus=32)
    assert case.loss_chunk_tokens == 2048
    scaled = scale_down(case)  # the probe's CPU case still runs the loss in chunks
    assert 0 < scaled.loss_chunk_tokens < scaled.micro_batch_size * scaled.seq_len // scaled.parallel.cp


@pytest.fixture(scope="module")
def seed_search():
    return search(build_case(), 32, gpu_spec("a100-80g"))


def test_search_on_the_seed_question(seed_search):
    result = seed_search
    assert result.fitting and result.fitting[0].case.parallel.cp > 1
    for candidate in result.fitting[:20]:  # the trainer accepts them and they fit
        validate_case(candidate.case)
        assert candidate.memory.fits
    assert all(not c.memory.fits and c.oom_by_gib > 0 for c in result.rejected)
    text = " ".join(result.notes)
    assert "without context parallelism" in text and "OOM by" in text
    # `none` layouts with CP fit (and rank in the list): the note says only the ones without CP OOM
    assert any(c.case.parallel.recompute == "none" for c in result.fitting)
    assert "recompute none: every layout without CP OOMs" in text and "recompute none: every layout OOMs" not in text
    times = [c.s_per_sample for c in result.fitting]
    assert times == sorted(times)


# ---- CLI ----------------------------------------------------------------------------------------------------------


def test_profile_help(run_qlm):
    code, out, _ = run_qlm("profile", "--help")
    assert code == 0
    for option in ("--tp", "--cp", "--search", "--probe", "--json", "--plot", "--gpu", "--recompute-num-layers"):
        assert option in out
    assert "qwen2-7b" in out and "131072" in out


def test_seed_question_answers_at_once(run_qlm):
    code, out, err = run_qlm("profile", "--tp", "4", "--cp", "4")
    assert code == 0, err
    assert "tp4 pp1 cp4 dp2 sp p2p zero1 full" in out
    assert "fits" in out and "s/sample" in out and "MFU" in out


JSON_KEYS = {"schema", "kind", "model", "layout", "gpu", "memory", "time", "assumed"}
MEMORY_KEYS = {"stage", "components_gib", "total_gib", "capacity_gib", "headroom_gib", "fits",
               "activation_per_layer_gib", "inflight_microbatches", "layers", "stages_total_gib", "allocator"}
TIME_KEYS = {"step_s", "s_per_sample", "tokens_per_s_per_device", "tflops_per_device", "mfu",
             "megatron_tflops_per_device", "megatron_mfu", "components_s"}


def test_json_keys_are_stable(run_qlm, tmp_path):
    code, out, err = run_qlm("profile", "--tp", "4", "--pp", "2", "--cp", "2", "--json", "--plot", tmp_path / "m.png")
    assert code == 0, err
    doc = json.loads(out)
    assert set(doc) == JSON_KEYS and doc["schema"] == "qlm-profile/1" and doc["kind"] == "profile"
    assert set(doc["memory"]) == MEMORY_KEYS and set(doc["time"]) == TIME_KEYS
    assert set(doc["memory"]["components_gib"]) == {"weights", "grads", "optimizer", "activations", "logits_loss",
                                                    "workspace", "pp_buffers", "comm_buffers", "rollout",
                                                    "allocator"}
    assert doc["layout"]["pp"] == 2 and len(doc["memory"]["stages_total_gib"]) == 2
    assert (tmp_path / "m.png").stat().st_size > 1000


def test_search_json(run_qlm, seed_search):
    code, out, err = run_qlm("profile", "--search", "--num-gpus", "32", "--gpu", "a100-80g", "--top", "3", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["kind"] == "search" and len(doc["results"]) == 3
    assert set(doc["results"][0]) == {"rank", "layout", "memory", "time", "why"}
    assert doc["results"][0]["layout"]["cp"] > 1 and doc["results"][0]["why"]
    assert all(r["oom_by_gib"] > 0 for r in doc["rejected"]) and doc["notes"]


@pytest.mark.slow
def test_probe_in_process_agrees_within_10_percent(run_qlm):
    code, out, err = run_qlm("profile", "--tp", "1", "--cp", "1", "--dp", "1", "--gbs", "2", "--dtype", "fp32",
                             "--probe", "--steps", "2", "--json")
    assert code == 0, err
    probe = json.loads(out)["probe"]
    assert probe["device"] == "cpu" and probe["layout"]["num_gpus"] == 1
    assert abs(probe["total"]["error"]) < 0.10
    for key in ("weights", "grads", "optimizer"):
        assert probe["components"][key]["error"] == 0
    assert abs(probe["components"]["activations"]["error"]) < 0.05
    assert probe["s_per_sample"]["measured"] > 0


@pytest.mark.parametrize("args,message", [
    (["--tp", "3"], "does not divide num_attention_heads 28"),
    (["--cp", "3", "--num-gpus", "12"], "not divisible by 2*cp"),
    (["--zero", "5"], "zero_stage 5"),
    (["--tp", "0"], "tp must be >= 1, got 0"),
    (["--cp", "0"], "cp must be >= 1, got 0"),
    (["--model", "gpt-5"], "neither a model preset nor a directory"),
    (["--efficiency", "1.5"], "--efficiency"),
    (["--num-gpus", "24"], "24 GPUs are not divisible by tp*pp*cp = 16"),
    (["--num-gpus", "32", "--dp", "4"], "world size 32 != dp*pp*cp*tp"),
    (["--gbs", "3"], "at 32 GPUs (dp 2) the global batch of 3 sequences is not a multiple of micro-batch x dp = 2"),
    (["--gbs", "3", "--dp", "2", "--num-gpus", "32"], "global_batch_size 3 is not divisible"),
])
def test_bad_input_is_one_line_error(run_qlm, args, message):
    code, out, err = run_qlm("profile", *args)
    assert code == 2
    assert message in err and err.strip().count("\n") == 0, err


@pytest.mark.parametrize("option,value,choices", [
    ("--recompute", "most", "'none', 'selective', 'full'"),
    ("--cp-comm-type", "ring", "'p2p', 'allgather', 'a2a'"),
    ("--gpu", "v100", "'a100-80g'"),
    ("--pp-schedule", "1F1Bx", "'1f1b', 'gpipe', 'interleaved_1f1b', 'zero_bubble'"),
])
def test_a_choice_outside_the_options_is_refused_by_the_cli(run_qlm, option, value, choices):
    """Options with fixed values are Enums built from the core's own lists: the CLI refuses others, naming them."""
    code, _, err = run_qlm("profile", option, value)
    assert code == 2 and f"'{value}' is not one of" in err and choices in err, err


@pytest.mark.slow
def test_probe_table(run_qlm):
    code, out, err = run_qlm("profile", "--tp", "1", "--cp", "1", "--dp", "1", "--gbs", "2", "--dtype", "fp32",
                             "--probe", "--steps", "2")
    assert code == 0, err
    assert "probe on cpu" in out and "predicted GiB" in out and "total (measured part)" in out


def test_search_reports_a_bad_input_as_itself(run_qlm):
    """A wrong dtype or size is the input's error, not 'no layout passes the trainer's checks'."""
    code, _, stderr = run_qlm("profile", "--search", "--dtype", "fp8", "--num-gpus", "8")
    assert code == 2 and "'fp8' is not one of" in stderr, stderr
    code, _, stderr = run_qlm("profile", "--search", "--seq-len", "0", "--num-gpus", "8")
    assert code == 2 and "seq-len must be >= 1" in stderr, stderr


def test_user_text_is_not_rich_markup(monkeypatch, tmp_path):
    """A model name (a directory's, say) or a plot path with brackets prints as written, not as Rich markup."""
    from qlm_cli.commands import profile as command
    from qlm_cli.render import console
    from qlm_core.profile.memory import Allowance, estimate_memory
    from qlm_core.profile.timing import Efficiency, estimate_time

    case = build_case().replace(model_name="ckpt[/]x [red]y")
    gpu = gpu_spec("a100-80g")
    memory, time = estimate_memory(case, gpu.memory_gib, "cuda", Allowance()), estimate_time(case, gpu, Efficiency())
    with console.capture() as captured:
        command._print_profile(case, gpu, memory, time)
        command._saved(tmp_path / "[bold]plot.png", False)
    out = captured.get()
    assert "ckpt[/]x [red]y on 32 x" in out and "[bold]plot.png" in out


def test_zero_bubble_recomputes_the_chunked_logits_in_both_backward_passes():
    """Under zero-bubble the chunked loss's backward runs twice (dx, then dW), each recomputing the logits: one more
    logits forward of recompute on the last stage than 1F1B; none with a frozen output layer or whole logits."""
    from qlm_core.profile.timing import Efficiency, logits_gemm_seconds, microbatch_times

    gpu, eff = gpu_spec("h100"), Efficiency()
    for lora_rank, chunk, expected in ((0, 2048, 1), (4, 2048, 0), (0, 0, 0)):
        times = {}
        for schedule in ("1f1b", "zero_bubble"):
            case = build_case(tp=4, pp=2, cp=4, pp_schedule=schedule, lora_rank=lora_rank, loss_chunk_tokens=chunk)
            times[schedule] = microbatch_times(case, gpu, eff, case.parallel.pp - 1)["recompute"]
        tokens = case.micro_batch_size * case.seq_len / case.parallel.cp
        extra = expected * tokens * logits_gemm_seconds(case, eff.rates(gpu), gpu.peak_tflops * 1e12)
        assert times["zero_bubble"] - times["1f1b"] == pytest.approx(extra, rel=1e-9, abs=1e-12), (lora_rank, chunk)


def test_scaled_down_chunked_loss_stays_chunked():
    """A chunk just under the rank's tokens would round up to the scaled case's tokens (the whole-logits path)."""
    from qlm_core.parallel.cross_entropy import loss_is_chunked
    from qlm_core.profile.probe import scale_down

    case = build_case()
    tokens = case.micro_batch_size * case.seq_len // case.parallel.cp
    for chunk in (tokens - 1, 1, 0, tokens):
        scaled = scale_down(case.replace(loss_chunk_tokens=chunk))
        scaled_tokens = scaled.micro_batch_size * scaled.seq_len // scaled.parallel.cp
        assert loss_is_chunked(scaled.loss_chunk_tokens, scaled_tokens) == loss_is_chunked(chunk, tokens), chunk
