"""Aux-loss-free balancing (moe.router_expert_bias, sigmoid routing): the routing and the bias update equal
megatron-core's functions, the bias stays fp32 in a bf16 model, each routed choice is counted once (not again when
recompute re-runs a layer), fᵢ of the aux loss counts the unbiased choices as Megatron's does, and the recipe's
router choices get one-line errors where they cannot apply."""

import dataclasses
import warnings

import pytest
import torch
from parallel_cases import GLOBAL_BATCH, MOE, SEQ, make_batch

from qlm_core.config import LoraConfig, ModelConfig, MoeConfig, ParallelConfig
from qlm_core.errors import QlmError
from qlm_core.models.gpt import ParallelOptions
from qlm_core.models.moe import MoELayer, MoeTracker, route, updated_expert_bias
from qlm_core.models.moe_spec import MoeSpec
from qlm_core.parallel.state import Grid
from qlm_core.train.engine import Batch, Engine
from qlm_core.train.sources import with_recipe_router

BIASED = MOE.replace(moe=dataclasses.replace(MOE.moe, score_function="sigmoid", expert_bias=True))
RATE = 0.01


def megatron_moe_utils():
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install '.[test]')")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.transformer.moe import moe_utils
    return moe_utils


@pytest.mark.peer
def test_biased_routing_is_megatrons():
    moe_utils = megatron_moe_utils()
    torch.manual_seed(0)
    logits, bias = torch.randn(64, 8), torch.randn(8) * 0.3
    spec = MoeSpec(num_experts=8, topk=3, ffn_hidden_size=4, score_function="sigmoid", expert_bias=True)
    probs, indices = route(logits, spec, bias)
    their_probs, their_map = moe_utils.topk_routing_with_score_function(logits, 3, score_function="sigmoid",
                                                                         expert_bias=bias)
    ours = torch.zeros_like(logits).scatter(1, indices, probs)
    assert torch.equal(their_map, ours > 0)
    torch.testing.assert_close(ours, their_probs, rtol=1e-6, atol=1e-7)
    assert not torch.equal(indices.sort(-1).values, route(logits, spec)[1].sort(-1).values)  # the bias mattered


@pytest.mark.peer
def test_the_bias_update_is_megatrons(monkeypatch):
    moe_utils = megatron_moe_utils()
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda tensor, group=None: None)  # one rank
    monkeypatch.setattr(moe_utils.parallel_state, "get_tensor_and_data_parallel_group", lambda **_: None)
    counts = torch.tensor([[5.0, 3.0, 4.0, 4.0], [1.0, 7.0, 4.0, 4.0]])
    bias = torch.tensor([[0.1, -0.2, 0.0, 0.3], [0.0, 0.0, 0.0, 0.0]])
    theirs = moe_utils.get_updated_expert_bias(counts.clone(), bias, RATE)
    assert torch.equal(updated_expert_bias(counts, bias, RATE), theirs)


def engine(config: ParallelConfig, moe: MoeConfig, dtype=torch.float32, lora=None) -> Engine:
    return Engine(BIASED, config, Grid.single(), micro_batch_size=2, global_batch_size=GLOBAL_BATCH,
                  seq_length=SEQ, moe=moe, dtype=dtype, lora=lora)


def routers(e: Engine):
    return [layer.mlp.router for layer in e.chunks[0].decoder.layers if isinstance(layer.mlp, MoELayer)]


def test_the_bias_is_fp32_in_a_bf16_model_and_saved():
    e = engine(ParallelConfig(), MoeConfig(router_bias_update_rate=RATE), dtype=torch.bfloat16)
    input_ids, labels, _, _ = make_batch("plain")
    e.train_step(Batch(input_ids, labels))
    router = routers(e)[0]
    assert router.weight.dtype == torch.bfloat16 and router.expert_bias.dtype == torch.float32
    assert router.expert_bias.abs().max().item() == pytest.approx(RATE)  # moved by one step
    router.to(torch.bfloat16)  # e.g. a model cast to its checkpoint's dtype: the bias keeps its values
    assert router.expert_bias.dtype == torch.float32
    state = e.chunks[0].state_dict()
    assert "decoder.layers.0.mlp.router.expert_bias" in state
    assert not any("local_tokens_per_expert" in name for name in state)


@pytest.mark.parametrize("recompute", ["none", "full", "selective"])
def test_each_routed_choice_counts_once(recompute, monkeypatch):
    """Under recompute the layers run twice; the counts the update sees are one forward's: tokens · top-k."""
    modules = ["mlp"] if recompute == "selective" else ["core_attn"]
    e = engine(ParallelConfig(recompute=recompute, recompute_modules=modules), MoeConfig(router_bias_update_rate=RATE))
    seen = []
    real = e._update_expert_bias
    monkeypatch.setattr(e, "_update_expert_bias",
                        lambda: (seen.extend(r.local_tokens_per_expert.sum().item() for r in routers(e)), real()))
    input_ids, labels, _, _ = make_batch("plain")
    e.train_step(Batch(input_ids, labels))
    assert seen == [GLOBAL_BATCH * SEQ * BIASED.moe.topk] * len(routers(e))
    assert all(r.local_tokens_per_expert.sum() == 0 for r in routers(e))  # reset for the next step


