"""torchrun worker for tests/train/test_lora.py (4 gloo ranks): LoRA training through Engine in several layouts (3 AdamW
steps each: losses to JSON, the trained adapters saved as a LoRA run saves them), the logits of the tp2·pp2 model,
and the collectives one LoRA layer issues at tp2 with and without sequence parallelism.

    torchrun --nproc-per-node 4 tests/workers/lora_worker.py OUTDIR
"""

import json
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from parallel_cases import GLOBAL_BATCH, SEQ, SPEC, LayoutCase, make_batch

from qlm_core.checkpoint.formats.megatron.args import make_args
from qlm_core.checkpoint.formats.megatron.legacy import (
    SHARD_FILE,
    iteration_dir_name,
    shard_dir_name,
    write_latest,
    write_shard_file,
)
from qlm_core.checkpoint.formats.megatron.lora_args import lora_args
from qlm_core.config import LoraConfig, MoeConfig, OptimConfig, ParallelConfig
from qlm_core.parallel.state import Grid, resolve_sizes
from qlm_core.parallel.tensor import gather_last_dim
from qlm_core.train.engine import Batch, Engine
from qlm_core.train.lora import lora_state_dict
from workers.harness import run_jobs

WORLD, STEPS = 4, 5
OPTIM = OptimConfig(lr=1e-2, weight_decay=0.1, clip_grad=1.0)
LORA = LoraConfig(rank=4, alpha=8.0)
SAVED_CASE = "tp2_pp2_sp"  # its logits are written to OUTDIR/logits.pt
CASES = {
    "tp2": LayoutCase(2, dict(tp=2)),
    "tp2_sp": LayoutCase(2, dict(tp=2, sp=True)),
    "tp4_sp": LayoutCase(4, dict(tp=4, sp=True)),
    "pp2": LayoutCase(2, dict(pp=2, pp_schedule="1f1b")),
    "pp2_vpp2": LayoutCase(2, dict(pp=2, vpp=2, pp_schedule="interleaved_1f1b")),
    "dp2": LayoutCase(2, dict(zero_stage=1, overlap_grad_reduce=True)),
    "dp2_zero3": LayoutCase(2, dict(zero_stage=3)),
    SAVED_CASE: LayoutCase(4, dict(tp=2, pp=2, sp=True)),
    # DeepSeek-V3's layer: adapters on multi-latent attention's gathered down projections and its up projections
    "mla_tp2": LayoutCase(2, dict(tp=2), data="mla"),
    "mla_tp2_sp": LayoutCase(2, dict(tp=2, sp=True), data="mla"),
}


def lora_moe(spec) -> MoeConfig | None:
    """An MoE model's training options under LoRA: the frozen routers' expert biases stay put, no auxiliary
    losses (whose per-micro-batch values the one-process reference would split differently)."""
    return MoeConfig(router_bias_update_rate=0.0) if spec.moe is not None else None


def logits_ids() -> torch.Tensor:
    return make_batch(False)[0][:2]


