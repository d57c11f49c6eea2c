"""The seams the next model families and objectives plug into, used from outside: a second attention kind built,
loaded, counted and run through models/attention_kinds.py alone (gpt.py, layout.py and flops.py untouched)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import transformers

from qlm_core.checkpoint.formats.hf.checkpoint import HFCheckpoint
from qlm_core.models.attention_gqa import GQA, GroupedQueryAttention
from qlm_core.models.attention_kinds import ATTENTION_KINDS, attention_kind
from qlm_core.models.flops import flops_per_sequence
from qlm_core.models.gpt import GPTModel
from qlm_core.models.layout import HFTensorSource, ModelLayout, build_shard


class NoRopeAttention(GroupedQueryAttention):
    """A toy second kind: grouped-query attention without rotary positions (cos 1, sin 0 leave q and k as they are)."""

    def forward(self, x, positions, inputs):
        cos, sin = positions
        return super().forward(x, (torch.ones_like(cos), torch.zeros_like(sin)), inputs)


@pytest.fixture
def no_rope(monkeypatch):
    monkeypatch.setitem(ATTENTION_KINDS, "gqa_nope", replace(GQA, module=NoRopeAttention))


def _qlm(path, attention: str) -> GPTModel:
    ckpt = HFCheckpoint(path)
    spec = ckpt.spec.replace(attention=attention)
    layout = ModelLayout(spec)
    model = GPTModel(spec, padded_vocab=layout.padded_vocab)
    model.load_state_dict(build_shard(layout, 0, 0, 0, HFTensorSource(ckpt)), strict=True)
    return model.eval()


def test_a_second_attention_kind_through_the_seam_gives_its_reference_logits(hf_models, no_rope, monkeypatch):
    path = hf_models["qwen2"]
    ids = torch.randint(0, HFCheckpoint(path).spec.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, with_rope = _qlm(path, "gqa_nope")(ids), _qlm(path, "gqa")(ids)
        import transformers.models.qwen2.modeling_qwen2 as qwen2

        monkeypatch.setattr(qwen2, "apply_rotary_pos_emb", lambda q, k, cos, sin, *args, **kwargs: (q, k))
        reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        expected = reference(ids).logits
    assert (ours - expected).abs().max().item() <= 1e-5
    assert (with_rope - expected).abs().max().item() > 1e-3  # the kind, not the default, made the difference


def test_a_second_attention_kind_is_counted_by_its_own_rule(hf_models, monkeypatch):
    """flops.py asks the kind: a kind that costs nothing leaves the MLP and the logits (3x forward per token)."""
    monkeypatch.setitem(ATTENTION_KINDS, "free", replace(GQA, flops_per_token=lambda spec, keys: (0.0, 0.0)))
    spec = HFCheckpoint(hf_models["qwen2"]).spec
    h, f, v, layers, seq = spec.hidden_size, spec.ffn_hidden_size, spec.vocab_size, spec.num_layers, 64
    expected = 3.0 * seq * (layers * 2 * 3 * h * f + 2 * h * v)
    assert flops_per_sequence(spec.replace(attention="free"), seq) == pytest.approx(expected, rel=1e-12)
    assert flops_per_sequence(spec, seq) > expected


def test_an_attention_kind_qlm_does_not_build_is_one_line(hf_models):
    from qlm_core.errors import QlmError

    with pytest.raises(QlmError, match="attention kind 'linear' is not one qlm builds; use one of gqa, mla"):
        attention_kind(replace(HFCheckpoint(hf_models["qwen2"]).spec, attention="linear"))


# ---- a second objective through train/objective.py alone ----------------------------------------------------------

class RowMeanObjective:
    """A toy objective: the mean over rows of each row's mean token loss (a sequence-level average, where next-token
    prediction averages over tokens), written against the Objective protocol only."""

    def bind(self, engine, weights):
        self.rows = engine.global_batch_size

    def start(self, batch, inputs, labels, tokens):
        pass

    def loss(self, token_loss, labels):
        counts = (labels >= 0).sum(-1).clamp(min=1)
        return (token_loss.sum(-1) / counts).sum() / self.rows

    def reported(self, loss):
        return loss.detach().float()

    def figures(self):
        return {"toy/rows": float(self.rows)}


def test_a_second_objective_through_the_seam_trains_what_it_says():
    from parallel_cases import GLOBAL_BATCH, SEQ, SPEC, make_batch

    from qlm_core.config import OptimConfig, ParallelConfig
    from qlm_core.parallel.state import Grid
    from qlm_core.train.engine import Batch, Engine

    batch = Batch(*make_batch("plain"))
    batch.labels[0, : SEQ // 2] = -100  # rows of different lengths: a row mean differs from a token mean
    engine = Engine(SPEC, ParallelConfig(), Grid.single(), micro_batch_size=2, global_batch_size=GLOBAL_BATCH,
                    seq_length=SEQ, optim=OptimConfig(), seed=3, objective=RowMeanObjective())
    with torch.no_grad():  # the same weights, by hand: one process holds the whole model
        model = engine.chunks[0]
        token_loss = model.loss(model(batch.input_ids, batch.position_ids), batch.labels)
        counts = (batch.labels >= 0).sum(-1)
        expected = (token_loss.sum(-1) / counts).mean().item()
        token_mean = (token_loss.sum() / counts.sum()).item()
    result = engine.train_step(batch, lr=1e-3)
    assert result.loss == pytest.approx(expected, rel=1e-6) and abs(expected - token_mean) > 1e-4
    assert result.figures == {"toy/rows": float(GLOBAL_BATCH)}  # the objective's figures reach the step's


# ---- the other per-family choices: norm, MLP activation, position scheme -----------------------------------------

def test_every_choice_a_spec_can_name_is_built_and_profiled():
    """Each Literal of families.py has its row in the module that builds it, and every attention kind has the
    profile's activation terms (a new value without its row would fail at the first model built)."""
    from typing import get_args

    from qlm_core.models import families
    from qlm_core.models.activations import ACTIVATION_KINDS
    from qlm_core.models.norms import NORM_KINDS
    from qlm_core.models.positions import POSITION_KINDS
    from qlm_core.profile.attention_terms import ATTENTION_TERMS

    assert set(get_args(families.AttentionName)) == set(ATTENTION_KINDS) == set(ATTENTION_TERMS)
    assert set(get_args(families.ActivationName)) == set(families.HF_ACTIVATIONS)
    assert set(get_args(families.NormName)) == set(NORM_KINDS)
    assert set(get_args(families.ActivationName)) == set(ACTIVATION_KINDS)
    assert set(get_args(families.PositionName)) == set(POSITION_KINDS)


