"""train.compile: each decoder layer through torch.compile (GPTModel.compile_layers) trains exactly as the eager
layers do, one process: losses and first-step gradients against the eager engine with plain and packed rows,
recompute (full, op, every selective module) and LoRA; packed rows whose documents change every step compile once;
evaluation stays eager. Multi-rank layouts: tests/parallel/test_parallel_parity.py (COMPILED_CASES)."""

import pytest
import torch
from parallel_cases import GLOBAL_BATCH, SEQ, SPEC, make_batch
from torch._dynamo.utils import counters

from qlm_core.config import LoraConfig, OptimConfig, ParallelConfig
from qlm_core.parallel.state import Grid
from qlm_core.train.engine import Batch, Engine

pytestmark = pytest.mark.slow  # inductor compiles through gcc: tens of seconds per layer graph on 2 cores

OPTIM = OptimConfig(lr=1e-3, weight_decay=0.1, clip_grad=1.0)
STEPS = 3


def engine(compile: bool, lora: LoraConfig | None = None, **parallel) -> Engine:
    return Engine(SPEC, ParallelConfig(**parallel), Grid.single(), micro_batch_size=4, global_batch_size=GLOBAL_BATCH,
                  seq_length=SEQ, optim=OPTIM, seed=1234, lora=lora, compile=compile)


def packed_batch(seed: int) -> Batch:
    """Packed rows with document boundaries of their own (the seed moves them)."""
    input_ids, labels, _, _ = make_batch("plain")
    generator = torch.Generator().manual_seed(seed)
    segment_ids = torch.zeros(GLOBAL_BATCH, SEQ, dtype=torch.long)
    position_ids = torch.zeros(GLOBAL_BATCH, SEQ, dtype=torch.long)
    for row in range(GLOBAL_BATCH):
        cuts = sorted(torch.randperm(SEQ - 1, generator=generator)[:3].add(1).tolist())
        for doc, (start, stop) in enumerate(zip([0] + cuts, cuts + [SEQ], strict=True)):
            segment_ids[row, start:stop] = doc
            position_ids[row, start:stop] = torch.arange(stop - start)
    return Batch(input_ids, labels, position_ids, segment_ids)


def train(e: Engine, batches: list[Batch]) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Losses of a step per batch, and the first step's gradients."""
    losses, grads = [], None
    for batch in batches:
        loss = e.forward_backward(batch)
        if grads is None:
            grads = {n: e.optimizer.full_grad(p).detach().clone() for n, p in e.chunks[0].named_parameters()
                     if p.requires_grad}
        e.update()
        losses.append(e.global_loss(loss))
    return losses, grads


def assert_same_training(eager, compiled):
    (eager_losses, eager_grads), (losses, grads) = eager, compiled
    assert losses == pytest.approx(eager_losses, rel=1e-5)
    assert grads.keys() == eager_grads.keys()
    for name, grad in grads.items():
        error = (grad - eager_grads[name]).norm() / eager_grads[name].norm().clamp(min=1e-30)
        assert error <= 1e-5, (name, error.item())


def captured() -> int:
    return counters["stats"]["calls_captured"]


PLAIN = [Batch(*make_batch("plain"))] * STEPS


@pytest.mark.parametrize("parallel", [
    {},
    dict(recompute="full"),
    dict(recompute="op"),
    dict(recompute="selective", recompute_modules=["core_attn", "mlp", "layernorm"]),
], ids=["plain", "recompute_full", "recompute_op", "recompute_selective_all"])
def test_compiled_layers_train_as_eager(parallel):
    before = captured()
    compiled = train(engine(True, **parallel), PLAIN)
    assert captured() > before  # the layers ran compiled, not an eager fallback
    assert_same_training(train(engine(False, **parallel), PLAIN), compiled)


def test_compiled_lora_trains_as_eager():
    lora = LoraConfig(rank=4, alpha=8.0)
    before = captured()
    compiled = train(engine(True, lora=lora), PLAIN)
    assert captured() > before
    assert_same_training(train(engine(False, lora=lora), PLAIN), compiled)


def test_packed_documents_compile_once():
    """Document boundaries are Python data of the eagerly run attention: new boundaries every step, no new graph."""
    batches = [packed_batch(seed) for seed in range(STEPS)]
    e = engine(True)
    frames = []
    for batch in batches:
        train(e, [batch])
        frames.append(captured())
    assert frames[1] == frames[0] == frames[2]
    assert_same_training(train(engine(False), batches), train(engine(True), batches))


def test_evaluation_stays_eager():
    e = engine(True)
    train(e, PLAIN[:1])
    before = captured()
    eager = engine(False)
    train(eager, PLAIN[:1])
    assert e.evaluate(PLAIN[0]) == pytest.approx(eager.evaluate(PLAIN[0]), rel=1e-5)
    assert captured() == before
