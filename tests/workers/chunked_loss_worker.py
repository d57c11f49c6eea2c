"""torchrun worker for tests/models/test_chunked_loss.py (4 gloo ranks, one launch): the chunked loss head against
the whole
logits under tensor, sequence, pipeline, context and data parallelism.

  head/<case>.rank<R>.pt      one loss head (GPTModel.loss) on a leaf input, whole logits and chunked, same weights:
                              per token losses, this rank's input and output-weight gradients, and the labels
  engine/<case>.rank<R>.pt    the Engine with train.loss_chunk_tokens off and on, same seed and batch: every step's
                              loss and this rank's first-step reduced gradients, how often the chunked loss ran,
                              and how often its backward ran and computed dx and dW

The test compares the chunked results with the whole-logits ones (torch.save files, loaded with weights_only).

    torchrun --nproc-per-node 4 tests/workers/chunked_loss_worker.py OUTDIR
"""

from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from parallel_cases import GLOBAL_BATCH, SEQ, SPEC, make_batch

from qlm_core.config import OptimConfig, ParallelConfig
from qlm_core.models.gpt import GPTModel, ParallelOptions
from qlm_core.models.spec import ModelSpec
from qlm_core.parallel import cross_entropy
from qlm_core.parallel.comm import group_rank
from qlm_core.parallel.state import Grid, resolve_sizes
from qlm_core.train.engine import Batch, Engine
from workers.harness import run_jobs

CHUNK = 24  # does not divide the 64 tokens of a micro-batch (2 x 32)
STEPS = 3
OPTIM = OptimConfig(lr=1e-3, weight_decay=0.1, clip_grad=1.0)
TIED = SPEC.replace(tie_word_embeddings=True)



@dataclass(frozen=True)
class HeadCase:
    """The loss head alone at `tp` ranks, with or without sequence parallelism."""

    tp: int
    sp: bool


@dataclass(frozen=True)
class EngineCase:
    """The Engine at `world` ranks running ParallelConfig(**parallel)."""

    world: int
    parallel: dict
    spec: ModelSpec = SPEC
    micro_batch_size: int = 2

    @property
    def config(self) -> ParallelConfig:
        return ParallelConfig(**self.parallel)


HEAD_CASES = {"head_tp2": HeadCase(2, False), "head_tp2_sp": HeadCase(2, True)}
ENGINE_CASES = {
    "tp2_sp": EngineCase(2, dict(tp=2, sp=True)),
    "pp2_1f1b": EngineCase(2, dict(pp=2, pp_schedule="1f1b")),
    "pp2_zero_bubble": EngineCase(2, dict(pp=2, pp_schedule="zero_bubble")),
    "pp2_tied": EngineCase(2, dict(pp=2), TIED),
    "tp2_pp2_sp": EngineCase(4, dict(tp=2, pp=2, sp=True)),
    "cp2_p2p": EngineCase(2, dict(cp=2, cp_comm_type="p2p")),
    "cp2_a2a": EngineCase(2, dict(cp=2, cp_comm_type="a2a")),
    "tp2_cp2_sp": EngineCase(4, dict(tp=2, cp=2, sp=True)),
    "dp2_zero1_overlap": EngineCase(2, dict(zero_stage=1, overlap_grad_reduce=True, overlap_param_gather=True)),
    "dp2_zero3": EngineCase(2, dict(zero_stage=3)),
}


def head_case(name: str, out: Path):
    tp, sp = HEAD_CASES[name].tp, HEAD_CASES[name].sp
    grid = Grid.build(resolve_sizes(tp, tp=tp), ranks=list(range(tp)))
    if grid is None:
        return
    options = ParallelOptions(tp_group=grid.tp_group, sequence_parallel=sp)
    models = {}
    for chunk in (0, CHUNK):
        torch.manual_seed(0)  # the same weights, the padding rows included (random, so padding must be excluded)
        models[chunk] = GPTModel(SPEC, parallel=options, num_layers=0, loss_chunk_tokens=chunk)
    generator = torch.Generator().manual_seed(3)
    rows = SEQ // tp if sp else SEQ
    hidden = torch.randn(tp, rows, 2, SPEC.hidden_size, generator=generator)[group_rank(grid.tp_group) if sp else 0]
    labels = torch.randint(0, SPEC.vocab_size, (2, SEQ), generator=generator)
    labels[0, :5], labels[1, 17:23] = -100, -100
    weights = torch.rand(2, SEQ, generator=generator)  # an uneven incoming gradient
    result = {"labels": labels}
    for chunk, model in models.items():
        x = hidden.clone().requires_grad_(True)
        loss = model.loss(x, labels)
        (loss * weights).sum().backward()
        result["chunked" if chunk else "whole"] = {"loss": loss.detach(), "input_grad": x.grad,
                                                   "weight_grad": model.output_layer.weight.grad}
    (out / "head").mkdir(exist_ok=True)
    torch.save(result, out / "head" / f"{name}.rank{grid.rank}.pt")


