"""MoeSpec: the Mixture-of-Experts numbers of a decoder (which layers route, to how many experts, how), and their
Hugging Face config keys for Qwen2-MoE, Qwen3-MoE and Mixtral.

Routing, as Megatron-Core names it: `pre_softmax` (Qwen2-MoE with norm_topk_prob = false) takes the softmax over
all experts and keeps the top-k probabilities as they are; otherwise the top-k of the logits get a softmax over the
k (Mixtral; equal to Qwen3-MoE's softmax over all experts renormalised over the top k). `score_function = "sigmoid"`
scores each expert independently and normalises the top k to sum to one (DeepSeek-V3's router); with
`expert_bias` a per-expert bias (a fp32 buffer the trainer moves toward an even load) is added to those scores to
choose the top k, and the chosen experts' unbiased scores weigh them (aux-loss-free balancing). Group-limited
routing (DeepSeek-V3's `n_group` / `topk_group`, Megatron's `moe_router_num_groups` / `moe_router_group_topk`)
first keeps the `group_topk` groups of experts whose two best choice scores sum highest, as transformers computes it;
`topk_scaling_factor` (`routed_scaling_factor`) multiplies the chosen experts' weights. ERNIE 4.5's router is
softmax scores with `expert_bias`: the bias is added to the softmax over all experts to choose the top k, whose
probabilities are then renormalised (the softmax over their logits); Megatron-Core refuses an expert bias with
softmax scores, so that router is qlm's own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from qlm_core.config import RouterScoreFunction
from qlm_core.errors import QlmError
from qlm_core.models.families import FAMILIES

ScoreFunction = RouterScoreFunction
MOE_MODEL_TYPES = tuple(model_type for model_type, family in FAMILIES.items() if family.moe)
# sigmoid group-limited routers with a correction bias
DEEPSEEK_MOE_TYPES = ("deepseek_v3", "glm4_moe", "glm4_moe_lite")  # DeepSeek-V3's router (deepseek_v2: its own)
ERNIE_NORM_MIN = 1e-12  # ERNIE 4.5's moe_norm_min: the floor of the chosen probabilities' sum (transformers' default)


@dataclass(frozen=True)
class MoeSpec:
    num_experts: int
    topk: int
    ffn_hidden_size: int  # of one routed expert
    pre_softmax: bool = False
    score_function: ScoreFunction = "softmax"
    expert_bias: bool = False  # the router's aux-loss-free balancing bias (Megatron's mlp.router.expert_bias)
    shared_expert_hidden_size: int = 0  # 0: no shared expert
    shared_expert_gate: bool = False  # the shared expert's output scaled by sigmoid(x . gate_weight)
    layer_pattern: tuple[int, ...] = ()  # per layer 1 = MoE, 0 = dense MLP (Megatron's --moe-layer-freq list); ()
    # means every layer is MoE
    num_groups: int = 1  # group-limited routing: the experts in this many equal groups
    group_topk: int = 1  # ... of which each token may choose from this many
    topk_scaling_factor: float = 1.0

    def __post_init__(self):
        if self.num_experts < 1 or not 1 <= self.topk <= self.num_experts:
            raise QlmError(f"MoE with {self.num_experts} experts and top-{self.topk} routing",
                           "num_experts_per_tok must be between 1 and the number of experts")
        if self.ffn_hidden_size < 1:
            raise QlmError(f"MoE expert size {self.ffn_hidden_size}", "moe_intermediate_size must be positive")
        if self.score_function not in ("softmax", "sigmoid"):
            raise QlmError(f"router score function {self.score_function!r}", "use 'softmax' or 'sigmoid'")
        if self.expert_bias and self.pre_softmax and self.score_function == "softmax":
            raise QlmError("a router expert bias with pre-softmax routing (the bias chooses the experts, whose "
                           "weights are then renormalised, which pre-softmax routing does not do)",
                           "drop Megatron's moe_router_pre_softmax or the bias (moe.router_expert_bias, "
                           "moe_router_enable_expert_bias)")
        if self.num_groups < 1 or self.num_experts % self.num_groups or not 1 <= self.group_topk <= self.num_groups:
            raise QlmError(f"group-limited routing of {self.num_experts} experts in {self.num_groups} groups, "
                           f"{self.group_topk} of them chosen",
                           "n_group must divide the expert count and topk_group be between 1 and n_group")
        if self.num_groups > 1 and self.score_function != "sigmoid":
            raise QlmError("group-limited routing with softmax scores", "qlm limits groups of sigmoid-scored routers")
        if self.num_groups > 1 and (self.num_experts // self.num_groups < 2
                                    or self.topk > self.group_topk * self.num_experts // self.num_groups):
            raise QlmError(f"group-limited routing: top-{self.topk} of {self.group_topk} groups of "
                           f"{self.num_experts // self.num_groups} experts",
                           "each group needs two experts or more, and the chosen groups at least top-k experts")
        if self.shared_expert_gate and not self.shared_expert_hidden_size:
            raise QlmError("a shared-expert gate without a shared expert", "set shared_expert_intermediate_size")

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer `layer` routes; a multi-token prediction layer (numbered after the decoder's) is of the
        decoder's last layer's kind, as Megatron-Core builds it."""
        return not self.layer_pattern or bool(self.layer_pattern[min(layer, len(self.layer_pattern) - 1)])

    def num_moe_layers(self, num_layers: int) -> int:
        return sum(self.is_moe_layer(i) for i in range(num_layers))


