"""Real DeepSpeed engines on CPU / gloo, one torchrun launch for all of tests/checkpoint/test_deepspeed.py.

    torchrun --standalone --nproc-per-node 3 tests/peers/deepspeed_worker.py CASES.json

CASES.json: {"hf": tiny tied HF model, "results": dir, "train": [{name, stage, bf16, out}],
             "load": [{name, stage, bf16, ckpt, reference_hf}], "zero_to_fp32": [{ckpt, out}]}
train: 2 AdamW steps with layer 1 frozen, save_checkpoint(out); rank 0 writes RESULTS/<name>.expected.pt: what
       DeepSpeed's own get_fp32_state_dict_from_zero_checkpoint returns (ZeRO 1-3), or for ZeRO 0 (which that
       function does not read) the engine's fp32 master of every trainable param and the module's frozen ones.
load:  a randomly initialised engine loads `ckpt` with load_module_only=True; rank 0 writes RESULTS/<name>.json
       with the max |weights - the reference's|, max |logits - transformers' logits| and whether a training step
       after the load ran.
zero_to_fp32: rank 0 saves get_fp32_state_dict_from_zero_checkpoint(ckpt) to `out`.
"""

import contextlib
import importlib
import io
import json
import math
import sys
from datetime import timedelta
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
import transformers
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

# The CPU accelerator JIT-compiles a shared-memory all-reduce op on first use (~40 s, needs a C++ compiler); gloo
# does the same job for these tiny tensors.
importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None

IDS = torch.arange(24).reshape(2, 12) * 7 % 300


def config(stage: int, bf16: bool) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 1000,
        "zero_optimization": {"stage": stage}, "bf16": {"enabled": bf16},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
    }


def engine_for(model, stage: int, bf16: bool):
    """Two parameter groups, as HF Trainer makes them: matrices with weight decay, biases and norms without."""
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [{"params": [p for n, p in trainable if p.dim() > 1], "weight_decay": 0.1},
              {"params": [p for n, p in trainable if p.dim() <= 1], "weight_decay": 0.0}]
    engine, *_ = deepspeed.initialize(model=model, model_parameters=groups, config=config(stage, bf16))
    return engine


def step(engine, seed: int) -> float:
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(seed))
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    return loss.item()


def zero0_expected(engine) -> dict:
    """ZeRO 0: fp32 masters from the optimizer (bf16) or the module itself (fp32); frozen params from the module."""
    names = {id(p): n for n, p in engine.module.named_parameters()}
    expected = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    optimizer = engine.optimizer
    if hasattr(optimizer, "fp32_groups") and hasattr(optimizer, "fp16_groups"):
        for low, high in zip(optimizer.fp16_groups, optimizer.fp32_groups, strict=True):
            for param, master in zip(low, high, strict=True):
                expected[names[id(param)]] = master.detach().clone()
    return expected


def train(case: dict, hf: str, results: Path, rank: int):
    model = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    model.model.layers[1].requires_grad_(False)
    engine = engine_for(model, case["stage"], case["bf16"])
    for i in range(2):
        step(engine, 100 * i + rank)
    engine.save_checkpoint(case["out"])
    dist.barrier()
    if rank == 0:
        if case["stage"] == 0:
            expected = zero0_expected(engine)
        else:
            with contextlib.redirect_stdout(io.StringIO()):
                expected = get_fp32_state_dict_from_zero_checkpoint(case["out"])
        torch.save({k: v.contiguous() for k, v in expected.items()}, results / f"{case['name']}.expected.pt")
    dist.barrier()


def load(case: dict, hf: str, results: Path, rank: int):
    torch.manual_seed(1234)  # weights unlike the checkpoint's, so a load that did nothing shows
    cfg = transformers.AutoConfig.from_pretrained(hf)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float()
    engine = engine_for(model, case["stage"], case["bf16"])
    path, _ = engine.load_checkpoint(case["ckpt"], load_module_only=True)
    dtype = torch.bfloat16 if case["bf16"] else torch.float32
    reference = transformers.AutoModelForCausalLM.from_pretrained(case["reference_hf"], dtype=torch.float32)
    reference = reference.to(dtype).eval()
    engine.eval()
    weights = reference.state_dict()
    weight_diff = max((t.float() - weights[n].float()).abs().max().item()
                      for n, t in engine.module.state_dict().items())
    with torch.no_grad():
        got, want = engine(input_ids=IDS).logits, reference(input_ids=IDS).logits
    engine.train()
    loss = step(engine, rank)
    dist.barrier()
    if rank == 0:
        result = {"loaded": path is not None, "max_weight_diff": weight_diff,
                  "max_abs_diff": (got.float() - want.float()).abs().max().item(),
                  "step_loss_finite": math.isfinite(loss)}
        (results / f"{case['name']}.json").write_text(json.dumps(result))
    dist.barrier()


def main():
    cases = json.loads(Path(sys.argv[1]).read_text())
    deepspeed.init_distributed(dist_backend="gloo", timeout=timedelta(seconds=120))
    rank = dist.get_rank()
    results = Path(cases["results"])
    for case in cases["train"]:
        train(case, cases["hf"], results, rank)
    for case in cases["load"]:
        load(case, cases["hf"], results, rank)
    if rank == 0:
        for case in cases["zero_to_fp32"]:
            with contextlib.redirect_stdout(io.StringIO()):
                torch.save(get_fp32_state_dict_from_zero_checkpoint(case["ckpt"]), case["out"])
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
