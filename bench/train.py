"""Training throughput of qlm's engine (one process) against a plain transformers Qwen2ForCausalLM + torch AdamW
loop on the same model shape, initial weights and batches, measured in the same run.

    python bench/train.py                     # hidden 512, 8 layers, seq 256, batch 8, fp32, CPU
    python bench/train.py --steps 20 --hidden 768 --layers 12

Steps of the two alternate, so that machine drift affects both alike. Prints tokens/s of each and the ratio
qlm / transformers (target >= 1.0), and the losses of both (same weights and batches: they must agree).
"""

from __future__ import annotations

import argparse
import time

import torch

from qlm_core.checkpoint.sources.random_init import RandomInitSource
from qlm_core.config import OptimConfig, ParallelConfig
from qlm_core.models.layout import ModelLayout, assemble_hf_tensor
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


def timed_alternating(steps: dict, count: int, warmup: int) -> tuple[dict, dict]:
    """Run the contenders' steps alternately (so machine drift hits both alike); seconds and losses of each."""
    seconds = {name: 0.0 for name in steps}
    losses = {name: [] for name in steps}
    for index in range(warmup + count):
        for name, run_step in steps.items():
            start = time.perf_counter()
            losses[name].append(run_step())
            if index >= warmup:
                seconds[name] += time.perf_counter() - start
    return seconds, losses


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
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
    engine = Engine(spec, ParallelConfig(), Grid.single(), micro_batch_size=args.batch,
                    global_batch_size=args.batch, seq_length=args.seq, optim=optim, seed=1)
    qlm_iter = iter(batches)

    def hf_step():
        tokens = next(hf_iter)
        loss = torch.nn.functional.cross_entropy(model(tokens[:, :-1]).logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), optim.clip_grad)
        adamw.step()
        adamw.zero_grad(set_to_none=True)
        return loss.item()

    def qlm_step():
        tokens = next(qlm_iter)
        return engine.train_step(Batch(tokens[:, :-1], tokens[:, 1:])).loss

    seconds, losses = timed_alternating({"hf": hf_step, "qlm": qlm_step}, args.steps, args.warmup)
    hf_seconds, qlm_seconds = seconds["hf"], seconds["qlm"]
    hf_losses, qlm_losses = losses["hf"], losses["qlm"]
    tokens = args.steps * args.batch * args.seq
    print(f"model: {spec.num_parameters() / 1e6:.1f}M parameters, seq {args.seq}, batch {args.batch}, fp32, "
          f"{torch.get_num_threads()} threads, {args.steps} timed steps after {args.warmup} warm-up")
    print(f"  transformers + AdamW  {tokens / hf_seconds:10.0f} tokens/s")
    print(f"  qlm engine            {tokens / qlm_seconds:10.0f} tokens/s")
    print(f"  ratio qlm / transformers = {hf_seconds / qlm_seconds:.2f}  (target >= 1.0)")
    print(f"  same losses: first {hf_losses[0]:.5f} vs {qlm_losses[0]:.5f}, "
          f"last {hf_losses[-1]:.5f} vs {qlm_losses[-1]:.5f}")


if __name__ == "__main__":
    main()