def counting_chunked_calls(calls: list):
    """Replace the chunked loss by itself plus a record of each call (restore with the returned function)."""
    original = cross_entropy.chunked_vocab_parallel_cross_entropy

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    cross_entropy.chunked_vocab_parallel_cross_entropy = counted
    return original


def counting_backward_passes(passes: list, assign=setattr):
    """Record, for each run of the chunked loss's backward, whether it returned dx and dW (autograd looks the
    backward up on the Function class at each call). `assign` installs the counter: setattr (restore with the
    returned function) or pytest's monkeypatch.setattr."""
    function = cross_entropy._ChunkedVocabParallelCrossEntropy
    original = function.backward

    def counted(ctx, grad_loss):
        grads = original(ctx, grad_loss)
        passes.append((grads[0] is not None, grads[1] is not None))
        return grads

    assign(function, "backward", staticmethod(counted))
    return original


def run_engine(grid: Grid, parallel: dict, spec, mbs: int, chunk: int):
    calls, passes = [], []
    original = counting_chunked_calls(calls)
    original_backward = counting_backward_passes(passes)
    try:
        losses, grads = train(grid, parallel, spec, mbs, chunk)
    finally:
        cross_entropy.chunked_vocab_parallel_cross_entropy = original
        cross_entropy._ChunkedVocabParallelCrossEntropy.backward = staticmethod(original_backward)
    backward = {"passes": len(passes), "dx": sum(dx for dx, _ in passes), "dw": sum(dw for _, dw in passes)}
    return losses, grads, len(calls), backward


def train(grid: Grid, parallel: dict, spec, mbs: int, chunk: int):
    sizes = grid.sizes
    engine = Engine(spec, ParallelConfig(**parallel), grid, micro_batch_size=mbs, global_batch_size=GLOBAL_BATCH,
                    seq_length=SEQ, optim=OPTIM, seed=1234, loss_chunk_tokens=chunk)
    input_ids, labels, _, _ = make_batch(False)
    labels[:, :3] = -100
    rows = GLOBAL_BATCH // sizes.dp
    mine = slice(grid.dp_rank * rows, (grid.dp_rank + 1) * rows)
    batch = Batch(input_ids[mine], labels[mine])
    losses, grads = [], None
    for step in range(STEPS):
        loss_sum = engine.forward_backward(batch)
        if step == 0:  # full_grad is a collective over the data ranks under ZeRO 1-3
            grads = {f"{c}.{n}": engine.optimizer.full_grad(p).detach().float().clone()
                     for c, chunk_model in enumerate(engine.chunks) for n, p in chunk_model.named_parameters()}
        engine.update()
        losses.append(engine.global_loss(loss_sum))
    return losses, grads


def engine_case(name: str, out: Path):
    case = ENGINE_CASES[name]
    config = case.config
    grid = Grid.build(resolve_sizes(case.world, tp=config.tp, pp=config.pp, cp=config.cp),
                      ranks=list(range(case.world)))
    if grid is None:
        return
    runs = {chunk: run_engine(grid, case.parallel, case.spec, case.micro_batch_size, chunk) for chunk in (0, CHUNK)}
    (whole_losses, whole_grads, whole_calls, _), (chunked_losses, chunked_grads, chunked_calls, backward) = (
        runs[0], runs[CHUNK])
    (out / "engine").mkdir(exist_ok=True)
    torch.save({"whole": {"losses": whole_losses, "grads": whole_grads},
                "chunked": {"losses": chunked_losses, "grads": chunked_grads}, "last_stage": grid.is_last_stage,
                "chunked_calls": {"whole": whole_calls, "chunked": chunked_calls}, "chunked_backward": backward},
               out / "engine" / f"{name}.rank{grid.rank}.pt")


def main():
    cases = [(head_case, HEAD_CASES), (engine_case, ENGINE_CASES)]
    run_jobs([(name, partial(job, name)) for job, names in cases for name in names], num_threads=1)


if __name__ == "__main__":
    main()
