"""torchrun worker for tests/profile/test_profile_parallel.py (4 gloo ranks, one launch):

  states/<case>.rank<R>.json   the Engine's measured weights/grads/optimizer bytes and profile.states' prediction
  layer/<case>.json            saved bytes of one middle transformer layer (hooks) and activations.py's formula
  head/<case>.json             saved bytes of the loss region (final norm + loss head, whole logits or chunked)
  stage/<case>.json            peak saved bytes on pipeline stage 0 over a whole 1F1B / interleaved step, and
                               memory.py's activations + logits_loss for that stage
With `ep` after OUTDIR only the expert-parallel jobs run (tests/profile/test_profile_ep.py):
  ep_states/<case>.rank<R>.json  as states/, for EP layouts of the tiny MoE model
  ep_layer/<case>.rank<R>.json   saved bytes of MoE layer 1 on every rank, the rows it received (ExpertLoadMeter)
                                 and activations.py's formula at that load

    torchrun --nproc-per-node 4 tests/workers/profile_worker.py OUTDIR [ep]
"""

import json
import sys
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from parallel_cases import MOE, SPEC

from qlm_core.config import LoraConfig, OptimConfig, ParallelConfig
from qlm_core.models.gpt import GPTModel, ParallelOptions
from qlm_core.models.spec import ModelSpec
from qlm_core.parallel.comm import group_rank
from qlm_core.parallel.context_parallel import split_for_cp
from qlm_core.parallel.cross_entropy import DEFAULT_CHUNK_TOKENS
from qlm_core.parallel.expert_dispatch import ExpertParallel
from qlm_core.parallel.state import Grid, resolve_sizes
from qlm_core.profile.activations import ActivationInputs, head_terms, layer_bytes
from qlm_core.profile.case import ProfileCase
from qlm_core.profile.measure import ExpertLoadMeter, SavedTensorMeter, measure_model_states
from qlm_core.profile.memory import stage_memory
from qlm_core.profile.states import model_state_bytes
from qlm_core.train.engine import Batch, Engine
from workers.harness import run_jobs

MHA = SPEC.replace(num_query_groups=4)
TIED = SPEC.replace(tie_word_embeddings=True)
SEQ = 32

@dataclass(frozen=True)
class StateCase:
    """One Engine step at `world` ranks: its weights / grads / optimizer bytes against profile.states."""

    world: int
    parallel: dict
    dtype: torch.dtype
    spec: ModelSpec = SPEC
    lora_rank: int = 0  # 0: no LoRA


@dataclass(frozen=True)
class LayerCase:
    """The saved bytes of one middle layer of a 3-layer bf16 GPTModel at tp × cp ranks."""

    tp: int
    cp: int
    sp: bool
    comm: str = "p2p"  # cp_comm_type
    spec: ModelSpec = SPEC
    recompute: str = "none"
    modules: tuple[str, ...] = ("core_attn",)  # recompute_modules, with selective


@dataclass(frozen=True)
class HeadCase:
    """The saved bytes of the loss region (final norm + loss head) at `tp` ranks: 64 tokens per rank."""

    tp: int
    sp: bool
    chunk_tokens: int  # 0: the whole logits


@dataclass(frozen=True)
class StageCase:
    """A pipeline stage's peak saved bytes over one train step (32 tokens per micro-batch)."""

    parallel: dict
    microbatches: int
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS

    @property
    def stages(self) -> int:
        return self.parallel["pp"]

    @property
    def full_recompute(self) -> bool:
        return self.parallel.get("recompute") == "full"