def test_the_kernels_of_each_choice_are_read_in_one_place():
    """The model, the layout, the profile and the converters build norms, activations and positions only through
    their kind modules: of all qlm_core, only norms.py, activations.py and positions.py import those kernels."""
    import ast
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[2] / "qlm_core"
    assert (root / "models" / "norms.py").is_file()
    owners = {"qlm_core.kernels.norm": {"norms.py"}, "qlm_core.kernels.swiglu": {"activations.py"},
              "qlm_core.kernels.grouped_mlp": {"activations.py", "moe_activations.py"},  # its row padding
              # the attention kinds apply the rotation
              "qlm_core.kernels.rope": {"positions.py", "attention_gqa.py", "attention_mla.py"}}
    seen = set()
    for path in root.rglob("*.py"):
        if path.parent.name == "kernels":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            modules = ([node.module] if isinstance(node, ast.ImportFrom) and node.module
                       else [alias.name for alias in node.names] if isinstance(node, ast.Import) else [])
            for module in modules:
                if module in owners:
                    seen.add(module)
                    assert path.name in owners[module], f"{path.relative_to(root)} imports {module}"
    assert seen == set(owners)


class ToyLayerNorm(torch.nn.LayerNorm):
    """A norm with two tensors (weight and bias), built by the seam's signature (size, eps, dtype)."""

    def __init__(self, size, eps, dtype):
        super().__init__(size, eps=eps, dtype=dtype)


def test_a_second_norm_through_the_seam_is_built_laid_out_and_counted(hf_models, monkeypatch):
    """A norm kind with a bias: every norm of the model (the layers', the final one, Qwen3's q/k norms) is that
    module, the layout names each of its tensors, and the parameter count follows; gpt.py and layout.py untouched."""
    from qlm_core.models.norms import NORM_KINDS, NormKind
    from qlm_core.models.parameters import num_parameters

    monkeypatch.setitem(NORM_KINDS, "toy_layernorm", NormKind(ToyLayerNorm, ("weight", "bias"), "LayerNorm", 1.0,
                                                                      lambda e, size: 2 * e * size))
    spec = HFCheckpoint(hf_models["qwen2"]).spec.replace(norm="toy_layernorm", qk_layernorm=True)
    layout = ModelLayout(spec)
    model = GPTModel(spec, padded_vocab=layout.padded_vocab)
    norms = [m for m in model.modules() if isinstance(m, ToyLayerNorm)]
    assert len(norms) == 4 * spec.num_layers + 1  # two a layer, q and k norms, the final norm
    laid_out = {name for name, tensor in layout.shard_entries(0) if tensor is not None}
    assert laid_out == {name for name in model.state_dict() if not name.endswith("._extra_state")}
    assert "decoder.final_layernorm.bias" in laid_out and "decoder.layers.0.self_attention.k_layernorm.bias" in laid_out
    unpadded = GPTModel(spec, padded_vocab=spec.vocab_size)
    assert num_parameters(spec) == sum(p.numel() for p in unpadded.parameters())