def _typed(config: dict[str, Any], model_type: str, key: str, kind: type, default: Any, least: int = 0) -> Any:
    """config[key] (default when absent or null) of `kind`: an int >= least, a bool, or a list of ints >= least;
    anything else is one line naming the key (transformers refuses the same config)."""
    value = config.get(key)
    if value is None:
        return default
    if kind is bool:
        ok = isinstance(value, bool)
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= least
    else:
        ok = isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) and v >= least
                                             for v in value)
    if not ok:
        what = {bool: "true or false", int: f"an integer >= {least}", list: f"a list of integers >= {least}"}[kind]
        raise QlmError(f"config.json ({model_type}): {key} is {value!r}, not {what}",
                       f"set {key} as transformers writes it")
    return value


# transformers' defaults of the keys a config.json may leave out: (n_group, topk_group, routed_scaling_factor,
# n_shared_experts, first_k_dense_replace)
_DEEPSEEK_DEFAULTS = {"deepseek_v3": (8, 4, 2.5, 1, 3), "glm4_moe": (1, 1, 1.0, 1, 1),
                      "glm4_moe_lite": (1, 1, 1.8, 1, 1)}


def _deepseek_sizes(config: dict[str, Any], model_type: str, scaling_default: float) -> tuple[int, int, int, float]:
    """(routed experts, top k, expert FFN size, routed_scaling_factor) of the DeepSeek families' config.json."""
    experts = _typed(config, model_type, "n_routed_experts", int, None, least=1)
    topk = _typed(config, model_type, "num_experts_per_tok", int, None, least=1)
    ffn = _typed(config, model_type, "moe_intermediate_size", int, None, least=1)
    if experts is None or topk is None or ffn is None:
        raise QlmError(f"config.json ({model_type}) has no n_routed_experts / num_experts_per_tok / "
                       "moe_intermediate_size", "use a complete config.json from transformers")
    scaling = config.get("routed_scaling_factor", scaling_default)
    if isinstance(scaling, bool) or not isinstance(scaling, (int, float)) or not scaling > 0:
        raise QlmError(f"config.json ({model_type}): routed_scaling_factor is {scaling!r}, not a positive number",
                       "set routed_scaling_factor as transformers writes it")
    return experts, topk, ffn, float(scaling)


def _deepseek_moe(config: dict[str, Any], model_type: str, num_layers: int) -> MoeSpec:
    """DeepSeek-V3's MoE keys: sigmoid scores with the correction bias, groups, scaling, shared experts and the
    first_k_dense_replace dense layers (absent keys take transformers' defaults)."""
    groups, group_topk, scaling_default, shared, first_dense = _DEEPSEEK_DEFAULTS[model_type]
    experts, topk, ffn, scaling = _deepseek_sizes(config, model_type, scaling_default)
    if not _typed(config, model_type, "norm_topk_prob", bool, True):
        raise QlmError(f"config.json ({model_type}): norm_topk_prob is false",
                       "qlm (and Megatron-Core) normalise sigmoid routing's top-k weights: use norm_topk_prob true")
    if model_type == "glm4_moe_lite":  # "dense" / "sparse" per layer (default: the first dense)
        kinds = config.get("mlp_layer_types") or ["dense"] + ["sparse"] * (num_layers - 1)
        if not (isinstance(kinds, list) and len(kinds) == num_layers and set(kinds) <= {"dense", "sparse"}):
            raise QlmError(f"config.json ({model_type}): mlp_layer_types is {kinds!r}, not {num_layers} of "
                           "'dense' / 'sparse'", "set mlp_layer_types as transformers writes it")
        pattern = tuple(int(kind == "sparse") for kind in kinds)
    else:
        dense = _typed(config, model_type, "first_k_dense_replace", int, first_dense)
        pattern = tuple(int(i >= dense) for i in range(num_layers))
    return MoeSpec(num_experts=experts, topk=topk, ffn_hidden_size=ffn, score_function="sigmoid",
                   expert_bias=True,
                   shared_expert_hidden_size=ffn * _typed(config, model_type, "n_shared_experts", int, shared),
                   layer_pattern=() if all(pattern) else pattern,
                   num_groups=_typed(config, model_type, "n_group", int, groups, least=1),
                   group_topk=_typed(config, model_type, "topk_group", int, group_topk, least=1),
                   topk_scaling_factor=scaling)


