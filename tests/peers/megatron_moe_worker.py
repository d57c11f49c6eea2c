"""torchrun worker: REAL megatron-core builds the MoE (and Qwen3) GPTModel of a qlm checkpoint (local spec,
SequentialMLP experts, allgather dispatcher, shared expert + gate, q/k layernorm), loads qlm's files strictly and
compares its logits with transformers' (saved by the test).

Run as: torchrun --nproc-per-node TP*PP megatron_moe_worker.py CASES.json
Each case: {"ckpt", "format" ("torch": legacy files at their own TP/PP/EP; "torch_dist": loaded with
dist_checkpointing at "tp" x "pp", nothing asked for absent), "ids", "expected", "result"}, and optionally
"sequence_parallel" and "ranks" (a path with "{rank}"): each global rank then writes there, before its strict load,
megatron-core's own TP / EP / expert-TP ranks, the legacy folder qlm named for them, every key whose presence or
shape differs between megatron-core's state_dict() and that file (_extra_state aside), and, after the load, the
routed-expert tensors the model holds. CPU patches as for the dense peers (peers/megatron_logits.py), plus
`te_general_gemm`, which megatron-core 0.16.1's router names without importing it when Transformer Engine is absent.
"""

import argparse
import copy
import json
import math
from pathlib import Path

import torch
import torch.distributed as dist

from peers.megatron_logits import forward, run_cases, transformer_config  # and its module-level CPU patches

torch.cuda.synchronize = lambda *a, **k: None  # dist_checkpointing


def _sequence_parallel_torch_norm():
    """megatron-core's local-spec norm (torch RMSNorm, no Apex / TE here) refuses sequence_parallel, which only
    changes which tokens a rank normalizes (and, in training, all-reduces the norm's gradient): build it from a
    copy of the config with the flag off. Nothing changes for a config without sequence parallelism."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    build = WrappedTorchNorm.__new__

    def new(cls, config, *args, **kwargs):
        if config.sequence_parallel:
            config = copy.copy(config)
            config.sequence_parallel = False
        return build(cls, config, *args, **kwargs)

    WrappedTorchNorm.__new__ = staticmethod(new)


_sequence_parallel_torch_norm()


class _PlainCoreAttention(torch.nn.Module):
    """Causal softmax(q k^T * scale) v for multi-latent attention's local spec: megatron-core 0.16.1's local
    DotProductAttention takes no separate key and value sizes (only Transformer Engine's does), so the peer swaps in
    this plain kernel; every weight and projection stays megatron-core's."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, softmax_scale=None, k_channels=None,
                 v_channels=None, cp_comm_type=None, pg_collection=None):
        super().__init__()
        self.scale = softmax_scale

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [s, b, heads, d] -> [b, heads, s, d]
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        return out.permute(2, 0, 1, 3).reshape(out.shape[2], out.shape[0], -1)


def build_model(args, pre, post, sequence_parallel=False):
    import megatron.core.transformer.moe.moe_utils as moe_utils
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec

    moe_utils.te_general_gemm = getattr(moe_utils, "te_general_gemm", None)
    experts = getattr(args, "num_experts", None)
    moe = dict(
        num_moe_experts=experts, moe_router_topk=args.moe_router_topk, moe_ffn_hidden_size=args.moe_ffn_hidden_size,
        moe_shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size,
        moe_shared_expert_gate=args.moe_shared_expert_gate, moe_router_pre_softmax=args.moe_router_pre_softmax,
        moe_router_score_function=args.moe_router_score_function, moe_layer_freq=args.moe_layer_freq,
        moe_router_enable_expert_bias=getattr(args, "moe_router_enable_expert_bias", False),
        moe_router_num_groups=getattr(args, "moe_router_num_groups", None),
        moe_router_group_topk=getattr(args, "moe_router_group_topk", None),
        moe_router_topk_scaling_factor=getattr(args, "moe_router_topk_scaling_factor", None),
        moe_token_dispatcher_type="allgather", moe_grouped_gemm=False, moe_aux_loss_coeff=0.0,
        expert_model_parallel_size=getattr(args, "expert_model_parallel_size", 1) or 1,
        expert_tensor_parallel_size=getattr(args, "expert_tensor_parallel_size", None),
    ) if experts else {}
    if sequence_parallel:
        moe["sequence_parallel"] = True
    mtp = getattr(args, "mtp_num_layers", None)
    if mtp:  # multi-token prediction, weighted 1 (MtpLoss reads back the mean over depths)
        moe.update(mtp_num_layers=mtp, mtp_loss_scaling_factor=1.0)
    config = transformer_config(args, qk_layernorm=args.qk_layernorm, **moe)
    if experts:
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
        if config.multi_latent_attention:
            import megatron.core.transformer.multi_latent_attention as mla_module

            # without Transformer Engine its TE names import as mock objects, which its fp8 check hands isinstance
            mla_module.HAVE_TE = mla_module.HAVE_TE and isinstance(mla_module.TELinear, type)
            for layer in spec.layer_specs:
                layer.submodules.self_attention.submodules.core_attention = _PlainCoreAttention
    else:
        spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=args.qk_layernorm)
    mtp_spec = None
    if mtp:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

        mtp_spec = get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False)
    return GPTModel(
        config, spec, vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
        pre_process=pre, post_process=post,
        position_embedding_type=getattr(args, "position_embedding_type", None) or "rope", rotary_base=args.rotary_base,
        rotary_percent=getattr(args, "rotary_percent", 1.0),
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        parallel_output=bool(mtp),  # logits gathered over TP; its loss (which MTP needs) takes them TP-split
        mtp_block_spec=mtp_spec,
    ).eval()


