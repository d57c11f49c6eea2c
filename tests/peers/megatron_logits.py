"""torchrun worker: load qlm-written legacy checkpoints into REAL megatron-core at their TP/PP and compare the
logits with transformers' (saved by the test). Run as: torchrun --nproc-per-node N megatron_logits.py CASES.json

Each case: {"ckpt": dir, "ids": file, "expected": file, "result": file}. Megatron runs on CPU with the small
monkeypatches docs/ARCHITECTURE.md §7 lists.
"""

import argparse
import json
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

torch.cuda.current_device = lambda: "cpu"
torch.Tensor.cuda = lambda self, *a, **k: self  # tied embeddings with PP>1 call .cuda() during setup


def _cpu_sliding_window_mask(sq, skv, window_size):
    """megatron.core.transformer.utils.get_sliding_window_causal_mask (its rule, unchanged) made on the CPU: the
    original asks for device="cuda"."""
    ones = torch.ones(sq, skv, dtype=torch.bool)
    return ~torch.tril(torch.triu(ones, diagonal=skv - sq - window_size[0]), diagonal=skv - sq + window_size[1])


def _patch_sliding_window_mask():
    import megatron.core.fusions.fused_softmax as fused_softmax
    import megatron.core.transformer.utils as utils

    utils.get_sliding_window_causal_mask = fused_softmax.get_sliding_window_causal_mask = _cpu_sliding_window_mask


def _activation(args):
    """megatron-core's activation_func of the args: SwiGLU's silu, gpt-oss's quick GELU (--quick-geglu), qlm's ReLU
    (OPT), else Megatron's GELU."""
    if getattr(args, "quick_geglu", False):
        from megatron.core.fusions.fused_bias_geglu import quick_gelu

        return quick_gelu
    if getattr(args, "swiglu", True):
        return torch.nn.functional.silu
    return torch.nn.functional.relu if getattr(args, "qlm_relu", False) else torch.nn.functional.gelu


def position_offset(args) -> int:
    """Learned positions' rows before position 0 (OPT's 2: qlm_position_offset)."""
    return getattr(args, "qlm_position_offset", 0) or 0


def transformer_config(args, **extra):
    """megatron-core's TransformerConfig of a checkpoint's Megatron-LM args, for CPU (no fusions, no dropout);
    `extra` adds fields (the MoE ones). Multi-latent attention's args give its MLATransformerConfig."""
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig

    config_class = TransformerConfig
    if getattr(args, "multi_latent_attention", False):
        config_class = MLATransformerConfig
        extra = dict(extra, q_lora_rank=args.q_lora_rank, kv_lora_rank=args.kv_lora_rank, qk_head_dim=args.qk_head_dim,
                     qk_pos_emb_head_dim=args.qk_pos_emb_head_dim, v_head_dim=args.v_head_dim,
                     rope_type=args.rope_type, rotary_base=args.rotary_base)
        if args.rope_type == "yarn":
            extra.update({key: getattr(args, key) for key in (
                "rotary_scaling_factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
                "mscale_all_dim")})
    if getattr(args, "position_embedding_type", None) == "yarn":  # grouped-query attention's YaRN (gpt-oss)
        yarn = {"yarn_rotary_scaling_factor": args.rotary_scaling_factor,
                "yarn_original_max_position_embeddings": args.yarn_original_max_position_embeddings,
                "yarn_beta_fast": args.yarn_beta_fast, "yarn_beta_slow": args.yarn_beta_slow,
                "yarn_mscale": args.mscale, "yarn_mscale_all_dim": args.mscale_all_dim,
                "yarn_correction_range_round_to_int": args.yarn_correction_range_round_to_int}
        config = transformer_config(argparse.Namespace(**{**vars(args), "position_embedding_type": "rope"}), **extra)
        for key, value in yarn.items():  # fields GPTModel and the attention read with getattr
            setattr(config, key, value)
        return config
    return config_class(
        num_layers=args.num_layers, hidden_size=args.hidden_size, ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads, num_query_groups=args.num_query_groups,
        kv_channels=args.kv_channels, add_bias_linear=getattr(args, "add_bias_linear", False),
        add_qkv_bias=args.add_qkv_bias,
        gated_linear_unit=bool(getattr(args, "swiglu", True) or getattr(args, "quick_geglu", False)),
        glu_linear_offset=getattr(args, "glu_linear_offset", 0.0),
        activation_func_clamp_value=getattr(args, "activation_func_clamp_value", None),
        softmax_type=getattr(args, "softmax_type", "vanilla"),
        activation_func=_activation(args), normalization=getattr(args, "normalization", "RMSNorm"),
        layernorm_epsilon=args.norm_epsilon, tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size, pipeline_dtype=torch.float32,
        num_layers_in_first_pipeline_stage=getattr(args, "decoder_first_pipeline_num_layers", None),
        num_layers_in_last_pipeline_stage=getattr(args, "decoder_last_pipeline_num_layers", None),
        use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0, bias_activation_fusion=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, persist_layer_norm=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, window_size=getattr(args, "window_size", None),
        window_attn_skip_freq=getattr(args, "window_attn_skip_freq", None),
        rotary_interleaved=getattr(args, "rotary_interleaved", False), **extra,
    )