def _deepseek_v2_moe(config: dict[str, Any], num_layers: int) -> MoeSpec:
    """DeepSeek-V2's MoE keys as transformers' DeepseekV2 reads them: softmax over every expert, the top k kept
    without renormalising (norm_topk_prob has no effect there) and scaled by routed_scaling_factor, shared experts,
    first_k_dense_replace dense layers. Its group_limited_greedy routing (the 236B model) scores a group by its best
    expert, which Megatron-Core's group-limited router does not do: refused."""
    model_type = "deepseek_v2"
    method = config.get("topk_method", "greedy")
    if method != "greedy":
        raise QlmError(f"config.json ({model_type}): topk_method {method!r} (a group's score is its best expert, "
                       "which Megatron-Core's group-limited router does not compute)",
                       "qlm converts DeepSeek-V2 models with greedy routing (DeepSeek-V2-Lite)")
    if _typed(config, model_type, "norm_topk_prob", bool, False):
        raise QlmError(f"config.json ({model_type}): norm_topk_prob is true, which transformers' DeepseekV2 ignores "
                       "(it never renormalises)", "set norm_topk_prob to false, as DeepSeek-V2's releases have it")
    experts, topk, ffn, scaling = _deepseek_sizes(config, model_type, 1.0)
    dense = _typed(config, model_type, "first_k_dense_replace", int, 0)
    pattern = tuple(int(i >= dense) for i in range(num_layers))
    return MoeSpec(num_experts=experts, topk=topk, ffn_hidden_size=ffn, pre_softmax=True,
                   shared_expert_hidden_size=ffn * _typed(config, model_type, "n_shared_experts", int, 2),
                   layer_pattern=() if all(pattern) else pattern, topk_scaling_factor=scaling)


def _deepseek_v2_moe_to_hf(moe: MoeSpec, num_layers: int) -> dict[str, Any]:
    dense = [i for i in range(num_layers) if not moe.is_moe_layer(i)]
    if dense != list(range(len(dense))) or moe.expert_bias or moe.score_function != "softmax" \
            or not moe.pre_softmax or moe.num_groups > 1 or moe.shared_expert_gate \
            or moe.shared_expert_hidden_size % moe.ffn_hidden_size:
        raise QlmError("this MoE is not a deepseek_v2 one (dense layers only first, softmax routing over every "
                       "expert without renormalisation or groups, ungated shared experts of whole expert sizes)",
                       "keep it in a Megatron format")
    return {"n_routed_experts": moe.num_experts, "num_experts_per_tok": moe.topk,
            "moe_intermediate_size": moe.ffn_hidden_size, "first_k_dense_replace": len(dense),
            "n_shared_experts": moe.shared_expert_hidden_size // moe.ffn_hidden_size, "topk_method": "greedy",
            "routed_scaling_factor": moe.topk_scaling_factor, "norm_topk_prob": False}


def _deepseek_moe_to_hf(moe: MoeSpec, model_type: str, num_layers: int) -> dict[str, Any]:
    dense = [i for i in range(num_layers) if not moe.is_moe_layer(i)]
    layers = {"mlp_layer_types": ["sparse" if moe.is_moe_layer(i) else "dense" for i in range(num_layers)]} \
        if model_type == "glm4_moe_lite" else {"first_k_dense_replace": len(dense)}
    if (model_type != "glm4_moe_lite" and dense != list(range(len(dense)))) or not moe.expert_bias \
            or moe.score_function != "sigmoid" or moe.shared_expert_gate \
            or moe.shared_expert_hidden_size % moe.ffn_hidden_size:
        raise QlmError(f"this MoE is not a {model_type} one (dense layers only first, sigmoid routing with a "
                       "correction bias, ungated shared experts of whole expert sizes)", "keep it in a Megatron format")
    return {"n_routed_experts": moe.num_experts, "num_experts_per_tok": moe.topk,
            "moe_intermediate_size": moe.ffn_hidden_size, **layers,
            "n_shared_experts": moe.shared_expert_hidden_size // moe.ffn_hidden_size, "n_group": moe.num_groups,
            "topk_group": moe.group_topk, "routed_scaling_factor": moe.topk_scaling_factor, "norm_topk_prob": True}


