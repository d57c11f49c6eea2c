"""The layouts the parity suite checks against one process (shared by the pytest module and its torchrun worker)."""

from dataclasses import dataclass, field

import torch

from qlm_core.config import MoeConfig
from qlm_core.models.mla_spec import MlaSpec
from qlm_core.models.moe_spec import MoeSpec
from qlm_core.models.spec import LinearRopeScaling, ModelSpec, YarnScaling

# Tiny Qwen2: GQA (4 heads, 2 query groups) and qkv bias; vocabulary 300 exercises Megatron's padding.
SPEC = ModelSpec(
    model_type="qwen2", vocab_size=300, hidden_size=64, ffn_hidden_size=96, num_layers=4, num_attention_heads=4,
    num_query_groups=2, kv_channels=16, max_position_embeddings=256, rope_theta=10000.0, norm_epsilon=1e-6,
    qkv_bias=True, tie_word_embeddings=False,
)
SEQ, GLOBAL_BATCH, STEPS, WORLD = 32, 8, 3, 8  # 3 AdamW steps: the second and third see updated weights
EP_STEPS = 10  # expert-parallel cases run 10 steps (the bar for EP exactness)
# A sliding window shorter than the packed documents can be, on layers 0 and 2 only (local and global layers, as
# Qwen2's layer_types or Megatron's window_attn_skip_freq say): the windowed cases' model
WINDOWED = SPEC.replace(sliding_window=6, window_layers=(True, False, True, False))
# A Qwen3-MoE (q/k norms, top-k then softmax) with a gated shared expert and a dense third layer, trained with
# Megatron's load-balancing and z-losses: the MoE cases' model
MOE = SPEC.replace(model_type="qwen3_moe", qkv_bias=False, qk_layernorm=True, moe=MoeSpec(
    num_experts=4, topk=2, ffn_hidden_size=32, shared_expert_hidden_size=48, shared_expert_gate=True,
    layer_pattern=(1, 1, 0, 1)))
MOE_TRAINING = MoeConfig(aux_loss_coeff=0.01, z_loss_coeff=0.001)
# ERNIE 4.5 MoE: softmax scores whose correction bias (moved after every step) chooses the top k, renormalised; an
# ungated shared expert, a dense first layer, RoPE in interleaved pairs, tied embeddings
ERNIE_MOE = SPEC.replace(model_type="ernie4_5_moe", qkv_bias=False, rotary_interleaved=True, tie_word_embeddings=True,
                         moe=MoeSpec(
    num_experts=4, topk=2, ffn_hidden_size=32, expert_bias=True, shared_expert_hidden_size=32,
    layer_pattern=(0, 1, 1, 1)))
# moe_seq: MOE with the sequence-wise load-balancing loss (per row of a micro-batch)
MOE_SEQ_TRAINING = MoeConfig(aux_loss_coeff=0.01, z_loss_coeff=0.001, aux_loss_type="sequence")
# moe_global: the global-batch loss (the same as one process unless data-parallel ranks share it)
MOE_GLOBAL_TRAINING = MoeConfig(aux_loss_coeff=0.01, z_loss_coeff=0.001, aux_loss_type="global")
# A DeepSeek-V3 shape: multi-latent attention (q's low rank, values narrower than keys, yarn), sigmoid routing over
# 8 experts in 4 groups (2 kept) with the correction bias, a scaling factor, a shared expert, a dense first layer
# and one multi-token prediction layer (on the last pipeline stage, trained with Megatron's default weight 0.1)
MLA = SPEC.replace(mtp_num_layers=1,
    model_type="deepseek_v3", qkv_bias=False, num_query_groups=4, kv_channels=12, attention="mla",
    mla=MlaSpec(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, q_lora_rank=24),
    rope_scaling=YarnScaling(factor=4.0, original_max_position_embeddings=16, mscale=1.0, mscale_all_dim=0.8),
    moe=MoeSpec(num_experts=8, topk=2, ffn_hidden_size=32, score_function="sigmoid", expert_bias=True,
                shared_expert_hidden_size=32, layer_pattern=(0, 1, 1, 1), num_groups=4, group_topk=2,
                topk_scaling_factor=2.5))
