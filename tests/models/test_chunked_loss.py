"""The chunked loss head (parallel/cross_entropy.py, GPTModel.loss) gives the whole-logits path's loss and gradients
within fp32 rounding: one process (ignored labels, a chunk that does not divide the tokens, padding columns, tied
embeddings, a frozen output layer under LoRA, zero-bubble's split backward), bf16 against an fp64 reference, and in
one torchrun launch (4 gloo ranks) TP2 ± SP on the loss head itself and the Engine under TP2+SP, PP2 (1F1B,
zero-bubble, tied embeddings), TP2·PP2·SP, CP2 (p2p, a2a), TP2·CP2·SP, ZeRO-1 with overlapped parameter gather and
ZeRO-3; then through `qlm train` at PP2; and the recipe key's checks."""


import pytest
import torch
import torch.nn.functional as F
from conftest import run_worker_jobs
from helpers import RECIPE, losses, qlm_train
from parallel_cases import GLOBAL_BATCH, SPEC
from torch.utils._python_dispatch import TorchDispatchMode
from workers.chunked_loss_worker import ENGINE_CASES, HEAD_CASES, STEPS, counting_backward_passes

from qlm_core.config import LoraConfig, Recipe, TrainConfig, load_recipe, recipe_to_toml
from qlm_core.errors import QlmError
from qlm_core.models.gpt import GPTModel
from qlm_core.models.stage import StageModel
from qlm_core.parallel import cross_entropy
from qlm_core.parallel.cross_entropy import DEFAULT_CHUNK_TOKENS, chunked_vocab_parallel_cross_entropy
from qlm_core.parallel.tensor import vocab_parallel_cross_entropy
from qlm_core.train.lora import apply_lora
from qlm_core.train.validate import validate_recipe

TOL = 1e-6  # relative (L2) error allowed in fp32
SEQ, BATCH, CHUNK = 50, 3, 37  # 150 tokens: chunks of 37, 37, 37, 37 and 2


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def relative_or_zero(a: torch.Tensor, b: torch.Tensor) -> float:
    """relative, 0 where both are zero (a rank's gradient of a tensor it does not use)."""
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _labels(generator: torch.Generator, vocab: int = SPEC.vocab_size) -> torch.Tensor:
    labels = torch.randint(0, vocab, (BATCH, SEQ), generator=generator)
    labels[:, :7] = -100
    labels[1, 20:31] = -100
    return labels


def test_function_equals_whole_logits_cross_entropy():
    """x [s, b, h] and W [V_padded, h] as leaves, an uneven incoming gradient, padding rows of W that would change
    the loss if they were not excluded."""
    generator = torch.Generator().manual_seed(0)
    padded = 384
    x0 = torch.randn(SEQ, BATCH, SPEC.hidden_size, generator=generator)
    w0 = torch.randn(padded, SPEC.hidden_size, generator=generator) * 0.2
    labels = _labels(generator)
    scale = torch.rand(BATCH, SEQ, generator=generator)

    def whole():
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(F.linear(x, w), labels.clamp(min=0).t(), None, SPEC.vocab_size).t()
        loss = loss * (labels >= 0)
        (loss * scale).sum().backward()
        return loss.detach(), x.grad, w.grad

    def chunked(chunk):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        loss = chunked_vocab_parallel_cross_entropy(x, w, labels, None, SPEC.vocab_size, chunk)
        (loss * scale).sum().backward()
        return loss.detach(), x.grad, w.grad

    reference = whole()
    unpadded = F.cross_entropy(F.linear(x0, w0[: SPEC.vocab_size]).transpose(0, 1).reshape(-1, SPEC.vocab_size),
                               labels.reshape(-1), reduction="none").view(BATCH, SEQ)
    assert relative(reference[0], unpadded) <= TOL
    for chunk in (1, CHUNK, BATCH * SEQ, 4096):
        loss, x_grad, w_grad = chunked(chunk)
        assert relative(loss, reference[0]) <= TOL, chunk
        assert loss[labels < 0].abs().max() == 0
        assert relative(x_grad, reference[1]) <= TOL, chunk
        assert relative(w_grad, reference[2]) <= TOL, chunk
        assert w_grad[SPEC.vocab_size:].abs().max() == 0  # padding rows get no gradient


def _counting_backward(monkeypatch) -> list[tuple[bool, bool]]:
    """(dx computed, dW computed) of each run of the chunked loss's backward."""
    passes = []
    counting_backward_passes(passes, monkeypatch.setattr)
    return passes