def open_case(case):
    """(args, the model's state_dict loader) for a legacy or a torch_dist case."""
    from qlm_core.checkpoint.formats.megatron.legacy import SHARD_FILE, resolve_iteration_dir, shard_dir_name
    from qlm_core.checkpoint.formats.megatron.torch_dist_files import resolve_dist_dir

    if case["format"] == "torch":
        import megatron.core  # noqa: F401  registers Megatron's safe globals (argparse.Namespace, ...)

        iteration_dir, _ = resolve_iteration_dir(Path(case["ckpt"]))
        peek = torch.load(next(iteration_dir.glob(f"mp_rank_*/{SHARD_FILE}")), weights_only=True, map_location="cpu")

        def state(model, tp_rank, pp_rank, ep_rank=0):
            args = peek["args"]
            file = iteration_dir / shard_dir_name(tp_rank, pp_rank, args.pipeline_model_parallel_size, ep_rank,
                                                  getattr(args, "expert_model_parallel_size", 1) or 1)
            return torch.load(file / SHARD_FILE, weights_only=True, map_location="cpu")["model"], file.name

        return peek["args"], state
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    iteration_dir, _ = resolve_dist_dir(Path(case["ckpt"]))
    args = argparse.Namespace(**vars(dist_checkpointing.load_common_state_dict(str(iteration_dir))["args"]))
    multiple = (args.make_vocab_size_divisible_by or 128) * case["tp"]
    args.padded_vocab_size = math.ceil(args.vocab_size / multiple) * multiple
    args.tensor_model_parallel_size, args.pipeline_model_parallel_size = case["tp"], case["pp"]
    # the load's, not the writer's (a case's "etp": expert biases load at expert-TP 1 only)
    args.expert_model_parallel_size, args.expert_tensor_parallel_size = 1, case.get("etp")

    def state(model, tp_rank, pp_rank, ep_rank=0):
        # megatron-core's words: "unexpected" = asked for but not in the checkpoint, "missing" = in the checkpoint
        # but not asked for. Nothing may be unexpected; the one key the local spec leaves is the Transformer-Engine
        # spec's spelling of an MoE layer's pre_mlp_layernorm, written beside the local spec's for that spec (with
        # multi-latent attention also its fused `layer_norm_weight` spellings of the latents' and dense layers' norms)
        loaded, missing, unexpected = dist_checkpointing.load(
            {"model": model.sharded_state_dict(metadata=_metadata())}, str(iteration_dir),
            strict=StrictHandling.RETURN_ALL)
        assert not unexpected, sorted(unexpected)
        other_spec = ("pre_mlp_layernorm.weight",) + (("layer_norm_weight",) if args.multi_latent_attention else ())
        assert all(key.endswith(other_spec) for key in missing), sorted(missing)
        return loaded["model"], None

    return args, state


