"""MoE routing replay (R3) in an RL step: how many routes the trainer's routers choose otherwise than the rollout's,
what that does to the train/rollout log-prob difference, and what recording and replaying the routes cost, each
against a baseline run in the same process:

  1. decoding with routes recorded against decoding without (the same prompts, weights and seed);
  2. the trainer's forward + backward with the routes replayed against the same step routing by its own routers;
  3. per dtype (fp32, bf16): moe_route_mismatch and train_rollout_logprob_abs_diff mean / max, replayed and not.

    python bench/routing_replay.py                   # Qwen3-MoE-like: hidden 256, 4 layers, 16 experts top 4
    python bench/routing_replay.py --prompts 8 --new-tokens 64

A random-init model (std 0.2, so that routers have opinions); 16 prompts x 8 completions of up to 32 tokens,
temperature 1, this CPU. Nothing is asserted (timings vary); it prints a table and writes it as JSON (--out).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from qlm_core.config import OptimConfig, ParallelConfig
from qlm_core.decode.sampling import Sampling, generate_rows, left_pad
from qlm_core.models.moe_spec import MoeSpec
from qlm_core.models.spec import ModelSpec
from qlm_core.parallel.state import Grid
from qlm_core.train.engine import Engine
from qlm_core.train.objectives.grpo import GrpoObjective
from qlm_core.train.objectives.grpo_loss import GrpoLoss
from qlm_core.train.rewards import Rewards, RewardSource
from qlm_core.train.rollouts import RolloutConfig, rollout


def model_spec(args) -> ModelSpec:
    return ModelSpec(model_type="qwen3_moe", vocab_size=1024, hidden_size=args.hidden, ffn_hidden_size=4 * args.hidden,
                     num_layers=args.layers, num_attention_heads=8, num_query_groups=4, kv_channels=args.hidden // 8,
                     max_position_embeddings=4096, rope_theta=10000.0, norm_epsilon=1e-6, qkv_bias=False,
                     tie_word_embeddings=False, qk_layernorm=True,
                     moe=MoeSpec(num_experts=args.experts, topk=args.topk, ffn_hidden_size=args.hidden // 2))


def engine_for(args, dtype: torch.dtype) -> Engine:
    rows = args.prompts * args.generations
    loss = GrpoLoss(loss_type="dapo", max_completion_length=args.new_tokens)
    engine = Engine(model_spec(args), ParallelConfig(), Grid.single(), micro_batch_size=rows, global_batch_size=rows,
                    seq_length=args.prompt_tokens + args.new_tokens, dtype=dtype, optim=OptimConfig(lr=0.0), seed=3,
                    objective=GrpoObjective(loss, routing_replay=True))
    with torch.no_grad():
        engine.chunks[0].reset_parameters(std=0.2, generator=torch.Generator().manual_seed(5))
    return engine


def set_replay(engine: Engine, replay: bool) -> None:
    for chunk in engine.chunks:
        chunk.moe.tracker.replay = replay


def prompts_of(args) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(8, 1024, (args.prompt_tokens - (i % 4),), generator=g).tolist() for i in range(args.prompts)]


def timed(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def decode_cost(args, engine: Engine) -> dict[str, float]:
    model = engine.chunks[0]
    rows = [p for p in prompts_of(args) for _ in range(args.generations)]
    ids, mask = left_pad(rows, 0)

    def decode(record: bool):
        return lambda: generate_rows(model, ids, mask, max_new_tokens=args.new_tokens, eos_token_id=None,
                                     sampling=Sampling(temperature=1.0, seed=1), record_routes=record)
    plain, recorded = timed(decode(False), args.repeats), timed(decode(True), args.repeats)
    return {"decode_s": plain, "decode_recorded_s": recorded, "decode_ratio": recorded / plain}


def agreement(args, dtype: torch.dtype) -> dict[str, float]:
    engine = engine_for(args, dtype)
    config = RolloutConfig(num_generations=args.generations, max_completion_length=args.new_tokens,
                           sampling=Sampling(temperature=1.0, seed=7))
    prompts = prompts_of(args)
    batch, _ = rollout(engine.chunks[0], prompts, [{"prompt": ""}] * len(prompts), config,
                       Rewards([RewardSource("think_format")]), str, seq_length=engine.seq_length, eos_token_id=None,
                       pad_id=0)
    out = {}
    for replay in (False, True):
        set_replay(engine, replay)
        engine.forward_backward(batch)
        figures, moe = engine.objective.figures(), engine.moe_step_figures()
        tag = "replayed" if replay else "own"
        out[f"mismatch_{tag}"] = moe["moe_route_mismatch"]
        out[f"logprob_diff_mean_{tag}"] = figures["train_rollout_logprob_abs_diff/mean"]
        out[f"logprob_diff_max_{tag}"] = figures["train_rollout_logprob_abs_diff/max"]
        out[f"step_{tag}_s"] = timed(lambda: engine.forward_backward(batch), args.repeats)
    out["step_ratio"] = out["step_replayed_s"] / out["step_own_s"]
    if dtype == torch.float32:
        out.update(decode_cost(args, engine))
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--topk", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("routing_replay.json"))
    args = parser.parse_args()
    results = {name: agreement(args, dtype) for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16))}
    print(f"{'':6} {'routes differing':>17} {'|dlogp| mean own':>17} {'replayed':>10} {'max own':>9} {'replayed':>10}")
    for name, r in results.items():
        print(f"{name:6} {r['mismatch_own']:17.4%} {r['logprob_diff_mean_own']:17.2e} "
              f"{r['logprob_diff_mean_replayed']:10.2e} {r['logprob_diff_max_own']:9.2e} "
              f"{r['logprob_diff_max_replayed']:10.2e}")
    fp32 = results["fp32"]
    print(f"decoding, routes recorded vs not: {fp32['decode_recorded_s']:.3f} s vs {fp32['decode_s']:.3f} s "
          f"({fp32['decode_ratio']:.3f}x)")
    for name, r in results.items():
        print(f"{name} trainer step, routes replayed vs own: {r['step_replayed_s']:.3f} s vs {r['step_own_s']:.3f} s "
              f"({r['step_ratio']:.3f}x)")
    args.out.write_text(json.dumps(results, indent=2))
    print(f"written {args.out}")


if __name__ == "__main__":
    main()
