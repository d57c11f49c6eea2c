"""torchrun worker for tests/test_chunked_loss.py (4 gloo ranks, one launch): the chunked loss head against the whole
logits under tensor, sequence, pipeline, context and data parallelism.

  head/<case>.rank<R>.json    one loss head (GPTModel.loss) on a leaf input, chunked and not, same weights:
                              the losses and this rank's input and output-weight gradients, as relative errors
  engine/<case>.rank<R>.json  the Engine with train.loss_chunk_tokens off and on, same seed and batch: every step's
                              loss, the relative error of each of this rank's first-step reduced gradients, how
                              often the chunked loss ran, and how often its backward ran and computed dx and dW

    torchrun --nproc-per-node 4 tests/workers/chunked_loss_worker.py OUTDIR
"""

import json
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import run_jobs  # noqa: E402
from parallel_cases import GLOBAL_BATCH, SEQ, SPEC, make_batch  # noqa: E402

from qlm_core.config import OptimConfig, ParallelConfig  # noqa: E402
from qlm_core.models.gpt import GPTModel, ParallelOptions  # noqa: E402
from qlm_core.parallel import cross_entropy  # noqa: E402
from qlm_core.parallel.comm import group_rank  # noqa: E402
from qlm_core.parallel.state import Grid, resolve_sizes  # noqa: E402
from qlm_core.train.engine import Batch, Engine  # noqa: E402

CHUNK = 24  # does not divide the 64 tokens of a micro-batch (2 x 32)
STEPS = 3
OPTIM = OptimConfig(lr=1e-3, weight_decay=0.1, clip_grad=1.0)
TIED = SPEC.replace(tie_word_embeddings=True)

# name -> (tp, sequence parallel)
HEAD_CASES = {"head_tp2": (2, False), "head_tp2_sp": (2, True)}
# name -> (world, parallel, spec, micro-batch size)
ENGINE_CASES = {
    "tp2_sp": (2, dict(tp=2, sp=True), SPEC, 2),
    "pp2_1f1b": (2, dict(pp=2, pp_schedule="1f1b"), SPEC, 2),
    "pp2_zero_bubble": (2, dict(pp=2, pp_schedule="zero_bubble"), SPEC, 2),
    "pp2_tied": (2, dict(pp=2), TIED, 2),
    "tp2_pp2_sp": (4, dict(tp=2, pp=2, sp=True), SPEC, 2),
    "cp2_p2p": (2, dict(cp=2, cp_comm_type="p2p"), SPEC, 2),
    "cp2_a2a": (2, dict(cp=2, cp_comm_type="a2a"), SPEC, 2),
    "tp2_cp2_sp": (4, dict(tp=2, cp=2, sp=True), SPEC, 2),
    "dp2_zero1_overlap": (2, dict(zero_stage=1, overlap_grad_reduce=True, overlap_param_gather=True), SPEC, 2),
    "dp2_zero3": (2, dict(zero_stage=3), SPEC, 2),
}


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def head_case(name: str, out: Path):
    tp, sp = HEAD_CASES[name]
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
    result = {}
    for chunk, model in models.items():
        x = hidden.clone().requires_grad_(True)
        loss = model.loss(x, labels)
        (loss * weights).sum().backward()
        result[chunk] = (loss.detach(), x.grad, model.output_layer.weight.grad)
    (whole_loss, whole_x, whole_w), (loss, x_grad, w_grad) = result[0], result[CHUNK]
    errors = {"loss": relative(loss, whole_loss), "input_grad": relative(x_grad, whole_x),
              "weight_grad": relative(w_grad, whole_w),
              "ignored_loss": loss[labels < 0].abs().max().item()}
    (out / "head").mkdir(exist_ok=True)
    (out / "head" / f"{name}.rank{grid.rank}.json").write_text(json.dumps(errors))


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
            grads = {f"{c}.{n}": engine.grads.full_grad(p).detach().float().clone()
                     for c, chunk_model in enumerate(engine.chunks) for n, p in chunk_model.named_parameters()}
        engine.update()
        losses.append(engine.global_loss(loss_sum))
    return losses, grads


def engine_case(name: str, out: Path):
    world, parallel, spec, mbs = ENGINE_CASES[name]
    config = ParallelConfig(**parallel)
    grid = Grid.build(resolve_sizes(world, tp=config.tp, pp=config.pp, cp=config.cp), ranks=list(range(world)))
    if grid is None:
        return
    whole_losses, whole_grads, whole_calls, _ = run_engine(grid, parallel, spec, mbs, 0)
    chunked_losses, chunked_grads, chunked_calls, backward = run_engine(grid, parallel, spec, mbs, CHUNK)
    errors = {key: relative(chunked_grads[key], whole_grads[key]) for key in whole_grads}
    (out / "engine").mkdir(exist_ok=True)
    (out / "engine" / f"{name}.rank{grid.rank}.json").write_text(json.dumps(
        {"whole": whole_losses, "chunked": chunked_losses, "grad_errors": errors, "last_stage": grid.is_last_stage,
         "chunked_calls": {"whole": whole_calls, "chunked": chunked_calls}, "chunked_backward": backward}))


def main():
    cases = [(head_case, HEAD_CASES), (engine_case, ENGINE_CASES)]
    run_jobs([(name, partial(job, name)) for job, names in cases for name in names], num_threads=1)


if __name__ == "__main__":
    main()