def test_the_aux_loss_counts_the_unbiased_choices():
    """Megatron-Core's aux loss takes fᵢ from the top k of the scores without the bias: a bias that sends every
    token to experts 0 and 1 leaves the aux loss as it was, and moves the recorded load."""
    torch.manual_seed(0)
    layer = MoELayer(16, BIASED.moe, ParallelOptions(), MoeConfig(aux_loss_coeff=0.01), MoeTracker(), 0,
                     torch.float32)
    for param in layer.parameters():
        torch.nn.init.normal_(param, std=0.5)
    x = torch.randn(8, 2, 16, requires_grad=True)
    layer(x)
    plain = layer.tracker.take_records()[-1]
    layer.router.expert_bias.copy_(torch.tensor([10.0, 10.0, 0.0, 0.0]))
    layer(x)
    biased = layer.tracker.take_records()[-1]
    assert biased.aux_loss.item() == pytest.approx(plain.aux_loss.item(), rel=1e-6)
    assert biased.tokens_per_expert.tolist() == [16.0, 16.0, 0.0, 0.0]
    assert plain.tokens_per_expert.tolist() != biased.tokens_per_expert.tolist()


def test_a_bias_needs_sigmoid_routing():
    with pytest.raises(QlmError, match="sigmoid routing only"):
        with_recipe_router(MOE, MoeConfig(router_expert_bias=True), loaded=False)
    ernie = MOE.replace(model_type="ernie4_5_moe", moe=dataclasses.replace(MOE.moe, expert_bias=True))
    assert with_recipe_router(ernie, MoeConfig(router_expert_bias=True), loaded=False) == ernie  # its own router
    spec = with_recipe_router(MOE, MoeConfig(router_score_function="sigmoid", router_expert_bias=True), loaded=False)
    assert (spec.moe.score_function, spec.moe.expert_bias) == ("sigmoid", True)
    assert with_recipe_router(MOE.replace(moe=None, model_type="qwen3"), MoeConfig(router_expert_bias=True),
                              loaded=False).moe is None  # a dense model ignores [moe]


def test_a_loaded_models_router_cannot_change():
    with pytest.raises(QlmError, match="model.load's router has score_function = softmax"):
        with_recipe_router(MOE, MoeConfig(router_score_function="sigmoid"), loaded=True)
    assert with_recipe_router(MOE, MoeConfig(router_score_function="softmax"), loaded=True) is MOE


def test_lora_keeps_the_bias_still():
    lora = LoraConfig(rank=4, target_modules=["linear_qkv"])
    with pytest.raises(QlmError, match="router_bias_update_rate with LoRA"):
        engine(ParallelConfig(), MoeConfig(router_bias_update_rate=RATE), lora=lora)
    engine(ParallelConfig(), MoeConfig(router_bias_update_rate=0.0), lora=lora)


def test_the_recipe_router_reaches_the_run(tmp_path):
    from qlm_core.train.sources import resolve_model

    source = resolve_model(ModelConfig(spec="qlm-tiny-moe"),
                           MoeConfig(router_score_function="sigmoid", router_expert_bias=True))
    assert source.spec.moe.expert_bias


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_mcore2mcore_carries_the_biases_bit_exact_in_fp32(tmp_path, fmt):
    """A bf16 checkpoint whose routers hold fp32 expert biases, resharded to tp2 x ep2 (and to the other format):
    every bias is the source's, bit for bit, still fp32."""
    from qlm_core.checkpoint.convert.hf_megatron import mcore_to_mcore
    from qlm_core.checkpoint.formats.megatron.args import make_args
    from qlm_core.checkpoint.formats.megatron.format import open_megatron
    from qlm_core.checkpoint.formats.megatron.write import write_megatron
    from qlm_core.checkpoint.io.progress import no_progress
    from qlm_core.checkpoint.sources.random_init import RandomInitSource
    from qlm_core.models.layout import ModelLayout, read_range

    layout = ModelLayout(BIASED)

    class Biased(RandomInitSource):
        def read_into(self, tensor, start, stop, out):
            if tensor.buffer:
                out.copy_((torch.arange(stop - start) + start) * 1.0e-3 + 1.0e-7)  # below bf16's resolution
            else:
                super().read_into(tensor, start, stop, out)

    source = Biased(layout)
    write_megatron("torch", tmp_path / "src", layout, source, torch.bfloat16,
                   make_args(layout, torch.bfloat16, ckpt_format="torch"), None, no_progress)
    mcore_to_mcore(tmp_path / "src", tmp_path / "out", tp=2, ep=2, etp=1, format=fmt, verify=False)
    written = open_megatron(tmp_path / "out")
    biases = [t for t in written.layout.global_tensors if t.buffer]
    assert len(biases) == 3
    for tensor in biases:
        got = read_range(written, tensor, 0, tensor.shape[0])
        assert got.dtype == torch.float32
        assert torch.equal(got, read_range(source, tensor, 0, tensor.shape[0]))