@torch.no_grad()
def pipeline_logits(engine: Engine, grid: Grid) -> torch.Tensor | None:
    """Full logits [b, s, vocab] of the engine's pp=2 model (one chunk per stage) on the last stage."""
    ids = logits_ids()
    positions = torch.arange(ids.shape[1])[None].expand_as(ids)
    chunk = engine.chunks[0].eval()
    tp = grid.sizes.tp if engine.config.sp else 1
    hidden = torch.empty(ids.shape[1] // tp, ids.shape[0], SPEC.hidden_size)
    if grid.is_first_stage:
        hidden = chunk(ids, positions)[0].contiguous()
    dist.broadcast(hidden, src=grid.pp_ranks[0], group=grid.pp_group)
    if not grid.is_last_stage:
        return None
    hidden = chunk(hidden, positions)  # the last stage returns the final norm's output
    local = chunk.output_layer(hidden, chunk.output_weight())
    return gather_last_dim(local, grid.tp_group)[..., : SPEC.vocab_size].transpose(0, 1)


def run_case(name: str, outdir: Path):
    case = CASES[name]
    config = ParallelConfig(**case.parallel)
    sizes = resolve_sizes(case.world, tp=config.tp, pp=config.pp)
    grid = Grid.build(sizes, ranks=list(range(case.world)))
    if grid is None:
        return
    engine = Engine(case.spec, config, grid, micro_batch_size=case.micro_batch_size, global_batch_size=GLOBAL_BATCH,
                    seq_length=SEQ, optim=OPTIM, seed=1234, lora=LORA, moe=lora_moe(case.spec))
    input_ids, labels, _, _ = make_batch(False)
    rows = GLOBAL_BATCH // sizes.dp
    mine = slice(grid.dp_rank * rows, (grid.dp_rank + 1) * rows)
    losses = [engine.train_step(Batch(input_ids[mine], labels[mine])).loss for _ in range(STEPS)]
    if grid.rank == 0:  # what the optimizer holds (and checkpoints save state for) against what trains
        trainable = sum(p.requires_grad for chunk in engine.chunks for p in chunk.parameters())
        (outdir / f"{name}.json").write_text(json.dumps({
            "losses": losses, "optimizer_params": len(engine.optimizer.params), "trainable_params": trainable}))
    adapters = [lora_state_dict(chunk) for chunk in engine.chunks]  # a collective under ZeRO-3
    if grid.dp_rank == 0:  # the trained adapters, as a LoRA run saves them
        root = outdir / name
        args = make_args(engine.layout, torch.float32, **lora_args(LORA, base=None))
        file = root / iteration_dir_name(None) / shard_dir_name(grid.tp_rank, grid.pp_rank, sizes.pp) / SHARD_FILE
        write_shard_file(file, adapters, args, None)
        if grid.rank == 0:
            write_latest(root, None)
    if name == SAVED_CASE:
        logits = pipeline_logits(engine, grid)
        if logits is not None and grid.tp_rank == 0:
            torch.save(logits, outdir / "logits.pt")


def count_layer_collectives(outdir: Path):
    """(kind, last-dim width) of every collective one LoRA TransformerLayer issues at tp2, forward and backward."""
    import qlm_core.parallel.comm as comm
    from qlm_core.kernels.rope import rope_cos_sin, rope_inv_freq
    from qlm_core.models.gpt import AttentionInputs, GPTModel, ParallelOptions
    from qlm_core.train.lora import apply_lora

    grid = Grid.build(resolve_sizes(2, tp=2), ranks=[0, 1])
    if grid is None:
        return
    result = {}
    for sp in (False, True):
        options = ParallelOptions(tp_group=grid.tp_group, sequence_parallel=sp)
        model = GPTModel(SPEC, parallel=options, pre_process=False, post_process=False, num_layers=1)
        apply_lora([model], LORA, options, seed=1)
        layer = model.decoder.layers[0]
        calls = []
        originals = (comm._all_gather_flat, comm._reduce_scatter_flat, dist.all_reduce)

        def counting(kind, fn, tensor_arg, calls=calls):
            def wrapped(*args, **kwargs):
                calls.append((kind, args[tensor_arg].shape[-1]))
                return fn(*args, **kwargs)
            return wrapped

        x = torch.randn(SEQ // 2 if sp else SEQ, 2, SPEC.hidden_size, requires_grad=True)
        cos, sin = rope_cos_sin(torch.arange(SEQ)[None].expand(2, SEQ), rope_inv_freq(16, 10000.0), torch.float32)
        comm._all_gather_flat = counting("all_gather", originals[0], 1)
        comm._reduce_scatter_flat = counting("reduce_scatter", originals[1], 1)
        dist.all_reduce = counting("all_reduce", originals[2], 0)
        try:
            out = layer(x, (cos, sin), AttentionInputs(None, None))
            forward = sorted(calls)
            calls.clear()
            out.sum().backward()
            backward = sorted(calls)
        finally:
            comm._all_gather_flat, comm._reduce_scatter_flat, dist.all_reduce = originals
        result["sp" if sp else "no_sp"] = {"forward": forward, "backward": backward}
    if grid.rank == 0:
        (outdir / "collectives.json").write_text(json.dumps(result))


def main():
    run_jobs([("collectives", count_layer_collectives)] + [(name, partial(run_case, name)) for name in CASES])


if __name__ == "__main__":
    main()
