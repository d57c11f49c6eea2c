"""torchrun worker for the parallel parity suite: runs every case of tests/parallel_cases.py (3 AdamW steps each,
10 for expert parallelism) and writes, per case, the losses and grad norms (JSON) and the first step's reduced
gradients as a Megatron-layout checkpoint (so the test can re-assemble full tensors with qlm's checkpoint reader).

    torchrun --nproc-per-node 8 tests/workers/parity_worker.py OUTDIR [CASE ...]
"""

import json
import sys
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from parallel_cases import CASES, COMPILED_CASES, GLOBAL_BATCH, SEQ, SPEC, case_mtp_scale, make_batch

from qlm_core.checkpoint.formats.megatron.args import make_args
from qlm_core.checkpoint.formats.megatron.legacy import (
    SHARD_FILE,
    iteration_dir_name,
    write_latest,
    write_shard_file,
)
from qlm_core.config import OptimConfig, ParallelConfig
from qlm_core.parallel.state import Grid, resolve_sizes
from qlm_core.train.checkpointing import legacy_shard_dir
from qlm_core.train.engine import Batch, Engine
from workers.harness import run_jobs

OPTIM = OptimConfig(lr=1e-3, weight_decay=0.1, clip_grad=1.0)


def full_grads(engine: Engine) -> list[dict[str, torch.Tensor]]:
    """Every parameter's reduced gradient as a full local-shard tensor, per chunk, under state_dict names."""
    out = []
    for chunk in engine.chunks:
        grads = {}
        for name, param in chunk.named_parameters():
            grads[name] = (engine.optimizer.full_grad(param).detach().float().cpu().clone() if param.requires_grad
                           else torch.zeros(tuple(param.shape)))  # frozen (MTP not trained): no gradient
        out.append(grads)
    return out


def compiled_frames() -> int:
    from torch._dynamo.utils import counters  # torch's pipelining imports dynamo anyway; eager cases record 0

    return counters["stats"]["calls_captured"] if "torch._dynamo" in sys.modules else 0


def run_case(name: str, outdir: Path):
    case = CASES.get(name) or COMPILED_CASES[name]
    if case.compile:  # this case's graphs of its own: what it captures below is what proves it ran compiled
        import torch._dynamo as dynamo  # binds `dynamo` only: `torch` stays the module-level name

        dynamo.reset()
    frames_before = compiled_frames()
    config = ParallelConfig(**case.parallel)
    sizes = resolve_sizes(case.world, tp=config.tp, pp=config.pp, cp=config.cp, ep=config.ep, etp=config.etp)
    grid = Grid.build(sizes, ranks=list(range(case.world)))
    if grid is None:
        return
    engine = Engine(case.spec, config, grid, micro_batch_size=case.micro_batch_size,
                    global_batch_size=GLOBAL_BATCH, seq_length=SEQ, optim=OPTIM, seed=1234, moe=case.moe,
                    compile=case.compile, mtp_loss_scaling_factor=case_mtp_scale(case.data))
    input_ids, labels, position_ids, segment_ids = make_batch(case.data)
    rows = GLOBAL_BATCH // sizes.dp
    mine = slice(grid.dp_rank * rows, (grid.dp_rank + 1) * rows)
    batch = Batch(input_ids[mine], labels[mine], None if position_ids is None else position_ids[mine],
                  None if segment_ids is None else segment_ids[mine])
    losses, norms, moe_figures, mtp_losses = [], [], [], []
    for step in range(case.steps):
        loss_sum = engine.forward_backward(batch)
        if step == 0:
            grads = full_grads(engine)  # a collective over the data ranks under ZeRO 1-3: every rank calls it
            rank_dir = legacy_shard_dir(grid, sizes.pp)  # Megatron's writers under expert parallelism too
            if rank_dir is not None:
                root = outdir / name
                file = root / iteration_dir_name(None) / rank_dir / SHARD_FILE
                write_shard_file(file, grads, make_args(engine.layout, torch.float32), None)
                if grid.rank == 0:
                    write_latest(root, None)
        norm, _ = engine.update()
        losses.append(engine.global_loss(loss_sum))
        norms.append(norm)
        moe_figures.append(engine.moe_step_figures())
        if engine.mtp_depths:
            mtp_losses.append(engine.mtp_step_loss())
    # proof that the layers ran compiled: the frames torch.compile captured for this case
    result = {"losses": losses, "grad_norms": norms, "moe": moe_figures, "mtp": mtp_losses,
              "compiled_frames": compiled_frames() - frames_before}
    if grid.rank == 0:
        (outdir / f"{name}.json").write_text(json.dumps(result))


def count_layer_collectives(outdir: Path):
    """Collectives one TransformerLayer issues with TP=2 + sequence parallelism, forward and backward."""
    import qlm_core.parallel.comm as comm
    from qlm_core.kernels.rope import rope_cos_sin, rope_inv_freq
    from qlm_core.models.gpt import AttentionInputs, ParallelOptions, TransformerLayer

    grid = Grid.build(resolve_sizes(2, tp=2), ranks=[0, 1])
    if grid is None:
        return
    counts = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0}
    originals = (comm._all_gather_flat, comm._reduce_scatter_flat, dist.all_reduce)

    def counting(kind, fn):
        def wrapped(*args, **kwargs):
            counts[kind] += 1
            return fn(*args, **kwargs)
        return wrapped

    layer = TransformerLayer(SPEC, ParallelOptions(tp_group=grid.tp_group, sequence_parallel=True), torch.float32)
    x = torch.randn(SEQ // 2, 2, SPEC.hidden_size, requires_grad=True)
    cos, sin = rope_cos_sin(torch.arange(SEQ)[None].expand(2, SEQ), rope_inv_freq(16, 10000.0), torch.float32)
    comm._all_gather_flat = counting("all_gather", originals[0])
    comm._reduce_scatter_flat = counting("reduce_scatter", originals[1])
    dist.all_reduce = counting("all_reduce", originals[2])
    try:
        out = layer(x, (cos, sin), AttentionInputs(None, None))
        forward = dict(counts)
        out.sum().backward()
        backward = {k: counts[k] - forward[k] for k in counts}
    finally:
        comm._all_gather_flat, comm._reduce_scatter_flat, dist.all_reduce = originals
    if grid.rank == 0:
        (outdir / "collectives.json").write_text(json.dumps({"forward": forward, "backward": backward}))


def main():
    names = sys.argv[2:] or list(CASES)
    run_jobs([("collectives", count_layer_collectives)] + [(name, partial(run_case, name)) for name in names],
             timeout_s=240)


if __name__ == "__main__":
    main()