STATE_CASES = {
    "dp4_zero1_bf16": StateCase(4, dict(zero_stage=1), torch.bfloat16),
    "pp2_dp2_zero2_tied_fp32": StateCase(4, dict(pp=2, zero_stage=2), torch.float32, TIED),
    "tp2_dp2_zero3_bf16": StateCase(4, dict(tp=2, sp=True, zero_stage=3), torch.bfloat16),
    "tp2_pp2_zero0_bf16": StateCase(4, dict(tp=2, pp=2), torch.bfloat16),
    "tp2_dp2_zero1_lora": StateCase(4, dict(tp=2, sp=True, zero_stage=1), torch.bfloat16, lora_rank=4),
    "cp2_dp2_zero2_bf16": StateCase(4, dict(cp=2, zero_stage=2, bucket_size_mb=0.01), torch.bfloat16),
}
LAYER_CASES = {
    "tp2_sp_gqa": LayerCase(2, 1, True),
    "tp2_sp_mha": LayerCase(2, 1, True, spec=MHA),
    "tp2_no_sp": LayerCase(2, 1, False),
    "tp4_sp_fewer_groups": LayerCase(4, 1, True),
    "tp2_sp_selective": LayerCase(2, 1, True, recompute="selective"),
    "cp2_p2p_gqa": LayerCase(1, 2, False),
    "cp2_p2p_mha": LayerCase(1, 2, False, spec=MHA),
    "cp2_allgather": LayerCase(1, 2, False, comm="allgather"),
    "cp2_a2a": LayerCase(1, 2, False, comm="a2a"),
    "cp2_p2p_selective": LayerCase(1, 2, False, recompute="selective"),
    "tp2_cp2_sp_full": LayerCase(2, 2, True, recompute="full"),
    "tp2_sp_mlp_layernorm": LayerCase(2, 1, True, recompute="selective", modules=("mlp", "layernorm")),
    "tp2_sp_op": LayerCase(2, 1, True, recompute="op"),
}
HEAD_CASES = {  # chunks of 24 do not divide the 64 tokens
    "tp2_sp_whole_logits": HeadCase(2, True, 0),
    "tp2_sp_chunked": HeadCase(2, True, 24),
    "tp2_no_sp_whole_logits": HeadCase(2, False, 0),
    "tp2_no_sp_chunked": HeadCase(2, False, 24),
}
STAGE_CASES = {
    "pp2_1f1b": StageCase(dict(pp=2, pp_schedule="1f1b"), 4),
    "pp2_1f1b_full": StageCase(dict(pp=2, pp_schedule="1f1b", recompute="full"), 4),
    "pp2_interleaved": StageCase(dict(pp=2, vpp=2, pp_schedule="interleaved_1f1b"), 4),
    "pp2_zero_bubble": StageCase(dict(pp=2, pp_schedule="zero_bubble"), 4),
    "pp4_1f1b_gpipe": StageCase(dict(pp=4, pp_schedule="gpipe"), 2),
    "pp2_1f1b_chunked_loss": StageCase(dict(pp=2, pp_schedule="1f1b"), 4, 12),
    "pp2_1f1b_whole_logits": StageCase(dict(pp=2, pp_schedule="1f1b"), 4, 0),
    "pp2_zero_bubble_chunked_loss": StageCase(dict(pp=2, pp_schedule="zero_bubble"), 4, 12),
    "pp4_gpipe_chunked_loss": StageCase(dict(pp=4, pp_schedule="gpipe"), 2, 12),
}


EP_STATE_CASES = {
    "ep2_zero1_bf16": StateCase(2, dict(ep=2, zero_stage=1), torch.bfloat16, MOE),
    "ep2_dp4_zero2_bf16": StateCase(4, dict(ep=2, zero_stage=2, bucket_size_mb=0.01), torch.bfloat16, MOE),
    "ep2_tp2_sp_zero1_bf16": StateCase(4, dict(ep=2, tp=2, sp=True, zero_stage=1), torch.bfloat16, MOE),
    "ep2_tp2_sp_etp1_zero0_fp32": StateCase(4, dict(ep=2, tp=2, sp=True, etp=1), torch.float32, MOE),
}
EP_LAYER_CASES = {  # world, parallel (the layer's tp / sp / ep / etp)
    "ep2": (2, dict(ep=2)),
    "ep4": (4, dict(ep=4)),
    "ep2_tp2_sp": (4, dict(ep=2, tp=2, sp=True)),
    "ep2_tp2_sp_etp1": (4, dict(ep=2, tp=2, sp=True, etp=1)),
}