def _ernie_moe(config: dict[str, Any], num_layers: int) -> MoeSpec:
    """ERNIE 4.5's MoE keys: softmax scores with the correction bias choosing the top k (renormalised), ungated
    shared experts of moe_num_shared_experts expert sizes, and MoE layers every moe_layer_interval-th from
    moe_layer_start_index to moe_layer_end_index (-1: the last)."""
    model_type = "ernie4_5_moe"
    # transformers' attribute_map names them num_experts / num_experts_per_tok too
    experts = _typed(config, model_type, "moe_num_experts", int,
                     _typed(config, model_type, "num_experts", int, 64, least=1), least=1)
    topk = _typed(config, model_type, "moe_k", int, _typed(config, model_type, "num_experts_per_tok", int, 6, least=1),
                  least=1)
    ffn = _typed(config, model_type, "moe_intermediate_size", int, 1536, least=1)
    start = _typed(config, model_type, "moe_layer_start_index", int, 1)
    interval = _typed(config, model_type, "moe_layer_interval", int, 1, least=1)
    end = config.get("moe_layer_end_index", -1)
    end = num_layers - 1 if end in (-1, None) else _typed(config, model_type, "moe_layer_end_index", int, -1)
    norm_min = config.get("moe_norm_min", ERNIE_NORM_MIN)
    if norm_min != ERNIE_NORM_MIN:
        raise QlmError(f"config.json ({model_type}): moe_norm_min is {norm_min!r}; qlm renormalises the chosen "
                       f"experts' probabilities with transformers' floor {ERNIE_NORM_MIN}",
                       f"set moe_norm_min to {ERNIE_NORM_MIN}")
    pattern = tuple(int((i + 1) % interval == 0 and start <= i <= end) for i in range(num_layers))
    if not any(pattern):
        raise QlmError(f"config.json ({model_type}): no layer between moe_layer_start_index {start} and "
                       f"moe_layer_end_index {end} is an MoE layer", "use a config.json with MoE layers")
    if topk > experts:
        raise QlmError(f"config.json ({model_type}): moe_k {topk} is more than its {experts} experts",
                       "set moe_k between 1 and moe_num_experts")
    return MoeSpec(num_experts=experts, topk=topk, ffn_hidden_size=ffn, expert_bias=True,
                   shared_expert_hidden_size=ffn * _typed(config, model_type, "moe_num_shared_experts", int, 2),
                   layer_pattern=() if all(pattern) else pattern)


def _ernie_moe_to_hf(moe: MoeSpec, num_layers: int) -> dict[str, Any]:
    routed = [i for i in range(num_layers) if moe.is_moe_layer(i)]
    start, end = routed[0], routed[-1]
    steps = {b - a for a, b in zip(routed, routed[1:], strict=False)}
    interval = steps.pop() if len(steps) == 1 else 1
    if len(steps) or (start + 1) % interval or routed != list(range(start, end + 1, interval)) \
            or moe.score_function != "softmax" or moe.pre_softmax or not moe.expert_bias or moe.num_groups > 1 \
            or moe.topk_scaling_factor != 1.0 or moe.shared_expert_gate \
            or moe.shared_expert_hidden_size % moe.ffn_hidden_size:
        raise QlmError("this MoE is not an ernie4_5_moe one (MoE layers every n-th from one layer to another, "
                       "softmax routing with a correction bias, ungated shared experts of whole expert sizes)",
                       "keep it in a Megatron format")
    return {"moe_num_experts": moe.num_experts, "moe_k": moe.topk, "moe_intermediate_size": moe.ffn_hidden_size,
            "moe_num_shared_experts": moe.shared_expert_hidden_size // moe.ffn_hidden_size,
            "moe_layer_start_index": start, "moe_layer_end_index": end, "moe_layer_interval": interval,
            "moe_norm_min": ERNIE_NORM_MIN}


