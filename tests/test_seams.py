"""The seams the next model families and objectives plug into, used from outside: a second attention kind built,
loaded, counted and run through models/attention_kinds.py alone (gpt.py, layout.py and flops.py untouched)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import transformers

from qlm_core.checkpoint.formats.hf import HFCheckpoint
from qlm_core.models.attention_gqa import GQA, GroupedQueryAttention
from qlm_core.models.attention_kinds import ATTENTION_KINDS, attention_kind
from qlm_core.models.flops import flops_per_sequence
from qlm_core.models.gpt import GPTModel
from qlm_core.models.layout import HFTensorSource, ModelLayout, build_shard


class NoRopeAttention(GroupedQueryAttention):
    """A toy second kind: grouped-query attention without rotary positions (cos 1, sin 0 leave q and k as they are)."""

    def forward(self, x, cos, sin, inputs):
        return super().forward(x, torch.ones_like(cos), torch.zeros_like(sin), inputs)


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

    with pytest.raises(QlmError, match="attention kind 'mla' is not one qlm builds; use one of gqa"):
        attention_kind(HFCheckpoint(hf_models["qwen2"]).spec.replace(attention="mla"))


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