def test_split_backward_computes_each_gradient_once(monkeypatch):
    """torch's zero-bubble passes (stage_backward_input, then stage_backward_weight) each run the loss's backward:
    the input pass computes dx only, the weight pass dW only; the gradients are those of one plain backward."""
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    generator = torch.Generator().manual_seed(7)
    x0 = torch.randn(SEQ, BATCH, SPEC.hidden_size, generator=generator)
    w_in = torch.nn.Parameter(torch.randn(SPEC.hidden_size, SPEC.hidden_size, generator=generator) * 0.2)
    w_out = torch.nn.Parameter(torch.randn(384, SPEC.hidden_size, generator=generator) * 0.2)
    labels = _labels(generator)
    passes = _counting_backward(monkeypatch)

    def loss_of(x):
        return chunked_vocab_parallel_cross_entropy(F.linear(x, w_in), w_out, labels, None, SPEC.vocab_size,
                                                    CHUNK).sum()

    x = x0.clone().requires_grad_()
    loss_of(x).backward()
    reference = x.grad, w_in.grad, w_out.grad
    assert passes == [(True, True)]
    passes.clear()
    w_in.grad = w_out.grad = None
    x = x0.clone().requires_grad_()
    _, param_groups = stage_backward_input([loss_of(x)], None, [x], iter([w_in, w_out]))
    assert passes == [(True, False)] and w_out.grad is None
    stage_backward_weight(iter([w_in, w_out]), param_groups)
    assert passes == [(True, False), (False, True)]
    for got, expected in zip((x.grad, w_in.grad, w_out.grad), reference, strict=True):
        assert relative(got, expected) <= TOL
    passes.clear()
    grad_x, = torch.autograd.grad(loss_of(x0.clone().requires_grad_()), (w_in,))  # a leaf that autograd.grad captures
    assert passes == [(True, False)] and relative(grad_x, reference[1]) <= TOL


class _CreatedTensors(TorchDispatchMode):
    """(shape, dtype) of every tensor that an op returns while active."""

    def __enter__(self):
        self.seen = set()
        super().__enter__()
        return self.seen

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(tensor, torch.Tensor):
                self.seen.add((tuple(tensor.shape), tensor.dtype))
        return out


def test_bf16_error_against_fp64_like_the_whole_logits():
    """In bf16 the chunked loss (dW accumulated in bf16, as the whole-logits path's matmul produces it) stays within
    1.5x the whole-logits path's error against an fp64 reference, for the loss, dx and dW."""
    generator = torch.Generator().manual_seed(8)
    seq, batch, vocab, padded, h = 256, 2, 1000, 1024, 64
    x0 = torch.randn(seq, batch, h, generator=generator, dtype=torch.float64)
    w0 = torch.randn(padded, h, generator=generator, dtype=torch.float64) * 0.3
    labels = torch.randint(0, vocab, (batch, seq), generator=generator)
    scale = torch.rand(batch, seq, generator=generator, dtype=torch.float64)

    def run(dtype, chunk):
        x = x0.to(dtype, copy=True).requires_grad_()
        w = w0.to(dtype, copy=True).requires_grad_()
        if chunk:
            loss = chunked_vocab_parallel_cross_entropy(x, w, labels, None, vocab, chunk)
        else:
            loss = vocab_parallel_cross_entropy(F.linear(x, w), labels.t(), None, vocab).t()
        (loss.double() * scale).sum().backward()
        return loss.detach(), x.grad, w.grad

    reference = run(torch.float64, 0)
    whole = run(torch.bfloat16, 0)
    with _CreatedTensors() as created:
        chunked = run(torch.bfloat16, 100)
    assert chunked[2].dtype == torch.bfloat16
    assert ((padded, h), torch.float32) not in created  # no fp32 accumulator the size of W
    for name, got, base, exact in zip(("loss", "dx", "dW"), chunked, whole, reference, strict=True):
        error, baseline = relative(got, exact), relative(base, exact)
        assert 0 < baseline < 0.05 and error <= 1.5 * baseline, (name, error, baseline)


def _model(chunk: int, spec=SPEC, cls=GPTModel) -> GPTModel:
    torch.manual_seed(0)
    return cls(spec, num_layers=2, loss_chunk_tokens=chunk)


def _grads(model: GPTModel, labels: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, dict]:
    loss = model(ids, labels=labels)
    loss.sum().backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_model_loss_chunked_equals_whole(tied):
    spec = SPEC.replace(tie_word_embeddings=tied)
    generator = torch.Generator().manual_seed(1)
    ids, labels = torch.randint(0, spec.vocab_size, (BATCH, SEQ), generator=generator), _labels(generator)
    whole_loss, whole = _grads(_model(0, spec), labels, ids)
    chunked_loss, chunked = _grads(_model(CHUNK, spec), labels, ids)
    assert relative(chunked_loss, whole_loss) <= TOL
    assert set(chunked) == set(whole) and ("output_layer.weight" in whole) != tied
    for name in whole:
        assert relative(chunked[name], whole[name]) <= TOL, name


