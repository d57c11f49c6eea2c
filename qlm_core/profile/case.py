"""One question for `qlm profile`: a model, a layout and a batch on N devices, checked as the trainer checks it.

Defaults are the seed's case, recipes/qwen2-7b-128k.toml: Qwen2-7B SFT at 131072 tokens per sample, micro-batch 1,
global batch 16, bf16 with fp32 master weights and gradients, 32 GPUs as tp 4 x cp 4 x dp 2, SP on, p2p ring
attention, ZeRO 1 with overlapped reduce and gather, full recompute.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from qlm_core.checkpoint.sources.open import open_checkpoint
from qlm_core.config import (
    ModelConfig,
    MoeConfig,
    ParallelConfig,
    Recipe,
    ReferenceModel,
    RlConfig,
    TrainConfig,
    check_finite,
    checked_field,
    model_reference,
    preference_reference,
    rows_per_sample,
)
from qlm_core.dtypes import DTYPES
from qlm_core.errors import QlmError
from qlm_core.models.layout import LORA_TARGETS, UNEVEN_SPLIT_KEYS, ModelLayout
from qlm_core.models.parameters import num_parameters
from qlm_core.models.presets import load_model_spec
from qlm_core.models.spec import ModelSpec
from qlm_core.parallel.pipeline_rules import validate_recompute
from qlm_core.parallel.state import ParallelSizes, resolve_sizes
from qlm_core.train.validate import (
    validate_counts,
    validate_experts,
    validate_grad_reduce_dtype,
    validate_layout,
    validate_moe,
    validate_preference_model,
    validate_rl_prompts,
)

SEED_PARALLEL = dict(tp=4, cp=4, sp=True, zero_stage=1, overlap_grad_reduce=True, overlap_param_gather=True,
                     recompute="full", cp_comm_type="p2p")
SEED_MODEL, SEED_SEQ, SEED_GBS, SEED_GPUS = "qwen2-7b", 131072, 16, 32
# Under expert parallelism: the most (token, choice) rows an EP rank receives over the mean, which its dispatch
# buffers, expert activations and expert GEMMs are sized for. 1.25 is the capacity factor Switch Transformer
# (Fedus et al. 2021, sec. 2.2) and GShard train with, i.e. what capacity-bounded MoE runs budget an expert's
# max/mean load at; an EP rank holds E/ep experts, so its load is at most its busiest expert's.
DEFAULT_MOE_IMBALANCE = 1.25


@dataclass
class ProfileCase:
    spec: ModelSpec
    model_name: str
    parallel: ParallelConfig = field(default_factory=lambda: ParallelConfig(**SEED_PARALLEL))
    seq_len: int = SEED_SEQ
    micro_batch_size: int = 1
    global_batch_size: int = SEED_GBS
    num_gpus: int = SEED_GPUS
    dtype: str = "bf16"
    lora_rank: int = 0
    lora_targets: tuple[str, ...] = tuple(LORA_TARGETS)
    loss_chunk_tokens: int = TrainConfig.loss_chunk_tokens  # the trainer's loss head chunk (0: whole logits)
    mean_doc_len: int = 0  # packed data: mean document length in tokens (0: one document per sample)
    # Communication that qlm's trainer does as its options say, and other frameworks otherwise (Megatron's
    # --tp-comm-overlap and --overlap-p2p-comm, fp16 gradient reduction, FSDP gathering fp32 parameters): the
    # profile predicts their runs too (the calibration, profile/calibration.py)
    framework_reduce_dtype: str = ""  # "": what the trainer does, parallel.grad_reduce_dtype
    param_gather_dtype: str = ""  # "": the compute dtype
    tp_comm_overlap: bool = False
    p2p_overlap: bool = False
    rotary: bool = True  # False: the framework's positions rotate nothing (MPT's ALiBi), no RoPE outputs kept
    moe: MoeConfig = field(default_factory=MoeConfig)  # the recipe's [moe]: losses and capacity (MoE models)
    moe_imbalance: float = DEFAULT_MOE_IMBALANCE  # expert parallelism: max/mean rows an EP rank receives
    # preference training (its batch sizes above count sequences, two per pair): where the reference log-probs come
    # from, config.preference_reference's "frozen" / "adapters_off" / "precomputed", or "none" for a
    # reference-free loss; "": language-model training
    preference_reference: ReferenceModel | Literal["none", ""] = ""
    # reinforcement learning (data.kind = "rl"; the batch sizes count completions): each replica's leader holds a
    # whole rollout model and decodes its share of the step's completions; rl_reference: a frozen reference (beta > 0)
    rl: bool = False
    rl_reference: bool = False
    rl_batch_rows: int = 0  # completions decoded at once (rl.rollout_batch_size; 0: the leader's whole share)
    rl_generations: int = 1  # completions of one prompt (rl.num_generations): a group's prompt is prefilled once
    rl_completion_tokens: int = RlConfig.max_completion_length  # rl.max_completion_length
    rl_reward_model_params: int = 0  # the reward models rl.reward_funcs names, whole on each leader
    mtp_loss_scaling_factor: float = TrainConfig.mtp_loss_scaling_factor  # train.mtp_loss_scaling_factor

    def rl_prefill_rows(self, rows: int, share: int) -> int:
        """Prompts prefilled for a decode batch of `rows` completions out of a leader's `share`: one a group when
        every decode batch holds whole groups (train/rollouts.generate_groups), else one a row."""
        batch = self.rl_batch_rows or share
        n = self.rl_generations
        return rows // n if share % n == 0 and batch % n == 0 and rows % n == 0 else rows

    @property
    def reference_copy(self) -> bool:
        """A frozen copy of the starting weights (compute dtype, sharded as the policy's TP/PP shards)."""
        return self.preference_reference == "frozen" or self.rl_reference

    @property
    def reference_forward(self) -> bool:
        """A reference forward of every micro-batch, without gradients (the frozen copy, or the policy with its
        LoRA adapters switched off; a precomputed table runs none during training)."""
        return self.preference_reference in ("frozen", "adapters_off") or self.rl_reference

    @property
    def trains_mtp(self) -> bool:
        """Whether the model's multi-token prediction layers run and train (next-token prediction with a non-zero
        weight, as the engine decides); otherwise they are frozen weights."""
        return (self.spec.mtp_num_layers > 0 and self.mtp_loss_scaling_factor > 0 and not self.rl
                and not self.preference_reference and self.spec.head == "lm")

    @property
    def grad_reduce_dtype(self) -> str:
        """The dtype gradients are held and reduced in."""
        return self.framework_reduce_dtype or self.parallel.grad_reduce_dtype

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def dtype_bytes(self) -> int:
        return self.torch_dtype.itemsize

    @property
    def sizes(self) -> ParallelSizes:
        p = self.parallel
        return resolve_sizes(self.num_gpus, p.tp, p.pp, p.cp, p.dp, p.ep, p.etp)

    @property
    def expert_parallel(self) -> bool:
        """Whether the routed experts are dispatched by all-to-all (EP, or an expert-TP size other than tp)."""
        p = self.parallel
        return self.spec.moe is not None and (p.ep > 1 or (p.etp is not None and p.etp != p.tp))

    @property
    def load_factor(self) -> float:
        """The max/mean rows an EP rank receives that the profile sizes for: the allowance, or, with a capacity
        factor, at most that (no expert takes more than its capacity from any source)."""
        cf = self.moe.capacity_factor
        return self.moe_imbalance if cf is None else min(self.moe_imbalance, cf)

    @property
    def num_microbatches(self) -> int:
        return self.global_batch_size // (self.micro_batch_size * self.sizes.dp)

    def layout(self) -> ModelLayout:
        """Its layout; an uneven split's fix names the recipe's keys (profile has flags for the rest)."""
        p = self.parallel
        try:
            return ModelLayout(self.spec, p.tp, p.pp, p.vpp, p.num_layers_in_first_pipeline_stage,
                               p.num_layers_in_last_pipeline_stage, ep=p.ep, etp=p.etp)
        except QlmError as exc:
            raise exc.renamed({flag: f"a recipe's {key}" for flag, key in UNEVEN_SPLIT_KEYS.items()}) from None

    def replace(self, **changes) -> ProfileCase:
        return dataclasses.replace(self, **changes)

    def with_parallel(self, **changes) -> ProfileCase:
        return self.replace(parallel=dataclasses.replace(self.parallel, **changes))

    def describe(self) -> str:
        p, s = self.parallel, self.sizes
        parts = [f"tp{p.tp}", f"pp{p.pp}"] + ([f"vpp{p.vpp}"] if p.vpp > 1 else []) + [f"cp{p.cp}", f"dp{s.dp}"]
        text = " ".join(parts)
        if p.pp > 1:
            text += {"1f1b": " 1f1b", "interleaved_1f1b": " interleaved", "zero_bubble": " zb"}.get(p.pp_schedule,
                                                                                                   " gpipe")
        if p.tp > 1:
            text += " sp" if p.sp else " no-sp"
        if p.cp > 1:
            text += f" {p.cp_comm_type}"
        if self.expert_parallel:
            text += f" ep{s.ep}" + (f" etp{s.etp}" if s.etp != p.tp else "")
        recompute = p.recompute
        per_chunk = self.spec.num_layers // (p.pp * p.vpp)
        if p.recompute == "full" and p.recompute_num_layers is not None and p.recompute_num_layers < per_chunk:
            recompute = f"full({p.recompute_num_layers})"
        if p.recompute == "selective" and list(p.recompute_modules) != ["core_attn"]:
            recompute = f"selective({'+'.join(p.recompute_modules) or 'nothing'})"
        return f"{text} zero{p.zero_stage} {recompute}"


def validate_inputs(case: ProfileCase):
    """The numbers that are wrong whatever the layout (a QlmError says which)."""
    checked_field(ModelConfig, "dtype", case.dtype, "dtype")
    validate_counts(**{"seq-len": case.seq_len, "mbs": case.micro_batch_size, "gbs": case.global_batch_size,
                       "num-gpus": case.num_gpus, "loss-chunk-tokens": case.loss_chunk_tokens,
                       "mean-doc-len": case.mean_doc_len, "tp": case.parallel.tp, "pp": case.parallel.pp,
                       "vpp": case.parallel.vpp, "cp": case.parallel.cp,
                       **({"dp": case.parallel.dp} if case.parallel.dp is not None else {})})
    if case.parallel.recompute_num_layers is not None and case.parallel.recompute_num_layers < 1:
        raise QlmError(f"recompute-num-layers must be >= 1, got {case.parallel.recompute_num_layers}",
                       "pass 1 or more (the layers of each chunk that full recompute covers), as the recipe does")
    if case.lora_rank < 0:
        raise QlmError(f"lora rank must be >= 0, got {case.lora_rank}", "pass 0 (off) or a positive rank")
    check_finite("--moe-imbalance", case.moe_imbalance)
    if not case.moe_imbalance >= 1:
        raise QlmError(f"moe imbalance must be >= 1 (the busiest EP rank's rows over the mean), got "
                       f"{case.moe_imbalance:g}", "pass --moe-imbalance 1 (perfectly balanced) or more")
    moe = case.spec.moe
    if moe is not None and case.moe_imbalance > moe.num_experts / moe.topk:
        # a token sends at most min(k, E/ep) rows to one EP rank: max/mean <= min(ep, E/k) at any ep
        raise QlmError(f"--moe-imbalance {case.moe_imbalance:g} is more than any EP rank can receive (at most "
                       f"experts / top-k = {moe.num_experts}/{moe.topk} = {moe.num_experts / moe.topk:g} x the mean)",
                       f"pass --moe-imbalance between 1 and {moe.num_experts / moe.topk:g}")


def validate_case(case: ProfileCase) -> tuple[ParallelSizes, ModelLayout]:
    """Everything the trainer checks before it starts (a QlmError says what is wrong)."""
    validate_inputs(case)
    p = case.parallel
    layout = case.layout()
    model_ranks = p.tp * p.pp * p.cp
    if p.dp is None and case.num_gpus % model_ranks:
        raise QlmError(f"{case.num_gpus} GPUs are not divisible by tp*pp*cp = {model_ranks}",
                       "pass --num-gpus as a multiple of tp*pp*cp or change the layout")
    if case.preference_reference:
        validate_preference_model(case.spec)
    sizes = case.sizes
    rows = case.micro_batch_size * sizes.dp
    if p.dp is None and case.global_batch_size % rows:  # dp came from the device count, not from the user
        raise QlmError(f"at {case.num_gpus} GPUs (dp {sizes.dp}) the global batch of {case.global_batch_size} "
                       f"sequences is not a multiple of micro-batch x dp = {rows}",
                       f"pass the run's device count as --num-gpus ({SEED_GPUS} when left out), or --dp (a "
                       "recipe's parallel.dp), or change the batch sizes")
    if case.rl:
        validate_rl_prompts(case.global_batch_size, case.rl_generations, sizes.dp, ", or use another device count")
    validate_layout(case.spec, p, sizes, case.seq_len, case.micro_batch_size, case.global_batch_size,
                    rows_per_sample=2 if case.preference_reference else 1)
    validate_experts(case.spec, p)
    validate_moe(case.spec, case.moe, p, case.lora_rank)
    validate_grad_reduce_dtype(p.grad_reduce_dtype, case.dtype)
    try:
        validate_recompute(p.pp_schedule, p.pp, p.recompute)
    except ValueError as exc:
        raise QlmError(str(exc), "use pp_schedule 1f1b or interleaved_1f1b, or another recompute") from None
    return sizes, layout


def load_spec(model: str | Path) -> tuple[ModelSpec, str]:
    """A preset name or an HF directory / config.json."""
    spec = load_model_spec(model)
    return spec, str(model)


def case_from_recipe(recipe: Recipe, num_gpus: int | None = None, spec: ModelSpec | None = None) -> ProfileCase:
    """The recipe's model (what model.load holds, any checkpoint qlm train reads, when it exists here; else
    model.spec), layout and batch. `spec`: the model's numbers when the caller already has them."""
    from qlm_core.train.sources import recipe_head, resolve_model

    model = recipe.model
    if model.load and not Path(model.load).exists():
        model = dataclasses.replace(model, load="")
    name = model.load or model.spec
    spec = spec or resolve_model(model, recipe.moe, head=recipe_head(recipe)).spec
    p = dataclasses.replace(recipe.parallel)
    if num_gpus is None:
        num_gpus = p.tp * p.pp * p.cp * p.dp if p.dp else SEED_GPUS
    rows = rows_per_sample(recipe)  # a preference pair is two sequences of one micro-batch
    reference = (preference_reference(recipe) or "none") if recipe.data.kind == "preference" else ""
    return ProfileCase(
        spec=spec, model_name=name, parallel=p, seq_len=recipe.data.seq_length,
        micro_batch_size=recipe.train.micro_batch_size * rows, global_batch_size=recipe.train.global_batch_size * rows,
        preference_reference=reference, rl=recipe.data.kind == "rl",
        rl_reference=recipe.data.kind == "rl" and recipe.rl.beta > 0, rl_batch_rows=recipe.rl.rollout_batch_size,
        rl_completion_tokens=recipe.rl.max_completion_length, rl_generations=recipe.rl.num_generations,
        rl_reward_model_params=reward_model_parameters(recipe),
        num_gpus=num_gpus, dtype=recipe.model.dtype, lora_rank=recipe.lora.rank,
        lora_targets=tuple(recipe.lora.target_modules), loss_chunk_tokens=recipe.train.loss_chunk_tokens,
        mean_doc_len=recipe.data.mean_doc_len, moe=dataclasses.replace(recipe.moe),
        mtp_loss_scaling_factor=recipe.train.mtp_loss_scaling_factor,
    )


def reward_model_parameters(recipe: Recipe) -> int:
    """The parameters of the reward models an RL recipe's rl.reward_funcs names (0 for functions only)."""
    from qlm_core.train.reward_model_source import is_reward_model_path
    from qlm_core.train.rewards import BUILT_IN

    if recipe.data.kind != "rl":
        return 0
    return sum(num_parameters(open_checkpoint(name).spec) for name in recipe.rl.reward_funcs
               if name not in BUILT_IN and is_reward_model_path(name))


def case_to_dict(case: ProfileCase) -> dict:
    """JSON-ready; case_from_dict(case_to_dict(c)) == c (the probe hands its case to worker ranks this way)."""
    data = dataclasses.asdict(case)
    data["lora_targets"] = list(case.lora_targets)
    return data


def case_from_dict(data: dict) -> ProfileCase:
    from qlm_core.models.moe_spec import MoeSpec
    from qlm_core.models.spec import RopeScaling

    spec = dict(data["spec"])
    if spec.get("rope_scaling") is not None:
        spec["rope_scaling"] = RopeScaling(**spec["rope_scaling"])
    if spec.get("moe") is not None:
        spec["moe"] = MoeSpec(**{**spec["moe"], "layer_pattern": tuple(spec["moe"]["layer_pattern"])})
    fields = {k: v for k, v in data.items() if k not in ("spec", "parallel", "lora_targets", "moe")}
    return ProfileCase(spec=ModelSpec(**spec), parallel=ParallelConfig(**data["parallel"]),
                       lora_targets=tuple(data["lora_targets"]), moe=MoeConfig(**data.get("moe", {})), **fields)


def build_case(recipe: Recipe | None = None, *, model: str | None = None, seq_len: int | None = None,
               micro_batch_size: int | None = None, global_batch_size: int | None = None,
               num_gpus: int | None = None, dtype: str | None = None, lora_rank: int | None = None,
               loss_chunk_tokens: int | None = None, mean_doc_len: int | None = None,
               **parallel) -> ProfileCase:
    """The seed's case, replaced by `recipe` when given, then by every option that is not None. `parallel` takes
    ParallelConfig's keys. The device count is `num_gpus`, else tp·pp·cp·dp when dp is set, else 32. A `model`
    without a recipe keeps none of the seed's layout: ParallelConfig's defaults (tp 1, no CP, ZeRO 0, no recompute)
    under the options given, on tp·pp·cp devices (dp 1) unless num_gpus or dp says otherwise; the CLI then looks
    for the smallest layout that fits when no layout option is given (search.smallest_fitting)."""
    if recipe is not None:
        case = case_from_recipe(recipe, num_gpus)
    elif model is not None:  # the user's model: none of the seed's layout, qlm's defaults (ParallelConfig's)
        spec, name = load_spec(model)
        case = ProfileCase(spec=spec, model_name=name, parallel=ParallelConfig())
    else:
        spec, name = load_spec(SEED_MODEL)
        case = ProfileCase(spec=spec, model_name=name)
    if model is not None and recipe is not None:
        spec, name = load_spec(model)
        case = case.replace(spec=spec, model_name=name)
    unknown = set(parallel) - {f.name for f in dataclasses.fields(ParallelConfig)}
    if unknown:
        raise QlmError(f"unknown parallel options {sorted(unknown)}", "see qlm profile --help")
    case = case.with_parallel(**{k: checked_field(ParallelConfig, k, v, f"parallel.{k}")
                                 for k, v in parallel.items() if v is not None})
    if parallel.get("zero_stage") is not None:  # the parameter all-gather exists only under ZeRO 1/2
        case = case.with_parallel(overlap_param_gather=case.parallel.zero_stage in (1, 2))
    rows = 2 if case.preference_reference else 1  # a preference recipe's --mbs / --gbs count pairs, as its [train]
    changes = dict(seq_len=seq_len, micro_batch_size=micro_batch_size and micro_batch_size * rows,
                   global_batch_size=global_batch_size and global_batch_size * rows, dtype=dtype,
                   lora_rank=lora_rank, loss_chunk_tokens=loss_chunk_tokens, mean_doc_len=mean_doc_len)
    case = case.replace(**{k: v for k, v in changes.items() if v is not None})
    if case.preference_reference in ("frozen", "adapters_off"):  # --lora-rank decides between them, as a recipe
        case = case.replace(preference_reference=model_reference(case.lora_rank))
    p = case.parallel
    if num_gpus is not None:
        case = case.replace(num_gpus=num_gpus)
    elif parallel.get("dp") is not None or (recipe is not None and p.dp):
        case = case.replace(num_gpus=p.tp * p.pp * p.cp * p.dp)
    elif recipe is None and model is not None:  # one model replica: dp 1
        case = case.replace(num_gpus=p.tp * p.pp * p.cp)
    return case