# ---- a new checkpoint format through checkpoint/sources/ alone --------------------------------------------------

def _toy_format():
    """A toy format: an HF model kept in DIR/model/ with a marker DIR/toy.json; reads and writes by HF's object."""
    from qlm_core.checkpoint.sources.format_api import CheckpointFormat
    from qlm_core.checkpoint.sources.hf_format import HF_FORMAT

    def sniff(path):
        return (path / "toy.json").is_file()

    def open_toy(path, options):
        opened = HF_FORMAT.open(path / "model", options)
        opened.format, opened.description = "toy", f"toy checkpoint {path}"
        return opened

    def write(out, layout, weights, dtype, options, progress):
        (out / "model").mkdir()
        HF_FORMAT.write(out / "model", layout, weights, dtype, options, progress)
        (out / "toy.json").write_text("{}")

    def reopen(out, layout, dtype, options):
        return HF_FORMAT.reopen(out / "model", layout, dtype, options)

    return CheckpointFormat("toy", sniff, open_toy, write, reopen, side_folder="model", hf_logits=False)


def test_a_new_format_is_opened_by_every_verb_and_written_by_the_one_conversion(hf_models, tmp_path, monkeypatch):
    """Registered in registry.FORMATS alone: open_checkpoint (train's model.load, eval, generate) reads it, and the
    conversion skeleton writes it from an HF model and verifies it, tensors and logits, then reads it back."""
    import time

    from qlm_core.checkpoint.convert.skeleton import convert_opened
    from qlm_core.checkpoint.sources import registry
    from qlm_core.checkpoint.sources.format_api import ReadOptions, WriteOptions
    from qlm_core.checkpoint.sources.hf_format import HF_FORMAT
    from qlm_core.checkpoint.sources.open import open_checkpoint

    toy = _toy_format()
    monkeypatch.setitem(registry.FORMATS, "toy", toy)
    source = HF_FORMAT.open(hf_models["qwen2"], ReadOptions())
    result = convert_opened(source, tmp_path / "toy", toy, source.layout, torch.float32, WriteOptions(),
                            started=time.perf_counter(), verify=True)
    assert result.verify is not None and result.verify.ok and result.verify.tensors_checked > 0
    opened = open_checkpoint(tmp_path / "toy")
    assert opened.description == f"toy checkpoint {tmp_path / 'toy'}"
    assert (tmp_path / "toy" / "model" / "config.json").is_file()  # its side folder got the config
    ids = torch.arange(12)[None]
    layout = ModelLayout(opened.spec)
    model = GPTModel(opened.spec, padded_vocab=layout.padded_vocab)
    model.load_state_dict(build_shard(layout, 0, 0, 0, opened.weights), strict=False)
    original = _qlm(hf_models["qwen2"], "gqa")
    with torch.no_grad():
        assert torch.equal(model.eval()(ids), original(ids))


def _gelu(x):
    return torch.nn.functional.gelu(x, approximate="tanh")


def test_a_plain_activation_through_the_seam_is_built_laid_out_counted_and_timed(hf_models, monkeypatch):
    """An activation without a gate (linear_fc1 = up only, f rows split by rows): the MLP's shapes, the layout's
    names and shard rule, the parameter and FLOP counts and the profile's GEMM shapes follow the kind alone."""
    from qlm_core.models.activations import ACTIVATION_KINDS, ActivationKind
    from qlm_core.models.flops import layer_flops_per_token
    from qlm_core.models.parameters import num_parameters
    from qlm_core.models.tensor_layout import ROWS

    monkeypatch.setitem(ACTIVATION_KINDS, "toy_gelu", ActivationKind(_gelu, gated=False, grouped_mlp=None,
                                                                    megatron_args=(("swiglu", False),)))
    spec = HFCheckpoint(hf_models["qwen2"]).spec
    plain = spec.replace(activation="toy_gelu")
    model = GPTModel(plain, padded_vocab=plain.vocab_size)
    assert model.decoder.layers[0].mlp.linear_fc1.weight.shape == (spec.ffn_hidden_size, spec.hidden_size)
    layout = ModelLayout(plain)
    fc1 = dict(layout.layer_entries(0))["mlp.linear_fc1.weight"]
    assert fc1.split == ROWS and [seg.hf_name for seg in fc1.segments] == ["model.layers.0.mlp.up_proj.weight"]
    assert num_parameters(plain) == sum(p.numel() for p in model.parameters())
    h, f = spec.hidden_size, spec.ffn_hidden_size
    dense, _ = layer_flops_per_token(spec, 64)
    assert dense - layer_flops_per_token(plain, 64)[0] == 2 * h * f  # one h x f matrix fewer
    x = torch.randn(5, 1, h)
    with torch.no_grad():
        mlp = model.decoder.layers[0].mlp
        assert torch.equal(mlp(x), mlp.linear_fc2(_gelu(mlp.linear_fc1(x))))
