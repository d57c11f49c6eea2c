"""Training throughput of qlm's engine (one process) against a plain transformers Qwen2ForCausalLM + torch AdamW
loop on the same model shape, initial weights and batches, measured in the same run.

    python bench/train.py                     # hidden 512, 8 layers, seq 256, batch 8, CPU
    python bench/train.py --steps 20 --hidden 768 --layers 12
    python bench/train.py --bf16 on           # the bf16 contenders even on a CPU without bf16 instructions

Contenders: the transformers loop (fp32, eager: the baseline), qlm fp32 eager and compiled (train.compile), and
qlm with bf16 compute on fp32 master weights, eager and compiled (by default only where the CPU has bf16 matmul
instructions: without them torch's bf16 GEMM fallback is several times slower than fp32, which the printed matmul
probe shows; on an AVX2-only CPU one bf16 step of the default shape takes minutes). Their steps alternate, so that
machine drift affects all alike. Prints tokens/s of each, the ratios qlm / transformers in fp32 (target >= 1.2
compiled), bf16 / fp32, each compiled contender's compile cost (its first step less a timed step's mean) and the
losses (fp32: the same weights and batches, they must agree with the transformers loop; bf16 within its rounding).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from qlm_core.checkpoint.sources.random_init import RandomInitSource
from qlm_core.config import OptimConfig, ParallelConfig
from qlm_core.models.layout import ModelLayout, assemble_hf_tensor
from qlm_core.models.parameters import num_parameters
from qlm_core.models.spec import ModelSpec
from qlm_core.parallel.state import Grid
from qlm_core.train.engine import Batch, Engine


def make_spec(args) -> ModelSpec:
    return ModelSpec(
        model_type="qwen2", vocab_size=args.vocab, hidden_size=args.hidden, ffn_hidden_size=args.hidden * 11 // 4,
        num_layers=args.layers, num_attention_heads=args.hidden // 64, num_query_groups=max(args.hidden // 256, 1),
        kv_channels=64, max_position_embeddings=4096, rope_theta=1e6, norm_epsilon=1e-6, qkv_bias=True,
        tie_word_embeddings=False,
    )


def transformers_model(spec: ModelSpec, seed: int):
    """Qwen2ForCausalLM with exactly the weights qlm's engine starts from."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**{k: v for k, v in spec.to_hf_config("float32").items() if k != "architectures"})
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    layout = ModelLayout(spec, make_vocab_size_divisible_by=1)
    source = RandomInitSource(layout, seed=seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(assemble_hf_tensor(layout, name, source))
    return model


def timed_alternating(steps: dict, count: int, warmup: int) -> tuple[dict, dict, dict]:
    """Run the contenders' steps alternately (so machine drift hits all alike): the timed steps' seconds, the first
    step's seconds and the losses of each."""
    seconds = {name: 0.0 for name in steps}
    first = {}
    losses = {name: [] for name in steps}
    for index in range(warmup + count):
        for name, run_step in steps.items():
            start = time.perf_counter()
            losses[name].append(run_step())
            elapsed = time.perf_counter() - start
            print(f"  step {index + 1}/{warmup + count} {name}: {elapsed:.2f} s", file=sys.stderr, flush=True)
            first.setdefault(name, elapsed)
            if index >= warmup:
                seconds[name] += elapsed
    return seconds, first, losses


def engine_step(spec: ModelSpec, args, optim: OptimConfig, batches: list, dtype: torch.dtype, compile: bool):
    engine = Engine(spec, ParallelConfig(), Grid.single(), micro_batch_size=args.batch, global_batch_size=args.batch,
                    seq_length=args.seq, dtype=dtype, optim=optim, seed=1, compile=compile)
    batch_iter = iter(batches)

    def step():
        tokens = next(batch_iter)
        return engine.train_step(Batch(tokens[:, :-1], tokens[:, 1:])).loss

    return step


def native_bf16() -> bool:
    """Whether this CPU has bf16 matmul instructions (AVX512-BF16 or AMX) that oneDNN uses for bf16 GEMMs."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def bf16_matmul_ratio(args) -> float:
    """bf16 over fp32 time of one MLP-shaped matmul, best of 3 each."""
    def best(dtype) -> float:
        a = torch.randn(args.batch * args.seq, args.hidden, dtype=dtype)
        b = torch.randn(args.hidden * 11 // 4, args.hidden, dtype=dtype)
        a @ b.t()
        times = []
        for _ in range(3):
            start = time.perf_counter()
            a @ b.t()
            times.append(time.perf_counter() - start)
        return min(times)

    return best(torch.bfloat16) / best(torch.float32)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--bf16", choices=("auto", "on", "off"), default="auto",
                        help="the bf16 contenders; auto: where the CPU has bf16 matmul instructions (avx512_bf16, amx)")
    args = parser.parse_args()
    spec = make_spec(args)
    generator = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, spec.vocab_size, (args.batch, args.seq + 1), generator=generator)
               for _ in range(args.steps + args.warmup)]
    optim = OptimConfig(lr=1e-4, weight_decay=0.1, clip_grad=1.0)

    model = transformers_model(spec, seed=1)
    adamw = torch.optim.AdamW(model.parameters(), lr=optim.lr, betas=(optim.beta1, optim.beta2), eps=optim.eps,
                              weight_decay=optim.weight_decay, foreach=True)
    hf_iter = iter(batches)

    def hf_step():
        tokens = next(hf_iter)
        loss = torch.nn.functional.cross_entropy(model(tokens[:, :-1]).logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), optim.clip_grad)
        adamw.step()
        adamw.zero_grad(set_to_none=True)
        return loss.item()

    native, matmul_ratio = native_bf16(), bf16_matmul_ratio(args)
    with_bf16 = args.bf16 == "on" or (args.bf16 == "auto" and native)
    steps = {"hf": hf_step}
    for dtype_name, dtype in (("fp32", torch.float32),) + ((("bf16", torch.bfloat16),) if with_bf16 else ()):
        for compile in (False, True):
            name = f"qlm {dtype_name} {'compiled' if compile else 'eager'}"
            steps[name] = engine_step(spec, args, optim, batches, dtype, compile)
    seconds, first, losses = timed_alternating(steps, args.steps, args.warmup)
    tokens = args.steps * args.batch * args.seq
    print(f"model: {num_parameters(spec) / 1e6:.1f}M parameters, seq {args.seq}, batch {args.batch}, "
          f"{torch.get_num_threads()} threads, {args.steps} timed steps after {args.warmup} warm-up")
    print(f"  {'transformers + AdamW fp32':26s} {tokens / seconds['hf']:10.0f} tokens/s")
    for name in steps:
        if name != "hf":
            print(f"  {name:26s} {tokens / seconds[name]:10.0f} tokens/s  ratio / transformers "
                  f"{seconds['hf'] / seconds[name]:.2f}")
    print(f"  ratio qlm fp32 compiled / transformers = {seconds['hf'] / seconds['qlm fp32 compiled']:.2f}  "
          f"(target >= 1.2; eager {seconds['hf'] / seconds['qlm fp32 eager']:.2f})")
    print(f"  bf16 matmul ([tokens, hidden] x [hidden, ffn]) / fp32 time on this CPU: {matmul_ratio:.2f}x "
          f"({'has' if native else 'no'} bf16 matmul instructions)")
    if with_bf16:
        for mode in ("eager", "compiled"):
            print(f"  bf16 / fp32 {mode} tokens/s: {seconds[f'qlm fp32 {mode}'] / seconds[f'qlm bf16 {mode}']:.2f}")
    else:
        print("  bf16 training left out: without bf16 instructions torch runs bf16 matmuls in a slow fallback "
              "(--bf16 on measures it anyway)")
    for name in steps:
        if name.endswith("compiled"):
            cost = first[name] - seconds[name] / args.steps
            print(f"  compile cost {name}: {cost:.1f} s (first step {first[name]:.1f} s)")
    for name in steps:
        print(f"  losses {name:26s} first {losses[name][0]:.5f} last {losses[name][-1]:.5f}")
    for name in ("qlm fp32 eager", "qlm fp32 compiled"):
        agree = all(abs(a - b) <= 1e-3 * abs(b) for a, b in zip(losses[name], losses["hf"], strict=True))
        print(f"  same losses as transformers ({name}, rel 1e-3 every step): {agree}")


if __name__ == "__main__":
    main()
