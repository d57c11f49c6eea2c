"""The MoE layer's load-balancing losses equal megatron-core's own functions on the same router logits: the
micro-batch loss (aux_loss), the sequence-wise one (seq_aux_loss, moe.aux_loss_type = "sequence"), which
megatron-core computes by treating each (row, expert) pair as an expert of a [seq, rows * E] problem, and the
global-batch one (global_aux_loss, "global"): the counts averaged over the step's micro-batches so far."""

import warnings

import pytest
import torch

from qlm_core.config import MoeConfig
from qlm_core.models.gpt import ParallelOptions
from qlm_core.models.moe import MoELayer, MoeTracker, aux_loss_scores, route
from qlm_core.models.moe_spec import MoeSpec

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install '.[test]')")
pytestmark = pytest.mark.peer

SEQ, ROWS, HIDDEN, COEFF = 12, 3, 16, 0.01
MOE = MoeSpec(num_experts=4, topk=2, ffn_hidden_size=8)


def megatron_switch_loss(*args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.transformer.moe.moe_utils import switch_load_balancing_loss_func
    return switch_load_balancing_loss_func(*args, **kwargs)


def make_layer(aux_loss_type: str) -> MoELayer:
    torch.manual_seed(0)
    layer = MoELayer(HIDDEN, MOE, ParallelOptions(), MoeConfig(aux_loss_coeff=COEFF, aux_loss_type=aux_loss_type),
                     MoeTracker(), 0, torch.float32)
    for param in layer.parameters():
        torch.nn.init.normal_(param, std=0.5)
    return layer


def forward_loss(layer: MoELayer) -> tuple[torch.Tensor, torch.Tensor]:
    """The aux loss one forward of `layer` records (a fresh input), and the router logits it came from."""
    x = torch.randn(SEQ, ROWS, HIDDEN, requires_grad=True)
    layer(x)
    return layer.tracker.take_records()[-1].aux_loss, layer.router(x.detach().reshape(-1, HIDDEN))


def layer_loss(aux_loss_type: str) -> tuple[torch.Tensor, torch.Tensor]:
    return forward_loss(make_layer(aux_loss_type))


def routing_map(logits: torch.Tensor) -> torch.Tensor:
    _, indices = route(logits, MOE)
    return torch.zeros_like(logits, dtype=torch.bool).scatter(1, indices, True)


def test_micro_batch_loss_is_megatrons():
    ours, logits = layer_loss("megatron")
    scores = aux_loss_scores(logits, MOE)
    theirs = megatron_switch_loss(scores, routing_map(logits).sum(0), SEQ * ROWS, MOE.topk, MOE.num_experts, COEFF)
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-6)


def test_sequence_loss_is_megatrons_seq_aux_loss():
    ours, logits = layer_loss("sequence")
    scores = aux_loss_scores(logits, MOE).reshape(SEQ, -1)  # token s * ROWS + r: row r's experts side by side
    counts = routing_map(logits).reshape(SEQ, -1).sum(0)
    theirs = megatron_switch_loss(scores, counts, SEQ, MOE.topk, MOE.num_experts, COEFF) / ROWS
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-6)
    micro_batch, _ = layer_loss("megatron")
    assert abs(ours.item() - micro_batch.item()) > 1e-3 * micro_batch.item()  # the two losses differ here


def test_global_loss_averages_the_counts_over_the_steps_micro_batches():
    layer = make_layer("global")
    first, logits = forward_loss(layer)
    counts = routing_map(logits).sum(0)
    theirs = megatron_switch_loss(aux_loss_scores(logits, MOE), counts, SEQ * ROWS, MOE.topk, MOE.num_experts, COEFF)
    assert first.item() == pytest.approx(theirs.item(), rel=1e-6)
    second, logits = forward_loss(layer)  # the next micro-batch of the same step
    mean = (counts + routing_map(logits).sum(0)) / 2
    theirs = megatron_switch_loss(aux_loss_scores(logits, MOE), mean, SEQ * ROWS, MOE.topk, MOE.num_experts, COEFF)
    assert second.item() == pytest.approx(theirs.item(), rel=1e-6)
    layer.tracker.reset_step()  # a new step starts from its own counts
    third, logits = forward_loss(layer)
    theirs = megatron_switch_loss(aux_loss_scores(logits, MOE), routing_map(logits).sum(0), SEQ * ROWS, MOE.topk,
                                  MOE.num_experts, COEFF)
    assert third.item() == pytest.approx(theirs.item(), rel=1e-6)