def _metadata() -> dict:
    """sharded_state_dict's metadata: a last stage with multi-token prediction ties its copy of the embedding to the
    first stage's over the data-parallel group"""
    from megatron.core import parallel_state as ps

    return {"dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True)}


def report_ranks(path, model, weights, folder, tp_rank, pp_rank, ep_rank):
    """megatron-core's ranks, the folder qlm named for them and the keys whose presence or shape differs between
    the model's state_dict() and that file (_extra_state aside), to `path` (a torch file), before the load."""
    from megatron.core import parallel_state as ps

    def shapes(state):
        return {k: list(v.shape) for k, v in state.items() if not k.endswith("_extra_state")}

    ours, theirs = shapes(model.state_dict()), shapes(weights)
    torch.save({
        "tp_rank": tp_rank, "pp_rank": pp_rank, "ep_rank": ep_rank,
        "etp_rank": ps.get_expert_tensor_parallel_rank(), "sequence_parallel": model.config.sequence_parallel,
        "folder": folder, "keys": len(ours),
        "differ": sorted(k for k in ours.keys() | theirs.keys() if ours.get(k) != theirs.get(k)),
    }, path)


def report_experts(path, model):
    """After the strict load: the routed-expert tensors the model holds, added to `path`."""
    report = torch.load(path, weights_only=True)
    report["experts"] = {k: v.detach().clone() for k, v in model.state_dict().items()
                         if ".local_experts." in k and not k.endswith("_extra_state")}
    torch.save(report, path)


class MtpLoss:
    """megatron-core's multi-token prediction loss of a forward: its GPTModel hands each depth's mean token loss
    times mtp_loss_scaling_factor / depths to MTPLossAutoScaler.apply (which adds its gradient to the main loss's);
    with the factor at 1 their sum is the mean over depths of the depths' mean token losses."""

    def __enter__(self):
        from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

        self.cls, self.original, self.terms = MTPLossAutoScaler, MTPLossAutoScaler.apply, []
        MTPLossAutoScaler.apply = lambda output, loss: (self.terms.append(loss.sum().item()), output)[1]
        return self

    def __exit__(self, *exc):
        self.cls.apply = self.original


def forward_with_labels(model, args, ids, labels, pre, post):
    """A model with multi-token prediction takes the labels (its depths roll them) and the ids on its last stage
    too (it embeds the shifted tokens): the per-token loss [b, s] and the MTP loss on the last stage's TP rank 0."""
    from megatron.core import parallel_state as ps

    b, s = ids.shape
    position_ids = torch.arange(s)[None].expand(b, s)
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)[None, None]
    with torch.no_grad(), MtpLoss() as mtp:
        if not pre:
            hidden = torch.empty(s, b, args.hidden_size)
            dist.recv(hidden, src=ps.get_pipeline_model_parallel_prev_rank())
            model.set_input_tensor(hidden)
        out = model(ids, position_ids, mask, labels=labels if post else None)
        if not post:
            dist.send(out.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
            return None
    return (out, sum(mtp.terms)) if ps.get_tensor_model_parallel_rank() == 0 else None


def run_case(case):
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    args, state = open_case(case)
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    ep = getattr(args, "expert_model_parallel_size", 1) or 1
    ps.initialize_model_parallel(tp, pp, expert_model_parallel_size=ep,
                                 expert_tensor_parallel_size=getattr(args, "expert_tensor_parallel_size", None))
    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    tp_rank, pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    ep_rank = ps.get_expert_model_parallel_rank()  # megatron-core's own EP rank of this global rank
    pre, post = pp_rank == 0, pp_rank == pp - 1
    model = build_model(args, pre, post, case.get("sequence_parallel", False))
    weights, folder = state(model, tp_rank, pp_rank, ep_rank)
    if case.get("ranks"):
        report_ranks(case["ranks"].format(rank=dist.get_rank()), model, weights, folder, tp_rank, pp_rank, ep_rank)
    model.load_state_dict(weights, strict=True)  # every key, every shape
    if case.get("ranks"):
        report_experts(case["ranks"].format(rank=dist.get_rank()), model)
    ids = torch.load(case["ids"], weights_only=True)
    if getattr(args, "mtp_num_layers", None):
        labels = torch.load(case["labels"], weights_only=True)
        out = forward_with_labels(model, args, ids, labels, pre, post)
        if out is not None and ps.get_data_parallel_rank() == 0:  # one writer per case
            expected = torch.load(case["expected"], weights_only=True)  # per-token loss, then the MTP loss
            Path(case["result"]).write_text(json.dumps({
                "max_abs_diff": (out[0] - expected["loss"]).abs().max().item(), "shape": list(out[0].shape),
                "mtp_loss": out[1], "expected_mtp_loss": expected["mtp_loss"]}))
        dist.barrier()
        ps.destroy_model_parallel()
        return
    logits = forward(model, args, ids, pre, post)
    # one writer per case: with more ranks than TP x PP (TP2 x EP2 on 4) two data-parallel copies hold the logits
    if logits is not None and ps.get_data_parallel_rank() == 0:
        expected = torch.load(case["expected"], weights_only=True)
        diff = (logits[..., : expected.shape[-1]] - expected).abs().max().item()
        Path(case["result"]).write_text(json.dumps({"max_abs_diff": diff, "shape": list(logits.shape)}))
    dist.barrier()
    ps.destroy_model_parallel()


if __name__ == "__main__":
    run_cases(run_case)
