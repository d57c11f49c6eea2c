"""torchrun worker: REAL megatron-core builds the MoE (and Qwen3) GPTModel of a qlm checkpoint (local spec,
SequentialMLP experts, allgather dispatcher, shared expert + gate, q/k layernorm), loads qlm's files strictly and
compares its logits with transformers' (saved by the test).

Run as: torchrun --nproc-per-node TP*PP megatron_moe_worker.py CASES.json
Each case: {"ckpt", "format" ("torch": legacy files at their own TP/PP; "torch_dist": loaded with
dist_checkpointing at "tp" x "pp", strict RAISE_ALL), "ids", "expected", "result"}. CPU monkeypatches as for the
dense peers, plus `te_general_gemm`, which megatron-core 0.16.1's router names without importing it when
Transformer Engine is absent.
"""

import argparse
import json
import math
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

torch.cuda.current_device = lambda: "cpu"
torch.cuda.synchronize = lambda *a, **k: None
torch.Tensor.cuda = lambda self, *a, **k: self  # tied embeddings with PP>1 (and the router) call .cuda()


def build_model(args, pre, post):
    import megatron.core.transformer.moe.moe_utils as moe_utils
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    moe_utils.te_general_gemm = getattr(moe_utils, "te_general_gemm", None)
    experts = getattr(args, "num_experts", None)
    moe = dict(
        num_moe_experts=experts, moe_router_topk=args.moe_router_topk, moe_ffn_hidden_size=args.moe_ffn_hidden_size,
        moe_shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size,
        moe_shared_expert_gate=args.moe_shared_expert_gate, moe_router_pre_softmax=args.moe_router_pre_softmax,
        moe_router_score_function=args.moe_router_score_function, moe_layer_freq=args.moe_layer_freq,
        moe_token_dispatcher_type="allgather", moe_grouped_gemm=False, moe_aux_loss_coeff=0.0,
    ) if experts else {}
    config = TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads, num_query_groups=args.num_query_groups,
        kv_channels=args.kv_channels, add_bias_linear=False, add_qkv_bias=args.add_qkv_bias,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, normalization="RMSNorm",
        layernorm_epsilon=args.norm_epsilon, tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size, pipeline_dtype=torch.float32,
        qk_layernorm=args.qk_layernorm, use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
        bias_activation_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
        masked_softmax_fusion=False, gradient_accumulation_fusion=False, **moe,
    )
    if experts:
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    else:
        spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=args.qk_layernorm)
    return GPTModel(
        config, spec, vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
        pre_process=pre, post_process=post, position_embedding_type="rope", rotary_base=args.rotary_base,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights, parallel_output=False,
    ).eval()


def forward(model, args, ids, pre, post):
    from megatron.core import parallel_state as ps

    b, s = ids.shape
    position_ids = torch.arange(s)[None].expand(b, s)
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)[None, None]
    with torch.no_grad():
        if not pre:
            hidden = torch.empty(s, b, args.hidden_size)
            dist.recv(hidden, src=ps.get_pipeline_model_parallel_prev_rank())
            model.set_input_tensor(hidden)
        out = model(ids if pre else None, position_ids, mask)
        if not post:
            dist.send(out.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
            return None
        return out if ps.get_tensor_model_parallel_rank() == 0 else None


def open_case(case):
    """(args, the model's state_dict loader) for a legacy or a torch_dist case."""
    from qlm_core.checkpoint.formats.megatron_legacy import SHARD_FILE, resolve_iteration_dir, shard_dir_name
    from qlm_core.checkpoint.formats.torch_dist_files import resolve_dist_dir

    if case["format"] == "torch":
        import megatron.core  # noqa: F401  registers Megatron's safe globals (argparse.Namespace, ...)

        iteration_dir, _ = resolve_iteration_dir(Path(case["ckpt"]))
        peek = torch.load(next(iteration_dir.glob(f"mp_rank_*/{SHARD_FILE}")), weights_only=True, map_location="cpu")

        def state(model, tp_rank, pp_rank):
            file = iteration_dir / shard_dir_name(tp_rank, pp_rank, peek["args"].pipeline_model_parallel_size)
            return torch.load(file / SHARD_FILE, weights_only=True, map_location="cpu")["model"]

        return peek["args"], state
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    iteration_dir, _ = resolve_dist_dir(Path(case["ckpt"]))
    args = argparse.Namespace(**vars(dist_checkpointing.load_common_state_dict(str(iteration_dir))["args"]))
    multiple = (args.make_vocab_size_divisible_by or 128) * case["tp"]
    args.padded_vocab_size = math.ceil(args.vocab_size / multiple) * multiple
    args.tensor_model_parallel_size, args.pipeline_model_parallel_size = case["tp"], case["pp"]

    def state(model, tp_rank, pp_rank):
        # megatron-core's words: "unexpected" = asked for but not in the checkpoint, "missing" = in the checkpoint
        # but not asked for. Nothing may be unexpected; the one key the local spec leaves is the Transformer-Engine
        # spec's spelling of an MoE layer's pre_mlp_layernorm, written beside the local spec's for that spec
        loaded, missing, unexpected = dist_checkpointing.load(
            {"model": model.sharded_state_dict()}, str(iteration_dir), strict=StrictHandling.RETURN_ALL)
        assert not unexpected, sorted(unexpected)
        assert all(key.endswith("pre_mlp_layernorm.weight") for key in missing), sorted(missing)
        return loaded["model"]

    return args, state


def run_case(case):
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    args, state = open_case(case)
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    ps.initialize_model_parallel(tp, pp)
    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    tp_rank, pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    pre, post = pp_rank == 0, pp_rank == pp - 1
    model = build_model(args, pre, post)
    model.load_state_dict(state(model, tp_rank, pp_rank), strict=True)  # every key, every shape
    logits = forward(model, args, torch.load(case["ids"], weights_only=True), pre, post)
    if logits is not None:
        expected = torch.load(case["expected"], weights_only=True)
        diff = (logits[..., : expected.shape[-1]] - expected).abs().max().item()
        Path(case["result"]).write_text(json.dumps({"max_abs_diff": diff, "shape": list(logits.shape)}))
    dist.barrier()
    ps.destroy_model_parallel()


def main():
    dist.init_process_group("gloo", timeout=timedelta(seconds=180))
    for case in json.loads(Path(sys.argv[1]).read_text()):
        run_case(case)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