def test_small_runs_take_the_whole_logits_path_bit_for_bit():
    """Tokens <= the chunk: GPTModel.loss is the output layer + token_loss, exactly."""
    generator = torch.Generator().manual_seed(2)
    model = _model(BATCH * SEQ)
    hidden = torch.randn(SEQ, BATCH, SPEC.hidden_size, generator=generator)
    labels = _labels(generator)
    expected = model.token_loss(model.output_layer(hidden, model.output_weight()), labels)
    loss = model.loss(hidden, labels)
    assert torch.equal(loss, expected) and "_ChunkedVocabParallelCrossEntropyBackward" not in _graph(loss)
    assert "_ChunkedVocabParallelCrossEntropyBackward" in _graph(_model(BATCH * SEQ - 1).loss(hidden, labels))


def test_chunked_loss_runs_as_an_output_layer_call():
    """Forward pre-hooks on the output layer (the distributed optimizer waits there for an overlapped parameter
    all-gather) run before the chunked loss reads the weight."""
    model, calls = _model(CHUNK), []
    model.output_layer.register_forward_pre_hook(lambda module, args, kwargs: calls.append(kwargs.get("labels")),
                                                 with_kwargs=True)
    ids = torch.randint(0, SPEC.vocab_size, (BATCH, SEQ))
    model(ids, labels=ids)
    assert len(calls) == 1 and calls[0] is ids


def _graph(tensor: torch.Tensor) -> set[str]:
    """Names of the autograd nodes behind `tensor`."""
    names, todo = set(), [tensor.grad_fn]
    while todo:
        node = todo.pop()
        if node is not None and type(node).__name__ not in names:
            names.add(type(node).__name__)
            todo.extend(next_node for next_node, _ in node.next_functions)
    return names


def test_frozen_output_layer_under_lora():
    """LoRA freezes the output weight: no gradient reaches it, and the adapters' gradients are unchanged."""
    generator = torch.Generator().manual_seed(4)
    ids, labels = torch.randint(0, SPEC.vocab_size, (BATCH, SEQ), generator=generator), _labels(generator)
    results = []
    for chunk in (0, CHUNK):
        model = _model(chunk)
        apply_lora([model], LoraConfig(rank=4), model.parallel, seed=5)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("lora_B.weight"):  # B starts at zero; make A's gradient non-zero too
                    param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(6)) * 0.1)
        results.append(_grads(model, labels, ids))
        assert model.output_layer.weight.grad is None
    (whole_loss, whole), (chunked_loss, chunked) = results
    assert relative(chunked_loss, whole_loss) <= TOL
    assert set(chunked) == set(whole) and all("lora_" in name for name in whole) and len(whole) == 16
    for name in whole:
        assert relative(chunked[name], whole[name]) <= TOL, name


def test_last_pipeline_stage_returns_the_final_norm_output():
    model = _model(CHUNK, cls=StageModel)
    ids = torch.randint(0, SPEC.vocab_size, (BATCH, SEQ))
    hidden = model(ids, torch.arange(SEQ)[None].expand(BATCH, SEQ))
    assert hidden.shape == (SEQ, BATCH, SPEC.hidden_size)
    assert model.loss(hidden, ids).shape == (BATCH, SEQ)
    assert _model(CHUNK)(ids).shape == (BATCH, SEQ, SPEC.vocab_size)  # a plain GPTModel still returns logits


# ---- multi-rank ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def worker_run(tmp_path_factory):
    return run_worker_jobs("chunked_loss_worker.py", 4, tmp_path_factory.mktemp("chunked-loss"), timeout=600)


@pytest.mark.distributed
@pytest.mark.parametrize("case", HEAD_CASES)
def test_vocab_parallel_loss_head(case, worker_run):
    out, code, errors = worker_run
    files = sorted((out / "head").glob(f"{case}.rank*.pt")) if (out / "head").exists() else []
    assert len(files) == HEAD_CASES[case].tp, f"worker exit {code}: {errors}"
    for file in files:
        result = torch.load(file, weights_only=True)
        whole, chunked = result["whole"], result["chunked"]
        assert chunked["loss"][result["labels"] < 0].abs().max().item() == 0, file.name
        for key in ("loss", "input_grad", "weight_grad"):
            error = relative_or_zero(chunked[key], whole[key])
            assert error <= TOL, (file.name, key, error)