def batch(rows: int, vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (rows, SEQ + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def state_case(name: str, out: Path):
    case = STATE_CASES[name]
    world, dtype, spec, lora_rank = case.world, case.dtype, case.spec, case.lora_rank
    config = ParallelConfig(**case.parallel)
    sizes = resolve_sizes(world, config.tp, config.pp, config.cp)
    grid = Grid.build(sizes, ranks=list(range(world)))
    if grid is None:
        return
    lora = LoraConfig(rank=lora_rank) if lora_rank else None
    engine = Engine(spec, config, grid, micro_batch_size=1, global_batch_size=2 * sizes.dp, seq_length=SEQ,
                    dtype=dtype, optim=OptimConfig(lr=1e-3), lora=lora)
    ids, labels = batch(2, spec.vocab_size, grid.dp_rank)
    engine.train_step(Batch(ids, labels))
    measured = measure_model_states(engine)
    predicted = model_state_bytes(engine.layout, grid.pp_rank, dtype=dtype, zero_stage=config.zero_stage,
                                  shards=sizes.dp * sizes.cp, bucket_size_mb=config.bucket_size_mb,
                                  lora_rank=lora_rank, dp_rank=group_rank(grid.dp_cp_group))
    result = {"measured": measured, "predicted": {"weights": predicted.weights, "grads": predicted.grads,
                                                  "optimizer": predicted.optimizer}}
    (out / "states").mkdir(exist_ok=True)
    (out / "states" / f"{name}.rank{grid.rank}.json").write_text(json.dumps(result))


def ep_state_case(name: str, out: Path):
    """An EP layout's measured model states against profile.states, on every rank (its dp·cp and edp ranks)."""
    case = EP_STATE_CASES[name]
    config = ParallelConfig(**case.parallel)
    sizes = resolve_sizes(case.world, config.tp, config.pp, config.cp, ep=config.ep, etp=config.etp)
    grid = Grid.build(sizes, ranks=list(range(case.world)))
    if grid is None:
        return
    engine = Engine(case.spec, config, grid, micro_batch_size=1, global_batch_size=2 * sizes.dp, seq_length=SEQ,
                    dtype=case.dtype, optim=OptimConfig(lr=1e-3))
    ids, labels = batch(2, case.spec.vocab_size, grid.dp_rank)
    engine.train_step(Batch(ids, labels))
    predicted = model_state_bytes(engine.layout, grid.pp_rank, dtype=case.dtype, zero_stage=config.zero_stage,
                                  shards=sizes.dp * sizes.cp, bucket_size_mb=config.bucket_size_mb,
                                  dp_rank=group_rank(grid.dp_cp_group), expert_rank=group_rank(grid.expert_dp_group))
    result = {"measured": measure_model_states(engine), "predicted": {
        "weights": predicted.weights, "grads": predicted.grads, "optimizer": predicted.optimizer}}
    (out / "ep_states").mkdir(exist_ok=True)
    (out / "ep_states" / f"{name}.rank{grid.rank}.json").write_text(json.dumps(result))


def ep_layer_case(name: str, out: Path):
    """MoE layer 1's saved bytes (held at the end of forward) under EP, and the formula at the rows it received."""
    world, parallel = EP_LAYER_CASES[name]
    tp, sp, ep, etp = parallel.get("tp", 1), parallel.get("sp", False), parallel["ep"], parallel.get("etp")
    sizes = resolve_sizes(world, tp=tp, ep=ep, etp=etp)
    grid = Grid.build(sizes, ranks=list(range(world)))
    if grid is None:
        return
    experts = ExpertParallel(sizes.ep, sizes.etp, grid.expert_group)
    options = ParallelOptions(tp_group=grid.tp_group, sequence_parallel=sp, experts=experts)
    model = GPTModel(MOE, parallel=options, num_layers=3, dtype=torch.bfloat16)
    ids, labels = batch(2, MOE.vocab_size, seed=grid.dp_rank)
    layer1 = model.decoder.layers[1]
    with SavedTensorMeter(model) as meter, ExpertLoadMeter(layer1) as load:
        loss = model(ids, labels=labels).sum()
        held = sum(nbytes for nbytes, label, _ in meter.live.values() if label == "layer1")
    loss.backward()
    x = ActivationInputs(MOE, SEQ, 2, tp=tp, sp=sp, dtype_bytes=2, device="cpu", ep=ep, etp=etp or 0,
                         moe_load=load.load)
    (out / "ep_layer").mkdir(exist_ok=True)
    (out / "ep_layer" / f"{name}.rank{grid.rank}.json").write_text(json.dumps(
        {"measured": held, "predicted": layer_bytes(x), "load": load.load,
         "balanced": layer_bytes(x.__class__(**{**x.__dict__, "moe_load": 1.0}))}))


def layer_case(name: str, out: Path):
    case = LAYER_CASES[name]
    tp, cp, sp, comm, spec, recompute = case.tp, case.cp, case.sp, case.comm, case.spec, case.recompute
    grid = Grid.build(resolve_sizes(tp * cp, tp=tp, cp=cp), ranks=list(range(tp * cp)))
    if grid is None:
        return
    options = ParallelOptions(tp_group=grid.tp_group, sequence_parallel=sp, cp_group=grid.cp_group,
                              cp_comm_type=comm, recompute=recompute, recompute_modules=case.modules)
    model = GPTModel(spec, parallel=options, num_layers=3, dtype=torch.bfloat16)
    ids, labels = batch(2, spec.vocab_size)
    ids, labels = split_for_cp(ids, cp, grid.cp_rank, 1), split_for_cp(labels, cp, grid.cp_rank, 1)
    with SavedTensorMeter(model) as meter:
        loss = model(ids, labels=labels).sum()
    loss.backward()
    x = ActivationInputs(spec, SEQ, 2, tp=tp, sp=sp, cp=cp, cp_comm_type=comm, dtype_bytes=2, device="cpu",
                         recompute_modules=case.modules)
    if grid.rank == 0:
        (out / "layer").mkdir(exist_ok=True)
        (out / "layer" / f"{name}.json").write_text(json.dumps(
            {"measured": meter.layer_bytes()["layer1"], "predicted": layer_bytes(x, recompute)}))


def head_case(name: str, out: Path):
    case = HEAD_CASES[name]
    tp, sp, chunk = case.tp, case.sp, case.chunk_tokens
    grid = Grid.build(resolve_sizes(tp, tp=tp), ranks=list(range(tp)))
    if grid is None:
        return
    options = ParallelOptions(tp_group=grid.tp_group, sequence_parallel=sp)
    model = GPTModel(SPEC, parallel=options, num_layers=1, dtype=torch.bfloat16, loss_chunk_tokens=chunk)
    ids, labels = batch(2, SPEC.vocab_size)
    with SavedTensorMeter(model) as meter:
        loss = model(ids, labels=labels).sum()
    loss.backward()
    x = ActivationInputs(SPEC, SEQ, 2, tp=tp, sp=sp, dtype_bytes=2, padded_vocab=model.padded_vocab, device="cpu",
                         loss_chunk_tokens=chunk)
    if grid.rank == 0:
        (out / "head").mkdir(exist_ok=True)
        (out / "head" / f"{name}.json").write_text(json.dumps(
            {"measured": meter.first_seen["head"], "predicted": sum(head_terms(x).values()),
             "chunked": x.chunked_loss}))


def stage_case(name: str, out: Path):
    case = STAGE_CASES[name]
    microbatches, chunk_tokens = case.microbatches, case.chunk_tokens
    config = ParallelConfig(**case.parallel)
    world = config.pp
    grid = Grid.build(resolve_sizes(world, pp=config.pp), ranks=list(range(world)))
    if grid is None:
        return
    spec = SPEC.replace(num_layers=4 * config.vpp if config.pp == 2 else 4)
    engine = Engine(spec, config, grid, micro_batch_size=1, global_batch_size=microbatches, seq_length=SEQ,
                    dtype=torch.bfloat16, optim=OptimConfig(lr=1e-3), loss_chunk_tokens=chunk_tokens)
    ids, labels = batch(microbatches, spec.vocab_size)
    with SavedTensorMeter(engine.chunks) as meter:
        engine.train_step(Batch(ids, labels))
    case = ProfileCase(spec, "tiny", config, seq_len=SEQ, micro_batch_size=1, global_batch_size=microbatches,
                       num_gpus=world, loss_chunk_tokens=chunk_tokens)
    predicted = stage_memory(case, grid.pp_rank, device="cpu")
    result = {"stage": grid.pp_rank, "measured": meter.peak_bytes,
              "predicted": predicted.components["activations"] + predicted.components["logits_loss"],
              "chunk_forwards": predicted.chunk_forwards}
    (out / "stage").mkdir(exist_ok=True)
    (out / "stage" / f"{name}.stage{grid.pp_rank}.json").write_text(json.dumps(result))


def main():
    cases = [(state_case, STATE_CASES), (layer_case, LAYER_CASES), (head_case, HEAD_CASES), (stage_case, STAGE_CASES)]
    if sys.argv[2:] == ["ep"]:
        cases = [(ep_state_case, EP_STATE_CASES), (ep_layer_case, EP_LAYER_CASES)]
    run_jobs([(name, partial(job, name)) for job, names in cases for name in names], num_threads=1)


if __name__ == "__main__":
    main()