# GLM-4-0414's layer: a norm after the attention and one after the MLP (replicated, their gradients summed over TP
# under SP), half of each head rotated in interleaved pairs
GLM4 = SPEC.replace(model_type="glm4", rotary_percent=0.5, rotary_interleaved=True, post_norms=True)
# An OPT: LayerNorms with biases, biases on every linear, ReLU, learned positions offset by 2, multi-head, tied
OPT = SPEC.replace(model_type="opt", num_query_groups=4, linear_bias=True, tie_word_embeddings=True,
                   norm_epsilon=1e-5, norm="layernorm", activation="relu", position="learned_absolute")
# ... with a GELU MLP (activation_function "gelu"): the layouts that split a token's arithmetic (TP's sharded matmuls,
# CP's blockwise softmax) round differently, and ReLU's kink turns that into gradient differences of 1e-4 by the
# second step, the parity tolerance (measured: ReLU 2e-4 at step 3 under tp2·SP and cp2, GELU 1e-6)
OPT_GELU = OPT.replace(activation="gelu")
# A Gemma 3: (1 + w) RMSNorms (four a layer and on q/k), GeGLU, embeddings scaled by sqrt(h), tied, a softmax scale of
# query_pre_attn_scalar 24, three local layers (window 6, base 10k) and a global one (base 1M, linear x8), packed
GEMMA3 = SPEC.replace(model_type="gemma3_text", qkv_bias=False, tie_word_embeddings=True, qk_layernorm=True,
                      post_norms=True, scaled_embedding=True, softmax_scale=24 ** -0.5, rope_theta=1e6,
                      rope_scaling=LinearRopeScaling(8.0), local_rope_theta=10000.0, sliding_window=6,
                      window_layers=(True, True, True, False), norm="gemma_rmsnorm", activation="geglu")
# A gpt-oss: q/k/v/o biases, a sink logit per head, windowed (6) and full layers alternating, yarn without truncation,
# an MoE whose router and experts have biases and whose experts run the clamped SwiGLU, on packed documents
GPT_OSS = SPEC.replace(model_type="gpt_oss", linear_bias=True, attention_sinks=True, sliding_window=6,
                       window_layers=(True, False, True, False), activation="clamped_swiglu",
                       rope_scaling=YarnScaling(factor=4.0, original_max_position_embeddings=16, truncate=False),
                       moe=MoeSpec(num_experts=4, topk=2, ffn_hidden_size=32))
# A BLOOM: ALiBi, LayerNorms with biases (one after the embedding), biases on every linear, tanh GELU of 4 h,
# multi-head, tied, on packed documents (ALiBi needs no position ids: a document's tokens are as far apart packed as
# alone)
BLOOM = SPEC.replace(model_type="bloom", num_query_groups=4, ffn_hidden_size=256, linear_bias=True,
                     tie_word_embeddings=True, norm_epsilon=1e-5, norm="layernorm", activation="gelu_tanh",
                     position="alibi", embedding_norm=True)
# An MPT: ALiBi, LayerNorms without biases, no linear biases, exact GELU of 4 h, multi-head, tied, on packed documents
MPT = BLOOM.replace(model_type="mpt", linear_bias=False, qkv_bias=False, norm="layernorm_no_bias", activation="gelu",
                    embedding_norm=False)
# A Gemma 2: Gemma 3's layer without q/k norms, one RoPE base, windowed (6) and global layers in turn, attention scores
# soft-capped at 0.05 and logits at 3 (both bind on this tiny model), on packed documents
GEMMA2 = GEMMA3.replace(model_type="gemma2", qk_layernorm=False, rope_scaling=None, local_rope_theta=None,
                        rope_theta=10000.0, window_layers=(True, False, True, False), attention_softcap=0.05,
                        logit_softcap=3.0)