@pytest.mark.distributed
@pytest.mark.parametrize("case", ENGINE_CASES)
def test_engine_losses_and_gradients(case, worker_run):
    out, code, errors = worker_run
    files = sorted((out / "engine").glob(f"{case}.rank*.pt")) if (out / "engine").exists() else []
    engine_case = ENGINE_CASES[case]
    assert len(files) == engine_case.world, f"worker exit {code}: {errors}"
    for file in files:
        result = torch.load(file, weights_only=True)
        whole, chunked = result["whole"], result["chunked"]
        assert chunked["losses"] == pytest.approx(whole["losses"], rel=TOL), file.name
        assert set(chunked["grads"]) == set(whole["grads"]), file.name
        grad_errors = {key: relative_or_zero(chunked["grads"][key], whole["grads"][key]) for key in whole["grads"]}
        worst = max(grad_errors, key=grad_errors.get)
        assert grad_errors[worst] <= TOL, (file.name, worst, grad_errors[worst])
        calls = result["chunked_calls"]  # (micro-batches x steps) on the last stage, and only with chunks
        assert calls["whole"] == 0 and (calls["chunked"] > 0) == result["last_stage"], (file.name, calls)
        config = engine_case.config
        micro = STEPS * GLOBAL_BATCH * config.tp * config.pp * config.cp // (
            engine_case.world * engine_case.micro_batch_size) if result["last_stage"] else 0
        # torch's pipeline stage infers the input gradients' metadata once, with an extra forward and a dx-only
        # backward (autograd.grad for the inputs) of the first micro-batch
        inference = 1 if config.pp > 1 and result["last_stage"] else 0
        assert calls["chunked"] == micro + inference, (file.name, calls, micro)
        split = config.pp_schedule == "zero_bubble"  # dx and dW in separate passes, each computed once
        expected = {"passes": (2 if split else 1) * micro + inference, "dx": micro + inference, "dw": micro}
        assert result["chunked_backward"] == expected, (file.name, result["chunked_backward"], expected)


@pytest.mark.slow
def test_qlm_train_hands_the_chunk_to_the_model(run_qlm, tmp_path, monkeypatch):
    """train.loss_chunk_tokens reaches the loss head through the Trainer and the Engine (one process, in place)."""
    chunks = []
    original = cross_entropy.chunked_vocab_parallel_cross_entropy
    monkeypatch.setattr(cross_entropy, "chunked_vocab_parallel_cross_entropy",
                        lambda *args: chunks.append(args[5]) or original(*args))
    code, _, err = run_qlm("train", RECIPE, "--output", tmp_path / "run", "--set", f"data.cache_dir={tmp_path!s}",
                           "--set", "train.loss_chunk_tokens=40", "--set", "train.train_iters=1")
    assert code == 0, err
    assert chunks and set(chunks) == {40}


@pytest.mark.distributed
def test_qlm_train_pp2_same_losses_chunked_or_not(tmp_path):
    """128 tokens per micro-batch in chunks of 40 (the last one 8) against the whole logits, through the CLI."""
    runs = {}
    for chunk in (0, 40):
        runs[chunk] = tmp_path / f"chunk{chunk}"
        qlm_train(RECIPE, "--output", runs[chunk], "--set", f"data.cache_dir={tmp_path / 'cache'!s}",
                  "--set", "parallel.pp=2", "--set", f"train.loss_chunk_tokens={chunk}", "--set", "train.train_iters=4")
    assert losses(runs[40]) == pytest.approx(losses(runs[0]), rel=TOL)
    assert "loss_chunk_tokens = 40" in (runs[40] / "config.toml").read_text()


# ---- the recipe key --------------------------------------------------------------------------------------------


def test_recipe_key_default_and_check(tmp_path):
    assert TrainConfig().loss_chunk_tokens == DEFAULT_CHUNK_TOKENS == 2048
    assert "loss_chunk_tokens = 2048" in recipe_to_toml(Recipe())
    recipe = load_recipe(None, ["train.loss_chunk_tokens=0"])
    validate_recipe(recipe)
    recipe.train.loss_chunk_tokens = -1
    with pytest.raises(QlmError, match=r"train.loss_chunk_tokens must be >= 0, got -1; set it"):
        validate_recipe(recipe)
    with pytest.raises(ValueError, match="loss_chunk_tokens"):
        GPTModel(SPEC, num_layers=1, loss_chunk_tokens=-1)


def test_negative_chunk_is_a_one_line_error(run_qlm):
    code, _, err = run_qlm("train", RECIPE, "--set", "train.loss_chunk_tokens=-8", "--dry-run")
    assert code == 2 and "train.loss_chunk_tokens must be >= 0" in err and err.strip().count("\n") == 0, err
    code, _, err = run_qlm("profile", "--loss-chunk-tokens", "-8")
    assert code == 2 and "loss-chunk-tokens must be >= 0" in err and err.strip().count("\n") == 0, err
