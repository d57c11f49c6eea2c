"""torchrun worker: REAL megatron-core loads qlm-written torch_dist checkpoints with dist_checkpointing at the TP/PP
of the launch (not the one they were written at), compares logits with transformers', then saves the model with its
own dist_checkpointing.save so the test can read Megatron's files back with qlm.

Run as: torchrun --nproc-per-node TP*PP megatron_dist_worker.py CASES.json
Each case: {"ckpt", "ids", "expected", "result", "resave", "tp", "pp"}. CPU monkeypatches as in
docs/ARCHITECTURE.md §7.
"""

import argparse
import json
import math
from pathlib import Path

import torch
import torch.distributed as dist

from peers.megatron_logits import build_model, forward, run_cases  # its module-level CPU patches apply too

torch.cuda.synchronize = lambda *a, **k: None  # dist_checkpointing synchronises


def megatron_args(common_args, tp, pp):
    """The args a Megatron-LM run at (tp, pp) would have: its own vocabulary padding for its TP size."""
    args = argparse.Namespace(**vars(common_args))
    multiple = (args.make_vocab_size_divisible_by or 128) * tp
    args.padded_vocab_size = math.ceil(args.vocab_size / multiple) * multiple
    args.tensor_model_parallel_size, args.pipeline_model_parallel_size = tp, pp
    args.decoder_first_pipeline_num_layers = args.decoder_last_pipeline_num_layers = None
    args.ckpt_format = "torch_dist"
    return args


def run_case(case):
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.validation import StrictHandling
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    from qlm_core.checkpoint.formats.megatron.torch_dist_files import resolve_dist_dir

    iteration_dir, _ = resolve_dist_dir(Path(case["ckpt"]))
    common = dist_checkpointing.load_common_state_dict(str(iteration_dir))  # plain torch.load, as Megatron does
    args = megatron_args(common["args"], case["tp"], case["pp"])
    ps.initialize_model_parallel(args.tensor_model_parallel_size, args.pipeline_model_parallel_size)
    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    pp_rank, pp = ps.get_pipeline_model_parallel_rank(), case["pp"]
    pre, post = pp_rank == 0, pp_rank == pp - 1
    model = build_model(args, pre, post)
    # As Megatron-LM loads it (the model under "model", the common state beside it). RAISE_ALL: every key the
    # model asks for is in the checkpoint, and every tensor/object there is asked for by some rank; a case may ask
    # for Megatron-LM's default instead (assume_ok_unexpected: keys the model does not ask for are ignored).
    strict = StrictHandling(case.get("strict", StrictHandling.RAISE_ALL.value))
    state = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(iteration_dir), strict=strict)
    assert state["checkpoint_version"] == 3.0 and "args" in state
    model.load_state_dict(state["model"], strict=True)

    logits = forward(model, args, torch.load(case["ids"], weights_only=True), pre, post)
    if logits is not None:
        expected = torch.load(case["expected"], weights_only=True)
        diff = (logits[..., : expected.shape[-1]] - expected).abs().max().item()
        Path(case["result"]).write_text(json.dumps({"max_abs_diff": diff, "shape": list(logits.shape)}))

    resave = Path(case["resave"]) / "iter_0000007"
    if dist.get_rank() == 0:
        resave.mkdir(parents=True)
    dist.barrier()
    dist_checkpointing.save({"args": args, "checkpoint_version": 3.0, "iteration": 7,
                             "model": model.sharded_state_dict()}, str(resave))
    if dist.get_rank() == 0:
        (resave.parent / "latest_checkpointed_iteration.txt").write_text("7")
    dist.barrier()
    ps.destroy_model_parallel()


if __name__ == "__main__":
    run_cases(run_case)