def forward(model, args, ids, pre, post):
    """The pipeline stage's forward of `ids` (receiving / sending hidden states between stages): the logits on the
    last stage's TP rank 0, else None."""
    from megatron.core import parallel_state as ps

    b, s = ids.shape
    position_ids = torch.arange(s)[None].expand(b, s) + position_offset(args)
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


def run_cases(run_case):
    """A worker's main: every case of the JSON file argv[1], in one gloo process group."""
    dist.init_process_group("gloo", timeout=timedelta(seconds=180))
    _patch_sliding_window_mask()
    for case in json.loads(open(sys.argv[1]).read()):
        run_case(case)
    dist.barrier()
    dist.destroy_process_group()


def build_model(args, pre, post):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    config = transformer_config(args)
    normalization = getattr(args, "normalization", "RMSNorm")
    return GPTModel(
        config, get_gpt_layer_local_spec(normalization=normalization), vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings + position_offset(args), pre_process=pre, post_process=post,
        position_embedding_type=getattr(args, "position_embedding_type", "rope"), rotary_base=args.rotary_base,
        rope_scaling=args.use_rope_scaling,
        rope_scaling_factor=args.rope_scaling_factor, rotary_percent=getattr(args, "rotary_percent", 1.0),
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights, parallel_output=False,
    ).eval()


def run_case(case):
    from pathlib import Path

    import megatron.core  # noqa: F401  registers Megatron's safe globals (argparse.Namespace, ...)
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    from qlm_core.checkpoint.formats.megatron.legacy import SHARD_FILE, resolve_iteration_dir, shard_dir_name

    iteration_dir, _ = resolve_iteration_dir(Path(case["ckpt"]))
    peek = torch.load(next(iteration_dir.glob(f"mp_rank_*/{SHARD_FILE}")), weights_only=True, map_location="cpu")
    args = peek["args"]
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    ps.initialize_model_parallel(tp, pp)
    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    tp_rank, pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    file = iteration_dir / shard_dir_name(tp_rank, pp_rank, pp) / SHARD_FILE
    # Plain torch.load with weights_only=True, as Megatron-LM loads it, once megatron.core is imported.
    state = torch.load(file, weights_only=True, map_location="cpu")
    pre, post = pp_rank == 0, pp_rank == pp - 1
    model = build_model(args, pre, post)
    model.load_state_dict(state["model"], strict=True)

    logits = forward(model, args, torch.load(case["ids"], weights_only=True), pre, post)
    if logits is not None:
        expected = torch.load(case["expected"], weights_only=True)
        logits = logits[..., : expected.shape[-1]]
        diff = (logits - expected).abs().max().item()
        Path(case["result"]).write_text(json.dumps({"max_abs_diff": diff, "shape": list(logits.shape)}))
    dist.barrier()
    ps.destroy_model_parallel()


if __name__ == "__main__":
    run_cases(run_case)