# window: packed documents and the windowed model; moe: MOE; mla: MLA (mla_packed: with packed documents)
# mla_mtp_off: MLA trained with the multi-token prediction weight at 0 (its layers frozen and not run); glm4: GLM4;
# gemma3: GEMMA3 on packed documents; ernie_moe: ERNIE_MOE; opt / opt_gelu: OPT / OPT_GELU on packed documents
# (their learned positions restart with each document); gpt_oss: GPT_OSS on packed documents; bloom / mpt: BLOOM /
# MPT on packed documents; gemma2: GEMMA2 on packed documents
DATA_KINDS = ("plain", "packed", "window", "moe", "moe_seq", "moe_global", "mla", "mla_packed", "mla_mtp_off",
              "glm4", "gemma3", "ernie_moe", "opt", "opt_gelu", "gpt_oss", "bloom", "mpt", "gemma2")


def case_spec(data: str) -> ModelSpec:
    return {"window": WINDOWED, "moe": MOE, "moe_seq": MOE, "moe_global": MOE, "mla": MLA,
            "mla_packed": MLA, "mla_mtp_off": MLA, "glm4": GLM4, "gemma3": GEMMA3,
            "ernie_moe": ERNIE_MOE, "opt": OPT, "opt_gelu": OPT_GELU, "gpt_oss": GPT_OSS,
            "bloom": BLOOM, "mpt": MPT, "gemma2": GEMMA2}.get(data, SPEC)


def case_moe(data: str) -> MoeConfig | None:
    return {"moe": MOE_TRAINING, "moe_seq": MOE_SEQ_TRAINING, "moe_global": MOE_GLOBAL_TRAINING,
            "mla": MOE_TRAINING, "mla_packed": MOE_TRAINING, "mla_mtp_off": MOE_TRAINING,
            "ernie_moe": MOE_TRAINING, "gpt_oss": MOE_TRAINING}.get(data)


def case_mtp_scale(data: str) -> float:
    """train.mtp_loss_scaling_factor of the data kind (Megatron's default, 0.1, but for mla_mtp_off)."""
    return 0.0 if data == "mla_mtp_off" else 0.1


@dataclass(frozen=True)
class LayoutCase:
    """One parallel layout checked against one process: `world` ranks run ParallelConfig(**parallel)."""

    world: int
    parallel: dict = field(default_factory=dict)
    micro_batch_size: int = 2
    data: str = "plain"  # one of DATA_KINDS: the batch (make_batch) and the model (case_spec)
    compile: bool = False  # train.compile: each decoder layer through torch.compile

    @property
    def steps(self) -> int:
        expert_parallel = self.parallel.get("ep", 1) > 1 or self.parallel.get("etp") is not None
        return EP_STEPS if expert_parallel else STEPS

    @property
    def spec(self) -> ModelSpec:
        return case_spec(self.data)

    @property
    def moe(self) -> MoeConfig | None:
        return case_moe(self.data)