def moe_from_hf(config: dict[str, Any], model_type: str, num_layers: int) -> MoeSpec:
    """The MoeSpec of an HF config.json of one of MOE_MODEL_TYPES."""
    if model_type in DEEPSEEK_MOE_TYPES:
        return _deepseek_moe(config, model_type, num_layers)
    if model_type == "deepseek_v2":
        return _deepseek_v2_moe(config, num_layers)
    if model_type == "ernie4_5_moe":
        return _ernie_moe(config, num_layers)
    experts = config.get("num_experts", config.get("num_local_experts"))
    topk = config.get("num_experts_per_tok")
    if not isinstance(experts, int) or not isinstance(topk, int) or isinstance(experts, bool) \
            or isinstance(topk, bool):
        raise QlmError(f"config.json ({model_type}) has no integer num_experts / num_experts_per_tok",
                       "use a complete config.json from transformers")
    if topk > experts:
        raise QlmError(f"config.json ({model_type}): num_experts_per_tok {topk} is more than its {experts} experts",
                       "set num_experts_per_tok between 1 and the number of experts")
    if model_type in ("mixtral", "gpt_oss"):  # every layer MoE, intermediate_size the expert's
        if config.get("router_jitter_noise"):
            raise QlmError(f"router_jitter_noise {config['router_jitter_noise']} is not supported",
                           "set router_jitter_noise to 0 (Megatron has no router noise)")
        return MoeSpec(num_experts=experts, topk=topk, ffn_hidden_size=config["intermediate_size"])
    sparse_step = _typed(config, model_type, "decoder_sparse_step", int, 1, least=1)
    dense = set(_typed(config, model_type, "mlp_only_layers", list, []))
    pattern = tuple(int(i not in dense and (i + 1) % sparse_step == 0) for i in range(num_layers))
    shared = (_typed(config, model_type, "shared_expert_intermediate_size", int, 0)
              if model_type == "qwen2_moe" else 0)
    return MoeSpec(
        num_experts=experts, topk=topk,
        ffn_hidden_size=_typed(config, model_type, "moe_intermediate_size", int, 0, least=1),
        pre_softmax=not _typed(config, model_type, "norm_topk_prob", bool, False),
        shared_expert_hidden_size=shared or 0, shared_expert_gate=bool(shared),
        layer_pattern=() if all(pattern) else pattern,
    )


def moe_to_hf(moe: MoeSpec, model_type: str, num_layers: int) -> dict[str, Any]:
    """The config.json keys transformers reads for `moe` (the inverse of moe_from_hf)."""
    if model_type in DEEPSEEK_MOE_TYPES:
        return _deepseek_moe_to_hf(moe, model_type, num_layers)
    if model_type == "deepseek_v2":
        return _deepseek_v2_moe_to_hf(moe, num_layers)
    if model_type == "ernie4_5_moe":
        return _ernie_moe_to_hf(moe, num_layers)
    if moe.num_groups > 1 or moe.topk_scaling_factor != 1.0:
        raise QlmError(f"this model's router limits groups or scales its weights, which transformers' {model_type} "
                       "does not", "export it as deepseek_v3, or keep it in a Megatron format")
    if moe.score_function != "softmax":
        raise QlmError(f"this model routes with sigmoid scores, which transformers' {model_type} does not have, so "
                       "it has no Hugging Face form", "keep it in a Megatron format (qlm eval, generate and train read "
                       "it as it is), or train a softmax-routed model to export")
    if moe.expert_bias:
        raise QlmError(f"this model's router chooses experts with a correction bias, which transformers' "
                       f"{model_type} does not", "keep it in a Megatron format")
    if model_type in ("mixtral", "gpt_oss"):
        if moe.pre_softmax or moe.shared_expert_hidden_size or moe.layer_pattern:
            raise QlmError(f"this MoE is not a {model_type} one (pre-softmax routing, a shared expert or dense "
                           "layers)", "export it as qwen2_moe")
        keys = {"num_local_experts": moe.num_experts, "num_experts_per_tok": moe.topk,
                "intermediate_size": moe.ffn_hidden_size}
        return {**keys, "router_jitter_noise": 0.0} if model_type == "mixtral" else keys
    if model_type == "qwen3_moe" and moe.shared_expert_hidden_size:
        raise QlmError("Qwen3-MoE has no shared expert", "export it as qwen2_moe")
    dense = [i for i in range(num_layers) if not moe.is_moe_layer(i)]
    keys = {"num_experts": moe.num_experts, "num_experts_per_tok": moe.topk,
            "moe_intermediate_size": moe.ffn_hidden_size, "norm_topk_prob": not moe.pre_softmax,
            "decoder_sparse_step": 1, "mlp_only_layers": dense}
    if model_type == "qwen2_moe":
        if moe.shared_expert_hidden_size and not moe.shared_expert_gate:
            raise QlmError("Qwen2-MoE's shared expert is always gated", "export a model with a shared-expert gate")
        keys["shared_expert_intermediate_size"] = moe.shared_expert_hidden_size
    return keys