CASES = {
    "tp2": LayoutCase(2, dict(tp=2)),
    "tp2_sp": LayoutCase(2, dict(tp=2, sp=True)),
    "tp4_two_groups": LayoutCase(4, dict(tp=4, sp=True)),
    "cp2_p2p": LayoutCase(2, dict(cp=2, cp_comm_type="p2p")),
    "cp2_allgather": LayoutCase(2, dict(cp=2, cp_comm_type="allgather")),
    "cp2_a2a": LayoutCase(2, dict(cp=2, cp_comm_type="a2a")),
    "cp2_packed": LayoutCase(2, dict(cp=2, cp_comm_type="p2p"), data="packed"),
    "cp2_allgather_packed": LayoutCase(2, dict(cp=2, cp_comm_type="allgather"), data="packed"),
    "cp2_a2a_packed": LayoutCase(2, dict(cp=2, cp_comm_type="a2a"), data="packed"),
    "pp2_1f1b": LayoutCase(2, dict(pp=2, pp_schedule="1f1b")),
    "pp2_interleaved": LayoutCase(2, dict(pp=2, vpp=2, pp_schedule="interleaved_1f1b")),
    "pp2_zero_bubble": LayoutCase(2, dict(pp=2, pp_schedule="zero_bubble")),
    "pp2_uneven": LayoutCase(2, dict(pp=2, num_layers_in_first_pipeline_stage=1)),
    "dp2_zero0": LayoutCase(2, dict(zero_stage=0, overlap_grad_reduce=True)),
    "dp2_zero1": LayoutCase(2, dict(zero_stage=1, overlap_grad_reduce=True, overlap_param_gather=True)),
    "dp2_zero2": LayoutCase(2, dict(zero_stage=2, overlap_grad_reduce=True)),
    "dp2_zero3": LayoutCase(2, dict(zero_stage=3)),
    "dp2_accum4": LayoutCase(2, dict(zero_stage=1), micro_batch_size=1),
    "recompute_selective": LayoutCase(2, dict(tp=2, sp=True, recompute="selective")),
    "recompute_full": LayoutCase(2, dict(tp=2, recompute="full", recompute_num_layers=1)),
    "recompute_modules_all": LayoutCase(2, dict(tp=2, sp=True, recompute="selective",
                                                recompute_modules=["core_attn", "mlp", "layernorm"])),
    "recompute_op": LayoutCase(2, dict(tp=2, sp=True, recompute="op")),
    "cp2_recompute_op": LayoutCase(2, dict(cp=2, cp_comm_type="p2p", recompute="op")),
    "dp2_zero3_recompute_op": LayoutCase(2, dict(zero_stage=3, recompute="op")),
    "pp2_recompute_mlp_layernorm": LayoutCase(2, dict(pp=2, recompute="selective",
                                                      recompute_modules=["mlp", "layernorm"])),
    "tp2_pp2_dp2": LayoutCase(8, dict(tp=2, pp=2, sp=True, zero_stage=1, overlap_grad_reduce=True), micro_batch_size=1),
    "tp2_cp2": LayoutCase(4, dict(tp=2, cp=2, sp=True)),
    "packed_tp2": LayoutCase(2, dict(tp=2, sp=True), data="packed"),
    "window_tp2_sp": LayoutCase(2, dict(tp=2, sp=True), data="window"),
    "window_cp2_p2p": LayoutCase(2, dict(cp=2, cp_comm_type="p2p"), data="window"),
    "window_cp2_allgather": LayoutCase(2, dict(cp=2, cp_comm_type="allgather"), data="window"),
    "window_cp2_a2a": LayoutCase(2, dict(cp=2, cp_comm_type="a2a"), data="window"),
    "glm4_tp2_sp": LayoutCase(2, dict(tp=2, sp=True), data="glm4"),
    "glm4_pp2": LayoutCase(2, dict(pp=2), data="glm4"),
    "glm4_cp2_a2a": LayoutCase(2, dict(cp=2, cp_comm_type="a2a"), data="glm4"),
    "glm4_dp2_zero1": LayoutCase(2, dict(zero_stage=1, overlap_grad_reduce=True), data="glm4"),
    "gemma3_tp2_sp": LayoutCase(2, dict(tp=2, sp=True), data="gemma3"),
    "gemma3_pp2": LayoutCase(2, dict(pp=2), data="gemma3"),
    "gemma3_cp2_p2p": LayoutCase(2, dict(cp=2, cp_comm_type="p2p"), data="gemma3"),
    "gemma3_dp2_zero1": LayoutCase(2, dict(zero_stage=1, overlap_grad_reduce=True), data="gemma3"),
    "opt_gelu_tp2_sp": LayoutCase(2, dict(tp=2, sp=True), data="opt_gelu"),
    "opt_pp2": LayoutCase(2, dict(pp=2), data="opt"),
    "opt_gelu_cp2_allgather": LayoutCase(2, dict(cp=2, cp_comm_type="allgather"), data="opt_gelu"),
    "opt_dp2_zero1": LayoutCase(2, dict(zero_stage=1, overlap_grad_reduce=True), data="opt"),
    "ernie_moe_ep2": LayoutCase(2, dict(ep=2), micro_batch_size=1, data="ernie_moe"),
    # expert biases go with expert-TP 1: under tp2 the experts are whole on each TP rank (expert-data-parallel)
    "gpt_oss_tp2_sp_etp1": LayoutCase(2, dict(tp=2, sp=True, etp=1), data="gpt_oss"),
    "gpt_oss_pp2": LayoutCase(2, dict(pp=2), data="gpt_oss"),
    "gpt_oss_cp2_a2a": LayoutCase(2, dict(cp=2, cp_comm_type="a2a"), data="gpt_oss"),
    "gpt_oss_dp2_zero1": LayoutCase(2, dict(zero_stage=1, overlap_grad_reduce=True), micro_batch_size=1,
                                    data="gpt_oss"),
    "gpt_oss_ep2": LayoutCase(2, dict(ep=2), micro_batch_size=1, data="gpt_oss"),
    "bloom_tp2_sp": LayoutCase(2, dict(tp=2, sp=True), data="bloom"),
    "bloom_pp2": LayoutCase(2, dict(pp=2), data="bloom"),
    "bloom_cp2_p2p": LayoutCase(2, dict(cp=2, cp_comm_type="p2p"), data="bloom"),
    "bloom_cp2_a2a": LayoutCase(2, dict(cp=2, cp_comm_type="a2a"), data="bloom"),
    "bloom_dp2_zero1": LayoutCase(2, dict(zero_stage=1, overlap_grad_reduce=True), data="bloom"),
    "mpt_tp2_sp": LayoutCase(2, dict(tp=2, sp=True), data="mpt"),
    "mpt_cp2_allgather": LayoutCase(2, dict(cp=2, cp_comm_type="allgather"), data="mpt"),
    "gemma2_tp2_sp": LayoutCase(2, dict(tp=2, sp=True), data="gemma2"),
    "gemma2_pp2": LayoutCase(2, dict(pp=2), data="gemma2"),
    "gemma2_cp2_p2p": LayoutCase(2, dict(cp=2, cp_comm_type="p2p"), data="gemma2"),
    "gemma2_dp2_zero1": LayoutCase(2, dict(zero_stage=1, overlap_grad_reduce=True), data="gemma2"),
    "moe_tp2": LayoutCase(2, dict(tp=2), data="moe"),
    "moe_tp2_sp": LayoutCase(2, dict(tp=2, sp=True), data="moe"),
    "moe_pp2": LayoutCase(2, dict(pp=2), data="moe"),
    "moe_dp2_zero1": LayoutCase(2, dict(zero_stage=1, overlap_grad_reduce=True), micro_batch_size=1, data="moe"),
    "moe_cp2": LayoutCase(2, dict(cp=2, cp_comm_type="p2p"), data="moe"),
    "moe_tp2_sp_recompute_full": LayoutCase(2, dict(tp=2, sp=True, recompute="full"), data="moe"),
    "moe_ep2": LayoutCase(2, dict(ep=2), micro_batch_size=1, data="moe"),
    "moe_ep4": LayoutCase(4, dict(ep=4), micro_batch_size=1, data="moe"),
    "moe_ep2_tp2_etp1": LayoutCase(4, dict(ep=2, tp=2, sp=True, etp=1), micro_batch_size=1, data="moe"),
    "moe_ep2_tp2_etp2": LayoutCase(4, dict(ep=2, tp=2, sp=True), micro_batch_size=1, data="moe"),
    "moe_ep2_pp2": LayoutCase(4, dict(ep=2, pp=2), micro_batch_size=1, data="moe"),
    "moe_ep2_cp2": LayoutCase(2, dict(ep=2, cp=2), data="moe"),
    "moe_ep2_dp4_zero1": LayoutCase(4, dict(ep=2, zero_stage=1, overlap_grad_reduce=True), micro_batch_size=1,
                                   data="moe"),
    "moe_ep2_dp4_zero3": LayoutCase(4, dict(ep=2, zero_stage=3), micro_batch_size=1, data="moe"),
    "moe_ep2_tp2_pp2": LayoutCase(8, dict(ep=2, tp=2, sp=True, pp=2), micro_batch_size=1, data="moe"),
    "moe_ep2_recompute_full": LayoutCase(2, dict(ep=2, recompute="full"), micro_batch_size=1, data="moe"),
    "moe_ep2_dp4_zero2": LayoutCase(4, dict(ep=2, zero_stage=2, overlap_grad_reduce=True), micro_batch_size=1,
                                   data="moe"),
    "moe_ep2_pp2_interleaved": LayoutCase(4, dict(ep=2, pp=2, vpp=2, pp_schedule="interleaved_1f1b"),
                                         micro_batch_size=1, data="moe"),
    "moe_seq_cp2": LayoutCase(2, dict(cp=2), data="moe_seq"),
    # 1F1B runs stage 0's second forward before its first backward recomputes: the recompute must not see it
    "moe_global_pp2_recompute_full": LayoutCase(2, dict(pp=2, recompute="full"), data="moe_global"),
    "moe_global_cp2": LayoutCase(2, dict(cp=2), data="moe_global"),
    "mla_tp2_sp": LayoutCase(2, dict(tp=2, sp=True), data="mla"),
    "mla_pp2": LayoutCase(2, dict(pp=2), data="mla"),
    "mla_dp2_zero1": LayoutCase(2, dict(zero_stage=1, overlap_grad_reduce=True), micro_batch_size=1, data="mla"),
    "mla_dp2_zero3": LayoutCase(2, dict(zero_stage=3), micro_batch_size=1, data="mla"),
    "mla_ep2": LayoutCase(2, dict(ep=2), micro_batch_size=1, data="mla"),
    "mla_cp2_p2p_packed": LayoutCase(2, dict(cp=2, cp_comm_type="p2p"), data="mla_packed"),
    "mla_cp2_allgather_packed": LayoutCase(2, dict(cp=2, cp_comm_type="allgather"), data="mla_packed"),
    "mla_cp2_a2a_packed": LayoutCase(2, dict(cp=2, cp_comm_type="a2a"), data="mla_packed"),
    "mla_tp2_sp_recompute_selective": LayoutCase(2, dict(tp=2, sp=True, recompute="selective"), data="mla"),
    # the last stage's embedding copy, which no loss reads when MTP does not train, still joins the first stage's
    # gradient sum under FSDP2
    "mla_pp2_zero3_mtp_off": LayoutCase(2, dict(pp=2, zero_stage=3), data="mla_mtp_off"),
}


# train.compile = true, in a launch of their own (2 ranks; the cases share one process, so they share compiled graphs)
COMPILED_WORLD = 2
COMPILED_CASES = {
    "compiled_tp2": LayoutCase(2, dict(tp=2), compile=True),
    "compiled_pp2": LayoutCase(2, dict(pp=2, pp_schedule="1f1b"), compile=True),
    "compiled_cp2": LayoutCase(2, dict(cp=2, cp_comm_type="p2p"), compile=True),
    "compiled_dp2_zero1": LayoutCase(2, dict(zero_stage=1, overlap_grad_reduce=True, overlap_param_gather=True),
                                     compile=True),
    "compiled_dp2_zero3": LayoutCase(2, dict(zero_stage=3), compile=True),
}


def make_batch(packed: bool | str):
    """Global batch: input_ids, labels (-100 across document boundaries), position_ids and segment_ids (packed, or
    data kind "packed" / "window" / "mla_packed" / "gemma3" / "opt" / "opt_gelu" / "gpt_oss" / "bloom" / "mpt" /
    "gemma2")."""
    packed = packed in (True, "packed", "window", "mla_packed", "gemma3", "opt", "opt_gelu", "gpt_oss", "bloom",
                        "mpt", "gemma2")
    generator = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, SPEC.vocab_size, (GLOBAL_BATCH, SEQ + 1), generator=generator)
    input_ids, labels = tokens[:, :-1].clone(), tokens[:, 1:].clone()
    if not packed:
        return input_ids, labels, None, None
    segment_ids = torch.zeros(GLOBAL_BATCH, SEQ, dtype=torch.long)
    position_ids = torch.zeros(GLOBAL_BATCH, SEQ, dtype=torch.long)
    for row in range(GLOBAL_BATCH):
        cuts = sorted(torch.randperm(SEQ - 1, generator=generator)[:3].add(1).tolist())
        start = 0
        for doc, stop in enumerate(cuts + [SEQ]):
            segment_ids[row, start:stop] = doc
            position_ids[row, start:stop] = torch.arange(stop - start)
            if stop < SEQ:
                labels[row, stop - 1] = -100  # the last token of a document does not predict the next document
            start = stop
    return input_ids, labels, position_ids, segment_ids
