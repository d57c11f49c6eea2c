"""Recipes: TOML files mapped 1:1 onto dataclasses, dotted `--set section.key=value` overrides, and validation
that names the bad key and the nearest valid one. The resolved recipe is written back as TOML into the run."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import tomllib

from qlm_core.errors import QlmError

# The recipe's enumerated choices: each is checked once, when a recipe is read (see _coerce), and every layer and
# CLI option that offers a choice takes its values from here.
CpCommType = Literal["p2p", "allgather", "a2a"]
PpSchedule = Literal["1f1b", "gpipe", "interleaved_1f1b", "zero_bubble"]
# selective: the modules in recompute_modules (Megatron's --recompute-granularity selective); full: whole layers;
# op: torchtitan's per-op selective checkpointing (selective_ac_option = "op": each layer checkpointed, the
# attention kernel's and every other matmul's outputs saved, the rest recomputed)
RecomputeMode = Literal["none", "selective", "full", "op"]
# Megatron's --recompute-modules that apply to a dense decoder: core_attn (the attention kernel), mlp (the whole MLP),
# layernorm (both norms, their outputs discarded and recomputed)
RecomputeModule = Literal["core_attn", "mlp", "layernorm"]
ZeroStage = Literal[0, 1, 2, 3]
WeightDtype = Literal["fp32", "bf16", "fp16"]  # every dtype qlm reads and writes weights in
TrainDtype = Literal["bf16", "fp32"]  # fp16 would need loss scaling, which qlm does not do
# the dtype of the gradient buffers and of their data-parallel reduction (fp32, or the training dtype: Megatron's
# grad_reduce_in_fp32=False); the optimizer's masters and updates stay fp32 either way
GradReduceDtype = Literal["fp32", "bf16"]  # bf16 only with bf16 training (train/validate.py)
EvalBackend = Literal["qlm", "hf"]  # qlm's own model, or lm-eval's hf model on an HF export
DataKind = Literal["sft", "pretrain", "preference", "reward", "rl"]
PAIR_KINDS = ("preference", "reward")  # data kinds read as preference pairs (a chosen and a rejected sequence)
SftFormat = Literal["auto", "alpaca", "sharegpt", "messages"]  # data/sft.py
PreferenceFormat = Literal["auto", "trl", "alpaca", "sharegpt"]  # data/preference.py
DataFormat = Literal["auto", "alpaca", "sharegpt", "messages", "trl"]  # either kind's (train/validate.py checks)
# the preference losses (train/objectives/preference_loss.py): the DPO family needs a reference model, simpo and
# orpo do not
PreferenceLossType = Literal["sigmoid", "hinge", "ipo", "simpo", "orpo"]
REFERENCE_FREE_LOSSES = ("simpo", "orpo")
# where the DPO family's reference log-probs come from: a frozen copy of the starting weights, the policy with its
# LoRA adapters switched off, or the table computed before the first step (preference_reference)
ReferenceModel = Literal["frozen", "adapters_off", "precomputed"]
# which end of a prompt longer than max_prompt_length is kept (TRL's truncation_mode)
PreferenceTruncation = Literal["keep_end", "keep_start"]
Truncation = Literal["right", "drop"]
LrSchedule = Literal["constant", "cosine", "wsd"]
CheckpointFormat = Literal["torch", "torch_dist"]
ConvertTargetName = Literal["hf", "torch", "torch_dist", "deepspeed", "peft"]  # what `qlm convert --to` writes
# megatron: E·Σ fᵢ·Pᵢ per MoE layer over the micro-batch (Megatron-Core's aux_loss); sequence: the same per row of
# the micro-batch, averaged over its rows (Megatron-Core's seq_aux_loss, DeepSeek-V2's sequence-wise loss); global:
# fᵢ over every data-parallel rank's micro-batch, averaged over the step's micro-batches so far (Megatron-Core's
# global_aux_loss, the global-batch balancing Qwen3-MoE was trained with); transformers: one such loss over every
# layer's router logits together (transformers' load_balancing_loss_func, k times larger for one layer)
MoeAuxLossType = Literal["megatron", "sequence", "global", "transformers"]
# reinforcement learning (train/objectives/grpo_loss.py, train/rewards.py): the policy-gradient loss's reduction, the
# importance ratio per token or per sequence (GSPO), the KL estimator, how advantages are scaled (group std, batch
# std, none: Dr. GRPO) and how log-probs that differ between rollout and trainer are corrected (TIS / masked IS)
GrpoLossType = Literal["grpo", "bnpo", "dr_grpo", "dapo"]
ImportanceSamplingLevel = Literal["token", "sequence"]
KlEstimator = Literal["k1", "k2", "k3"]
ScaleRewards = Literal["group", "batch", "none"]
RolloutCorrection = Literal["none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]
# softmax over the experts, or each expert's sigmoid score (DeepSeek-V3; Megatron's --moe-router-score-function)
RouterScoreFunction = Literal["softmax", "sigmoid"]


def choices(literal) -> tuple:
    """The values of one of the Literal types above, in order."""
    return typing.get_args(literal)


def bounded(default: Any, *, least: float | None = None, above: float | None = None, below: float | None = None,
            most: float | None = None, meaning: str = ""):
    """A numeric field with its valid range (checked when a recipe is read, see check_range): least <= v, above < v,
    v < below, v <= most. `meaning` says what the number is, for the error's fix."""
    return field(default=default, metadata={"least": least, "above": above, "below": below, "most": most,
                                            "meaning": meaning})


def _range_text(meta: dict) -> str:
    parts = [f"{sign} {meta[key]:g}" for key, sign in (("least", ">="), ("above", ">"), ("below", "<"), ("most", "<="))
             if meta[key] is not None]
    return " and ".join(parts)


def _outside(v: float, meta: dict) -> bool:
    return ((meta["least"] is not None and v < meta["least"]) or (meta["above"] is not None and v <= meta["above"])
            or (meta["below"] is not None and v >= meta["below"]) or (meta["most"] is not None and v > meta["most"]))


def check_finite(where: str, value: Any):
    """nan and ±inf pass every comparison-based range check (nan compares false, inf is above any floor): refused
    here, for recipe keys and command-line flags alike."""
    for v in value if isinstance(value, list) else [value]:
        if isinstance(v, float) and not math.isfinite(v):
            raise QlmError(f"{where} must be a finite number, got {v!r}", "give a real number (not nan or inf)")


def check_range(where: str, value: Any, meta: dict):
    """Raise the one-line error when `value` is not finite or lies outside the range `bounded` recorded in `meta`
    (None passes)."""
    if value is None:
        return
    check_finite(where, value)
    if not meta or "least" not in meta:
        return
    for v in value if isinstance(value, list) else [value]:
        if _outside(v, meta):
            fix = f"set it {_range_text(meta)}" + (f" ({meta['meaning']})" if meta["meaning"] else "")
            raise QlmError(f"{where} must be {_range_text(meta)}, got {v!r}", fix)


def check_number(where: str, value: float | int | None, *, least: float | None = None, above: float | None = None,
                 below: float | None = None, most: float | None = None, meaning: str = ""):
    """One command-line number (`where` is its flag) against its range, as a recipe key is checked; None passes."""
    check_range(where, value, {"least": least, "above": above, "below": below, "most": most, "meaning": meaning})


def check_ranges(section: str, config) -> None:
    """Every bounded field of one config dataclass (for configs built in code rather than read from a recipe)."""
    for f in dataclasses.fields(config):
        check_range(f"{section}.{f.name}", getattr(config, f.name), dict(f.metadata))


@dataclass
class ParallelConfig:
    """[parallel]: the layout. Key names are fixed: scripts rely on them."""

    tp: int = bounded(1, least=1)
    pp: int = bounded(1, least=1)
    vpp: int = bounded(1, least=1)
    cp: int = bounded(1, least=1)
    dp: int | None = bounded(None, least=1)  # None: world / (tp * pp * cp)
    ep: int = bounded(1, least=1)  # expert model parallel (MoE): the routed experts divided among ep ranks
    etp: int | None = bounded(None, least=1)  # expert tensor parallel; None: tp, as Megatron-Core
    sp: bool = False
    cp_comm_type: CpCommType = "p2p"
    pp_schedule: PpSchedule = "1f1b"
    zero_stage: ZeroStage = 0
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    recompute: RecomputeMode = "none"
    recompute_num_layers: int | None = bounded(None, least=1)
    recompute_modules: list[RecomputeModule] = field(default_factory=lambda: ["core_attn"])  # with selective
    num_layers_in_first_pipeline_stage: int | None = bounded(None, least=1)
    num_layers_in_last_pipeline_stage: int | None = bounded(None, least=1)
    bucket_size_mb: float = bounded(40.0, above=0)
    grad_reduce_dtype: GradReduceDtype = "fp32"


@dataclass
class OptimConfig:
    """[optim]: AdamW (decoupled weight decay; none on biases and norms) and gradient clipping."""

    lr: float = bounded(3e-4, above=0, meaning="the peak learning rate, e.g. 3e-4")
    weight_decay: float = bounded(0.1, least=0)
    beta1: float = bounded(0.9, least=0, below=1)
    beta2: float = bounded(0.95, least=0, below=1)
    eps: float = bounded(1e-8, above=0)
    clip_grad: float = bounded(1.0, least=0, meaning="0 turns clipping off")


@dataclass
class ModelConfig:
    spec: str = "qwen2-0.5b"  # a preset name or an HF model directory / config.json
    load: str = ""  # weights: an HF directory, a Megatron checkpoint or a qlm run directory; empty = random init
    tokenizer: str = ""  # default: the HF directory given in spec/load (or load's hf/ side directory)
    dtype: TrainDtype = "bf16"  # compute dtype: bf16 (fp32 master weights; gradients per grad_reduce_dtype) or fp32


@dataclass
class DataConfig:
    kind: DataKind = "sft"
    train: list[str] = field(default_factory=list)  # sft: json/jsonl files; pretrain: indexed-dataset prefixes
    # pretrain blend weights (default: equal)
    weights: list[float] = field(default_factory=list, metadata=bounded(None, least=0).metadata)
    valid: list[str] = field(default_factory=list)  # validation files/prefixes (default: split off train)
    split: str = "98,2"  # pretrain: train,valid shares of the documents when `valid` is empty
    valid_fraction: float = bounded(0.05, least=0, below=1)  # sft: share of the examples held out when `valid` is empty
    format: DataFormat = "auto"  # sft; auto: told by the first record
    chat_template: str = ""  # sft: empty = the tokenizer's own; or chatml (qwen) | llama3
    seq_length: int = bounded(2048, least=1)
    packing: bool = True  # sft: pack several samples per sequence (positions restart, attention per sample)
    truncation: Truncation = "right"  # sft: right keeps a long sample's first tokens, drop leaves it out
    reset_position_ids: bool = False  # pretrain: restart positions (and attention) at each document boundary
    # packed data's token-weighted mean document length E[L^2]/E[L] (what attention work scales with: a token's
    # document is long more often than a document is), for qlm profile; 0: one document per sequence
    mean_doc_len: int = bounded(0, least=0, meaning="0: one document per sequence")
    workers: int = bounded(1, least=1)  # tokenisation processes
    seed: int = 1234
    cache_dir: str = ""  # tokenised-data and demo cache; empty = RUN/cache


COMPILE_AUTO_STEPS = 500  # train.compile left out: compiled from this many steps (bench/train.py: break-even ~70)


def compiles(train: TrainConfig, steps: int, rl: bool = False) -> bool:
    """Whether a run of `steps` steps compiles its decoder layers (train.compile, or its default). An RL run
    (`rl`) stays eager unless asked: its rollouts decode eagerly, and inductor's fused kernels in the training
    forward would part the trainer's log-probs from the sampler's by more than rounding."""
    if train.compile is not None:
        return train.compile
    return not rl and steps >= COMPILE_AUTO_STEPS


def compile_text(train: TrainConfig, steps: int, rl: bool = False) -> str:
    """The decision in words, for the dry run and the run header."""
    if train.compile is not None:
        return f"{'on' if train.compile else 'off'} (train.compile)"
    if rl:
        return "off (train.compile left out: an RL run's training forward stays the eager one its rollouts decode with)"
    return (f"{'on' if compiles(train, steps) else 'off'} (train.compile left out: on for runs of >= "
            f"{COMPILE_AUTO_STEPS} steps, this one has {steps})")


@dataclass
class TrainConfig:
    micro_batch_size: int = bounded(1, least=1)
    global_batch_size: int = bounded(8, least=1)
    train_iters: int = bounded(0, least=0)  # one of train_iters / train_samples
    train_samples: int = bounded(0, least=0)
    eval_interval: int = bounded(0, least=0)  # validation loss every N steps (0: only at the end)
    eval_iters: int = bounded(4, least=1)
    max_skipped_steps: int = bounded(3, least=1)  # stop after this many consecutive non-finite steps
    # save and exit when the step count is a multiple of this (e.g. job time slots)
    exit_interval: int = bounded(0, least=0)
    # save and exit once the run has taken this many minutes (Megatron's --exit-duration-in-mins); 0: off
    exit_duration_minutes: float = bounded(0.0, least=0, meaning="0 turns it off")
    # on SIGTERM / SIGINT every rank finishes its step, a checkpoint is saved, and the run exits (Megatron's
    # --exit-signal-handler)
    exit_signal_handler: bool = True
    # output projection + cross entropy this many tokens at a time (0: all at once)
    loss_chunk_tokens: int = bounded(2048, least=0, meaning="0: the loss over all logits at once")
    # a model with multi-token prediction layers (DeepSeek-V3's) trains them with next-token prediction, their loss
    # weighted by this (Megatron's --mtp-loss-scaling-factor); 0: they do not run and stay as loaded
    mtp_loss_scaling_factor: float = bounded(0.1, least=0, meaning="Megatron's --mtp-loss-scaling-factor")
    # torch.compile each decoder layer (regional compilation); its compile cost is paid once, in the first step.
    # Absent: on for runs of at least COMPILE_AUTO_STEPS steps (where the gain outweighs that cost), else off
    compile: bool | None = None
    # hand the caching allocator's unused blocks back to the device every N steps (torch.cuda.empty_cache; 0: never)
    empty_cache_interval: int = bounded(0, least=0, meaning="0 turns it off")
    seed: int = 1234
    output: str = "runs/qlm"


@dataclass
class ScheduleConfig:
    lr_schedule: LrSchedule = "cosine"
    warmup_iters: int = bounded(0, least=0)
    min_lr: float = bounded(0.0, least=0)
    wsd_decay_fraction: float = bounded(0.1, least=0, most=1)  # wsd: the final share of steps that decays to min_lr


@dataclass
class CheckpointConfig:
    save_interval: int = bounded(0, least=0)  # 0: only at the end
    keep_last: int = bounded(2, least=0, meaning="0 keeps every checkpoint")
    resume: bool = True  # continue from the run directory's latest checkpoint if there is one
    # resume from this iteration of the run directory's checkpoints (None: the latest; Megatron's --ckpt-step)
    load_iteration: int | None = bounded(None, least=1)
    format: CheckpointFormat = "torch"  # torch: Megatron legacy, a file per TP/PP rank; torch_dist: Megatron's DCP
    # copy each checkpoint to host memory and write it on a background thread while training goes on (the next
    # save, the end and the exits wait for it); the staging, rename and latest-last rules are the same
    async_save: bool = False


@dataclass
class LoggingConfig:
    tensorboard: bool = True  # when the tensorboard package is installed
    plot: bool = True  # loss-curve PNG at the end (matplotlib when installed)
    peak_tflops: float = bounded(0.0, least=0)  # per device, for MFU; 0: a GPU preset or a CPU matmul probe
    # Weights & Biases (when wandb is installed; WANDB_MODE=offline works without a network): empty project = off
    wandb_project: str = ""
    wandb_entity: str = ""
    wandb_exp_name: str = ""  # the run's name (default: the run directory's name)
    wandb_save_dir: str = ""  # default: RUN/wandb


@dataclass
class LoraConfig:
    rank: int = bounded(0, least=0)  # 0: LoRA off
    alpha: float = bounded(16.0, above=0)
    dropout: float = bounded(0.0, least=0, below=1)
    target_modules: list[str] = field(default_factory=lambda: ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"])


@dataclass
class MoeConfig:
    """How Mixture-of-Experts layers train (ignored by dense models)."""

    aux_loss_coeff: float = bounded(0.0, least=0, meaning="Megatron's --moe-aux-loss-coeff, e.g. 1e-3")
    z_loss_coeff: float = bounded(0.0, least=0, meaning="Megatron's --moe-z-loss-coeff, e.g. 1e-3")
    capacity_factor: float | None = bounded(None, above=0)  # absent: drop-less; else ceil(T·k/E·cf) tokens an expert
    aux_loss_type: MoeAuxLossType = "megatron"
    # the router of a model trained from scratch (absent: the model's own; a loaded model keeps its router):
    # Megatron's --moe-router-score-function and --moe-router-enable-expert-bias. The expert bias is aux-loss-free
    # balancing (DeepSeek-V3): a per-expert bias added to the scores only to choose the top k, moved after every step
    # by router_bias_update_rate toward an even load over the global batch; with sigmoid routing, as in Megatron
    # (ERNIE 4.5 MoE models bring their own softmax router with the bias)
    router_score_function: RouterScoreFunction | None = None
    router_expert_bias: bool | None = None
    router_bias_update_rate: float = bounded(1e-3, least=0, meaning="Megatron's --moe-router-bias-update-rate")


@dataclass
class PreferenceConfig:
    """[preference]: preference alignment (data.kind = "preference"). TRL's names and defaults where TRL has them."""

    loss_type: PreferenceLossType = "sigmoid"
    beta: float = bounded(0.1, above=0, meaning="DPO's beta (IPO's tau, SimPO's beta, ORPO's lambda), e.g. 0.1")
    label_smoothing: float = bounded(0.0, least=0, below=0.5, meaning="cDPO's label-flip probability")
    simpo_gamma: float = bounded(0.5, least=0, meaning="SimPO's target reward margin")
    rpo_alpha: float | None = bounded(None, least=0)  # DPO family: weight of an NLL term on the chosen responses
    cpo_alpha: float = bounded(0.0, least=0)  # simpo: weight of an NLL term on the chosen responses
    # the DPO family's reference log-probs computed once, before the first step, with the starting weights, and kept
    # beside the tokenised data (reused by every epoch and resume) instead of a reference model run every step
    precompute_reference: bool = False
    max_length: int | None = bounded(None, least=2)  # prompt + response tokens; None: data.seq_length
    max_prompt_length: int | None = bounded(None, least=1)  # None: up to max_length - 1
    truncation_mode: PreferenceTruncation = "keep_end"


@dataclass
class RewardConfig:
    """[reward]: a Bradley-Terry reward model (data.kind = "reward") trained on preference pairs: the model gets a
    scalar head read at each sequence's last token (a new one, when model.load is a language model). TRL's
    RewardConfig names."""

    center_rewards_coefficient: float | None = bounded(None, least=0)  # weight of mean((r_c + r_r)²); None: off
    max_length: int | None = bounded(None, least=2)  # prompt + response tokens; None: data.seq_length


@dataclass
class RlConfig:
    """[rl]: reinforcement learning with verifiable rewards (data.kind = "rl"): each step the policy answers
    train.global_batch_size / num_generations prompts num_generations times, the answers are scored and one optimizer
    step is taken on them. TRL's GRPOConfig names and meanings where TRL has them."""

    num_generations: int = bounded(8, least=1)  # completions per prompt (a group)
    max_completion_length: int = bounded(64, least=1)
    temperature: float = bounded(1.0, above=0, meaning="the sampling temperature, e.g. 1.0")
    top_p: float = bounded(1.0, above=0, most=1)
    top_k: int = bounded(0, least=0, meaning="0 turns it off")
    loss_type: GrpoLossType = "dapo"
    importance_sampling_level: ImportanceSamplingLevel = "token"  # sequence: GSPO
    epsilon: float = bounded(0.2, least=0)
    epsilon_high: float | None = bounded(None, least=0)  # None: epsilon (DAPO's clip-higher sets it above)
    delta: float | None = bounded(None, above=1)  # two-sided clipping of the ratio (INTELLECT-2)
    dual_clip: float | None = bounded(None, above=1)  # dual-clip PPO's c for negative advantages
    beta: float = bounded(0.0, least=0, meaning="the KL coefficient; 0: no reference model")
    kl_estimator: KlEstimator = "k3"
    scale_rewards: ScaleRewards = "group"  # none: Dr. GRPO
    # built-ins (exact_answer, math_answer, think_format) or module:function, called as fn(prompt, completion, record)
    reward_funcs: list[str] = field(default_factory=lambda: ["exact_answer"])
    reward_weights: list[float] = field(default_factory=list)  # one per reward_funcs entry; default 1 each
    mask_truncated_completions: bool = False  # DAPO's overlong filtering: truncated completions do not train
    overlong_buffer: int = bounded(0, least=0, meaning="DAPO's soft overlong punishment length; 0 turns it off")
    overlong_penalty_factor: float = bounded(1.0, least=0)
    dynamic_sampling: bool = False  # DAPO: groups with equal rewards dropped, more prompts drawn
    max_sampling_tries: int = bounded(4, least=1)  # dynamic sampling: prompt draws per step at most
    # completions a replica's leader decodes at once (its KV cache holds this many sequences); 0: its whole share
    rollout_batch_size: int = bounded(0, least=0, meaning="0: each rank's whole share at once")
    rollout_correction: RolloutCorrection = "none"
    # an MoE policy: the trainer routes each token to the experts the rollout chose (R3); false: its own routers
    # choose, and metrics.jsonl still counts where they differ from the rollout's (moe_route_mismatch)
    routing_replay: bool = True
    # the training forward runs a group's prompt once for its completions (a dense model at pp = cp = 1 without
    # sliding windows, MTP or compile; the same loss and gradients, to rounding); false: every row whole
    shared_prefix: bool = True
    correction_clip_min: float | None = bounded(None, least=0)
    correction_clip_max: float | None = bounded(3.0, least=0)
    # held-out evaluation (train.eval_interval): prompts scored, and completions written to RUN/completions.jsonl
    eval_prompts: int = bounded(64, least=1)
    num_completions_to_print: int = bounded(4, least=0)


@dataclass
class Recipe:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    moe: MoeConfig = field(default_factory=MoeConfig)
    preference: PreferenceConfig = field(default_factory=PreferenceConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    rl: RlConfig = field(default_factory=RlConfig)


def preference_reference(recipe: Recipe) -> ReferenceModel | None:
    """Where a preference run's reference log-probs come from; None: a reference-free loss (simpo, orpo)."""
    if recipe.preference.loss_type in REFERENCE_FREE_LOSSES:
        return None
    if recipe.preference.precompute_reference:
        return "precomputed"
    return model_reference(recipe.lora.rank)


def model_reference(lora_rank: int) -> ReferenceModel:
    """A reference that runs a forward each step: the policy with its adapters off under LoRA, else a frozen copy."""
    return "adapters_off" if lora_rank > 0 else "frozen"


def rows_per_sample(recipe: Recipe) -> int:
    """Sequences per sample of train.micro_batch_size / global_batch_size: a preference pair is two (a reward
    model's pairs too)."""
    return 2 if recipe.data.kind in PAIR_KINDS else 1


SECTIONS = {f.name: f.type for f in dataclasses.fields(Recipe)}


def _closest(value: Any, options) -> Any:
    """The option nearest to `value`: by spelling, or by distance between whole numbers; None when none is close."""
    options = list(options)
    if type(value) is int and all(type(o) is int for o in options):
        return min(options, key=lambda o: abs(o - value))
    match = difflib.get_close_matches(str(value), [str(o) for o in options], n=1, cutoff=0.5)
    return next(o for o in options if str(o) == match[0]) if match else None


def _nearest(name: str, options) -> str:
    match = _closest(name, options)
    return f"did you mean {match!r}?" if match is not None else f"valid keys: {', '.join(sorted(options))}"


@functools.cache
def _field_types(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _coerce(where: str, value: Any, kind) -> Any:
    """Check a TOML value against a dataclass field type (ints are accepted for floats)."""
    origin = typing.get_origin(kind)
    args = typing.get_args(kind)
    if origin is Literal:
        # type() and not ==: True == 1 and 1 == 1.0, but neither is a valid zero_stage
        if not any(type(value) is type(a) and value == a for a in args):
            match = _closest(value, args)
            fix = f"did you mean {match!r}?" if match is not None else f"set {where} to one of them"
            raise QlmError(f"{where} {value!r} is not one of {', '.join(map(str, args))}", fix)
        return value
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        if value is None and type(None) in args:
            return None
        kinds = [a for a in args if a is not type(None)]
        return _coerce(where, value, kinds[0])
    if origin is list:
        if not isinstance(value, list):
            raise QlmError(f"{where} must be a list, got {value!r}", f"write {where.split('.')[-1]} = [...]")
        return [_coerce(f"{where}[{i}]", v, args[0]) for i, v in enumerate(value)]
    if kind is bool:
        if not isinstance(value, bool):
            raise QlmError(f"{where} must be true or false, got {value!r}", "use a TOML boolean")
        return value
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise QlmError(f"{where} must be an integer, got {value!r}", "use a whole number")
        return value
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise QlmError(f"{where} must be a number, got {value!r}", "use a number")
        check_finite(where, float(value))
        return float(value)
    if kind is str:
        if not isinstance(value, str):
            raise QlmError(f"{where} must be a string, got {value!r}", "quote the value")
        return value
    return value


def _field_metadata(cls: type, key: str) -> dict:
    return dict(next(f.metadata for f in dataclasses.fields(cls) if f.name == key))


def checked_field(cls: type, key: str, value: Any, where: str) -> Any:
    """`value` for field `key` of the config dataclass `cls`, checked as a recipe's value is (errors name `where`)."""
    value = _coerce(where, value, _field_types(cls)[key])
    check_range(where, value, _field_metadata(cls, key))
    return value


def recipe_from_dict(data: dict[str, Any]) -> Recipe:
    recipe = Recipe()
    for section, values in data.items():
        if section not in SECTIONS:
            raise QlmError(f"unknown section [{section}]", _nearest(section, SECTIONS))
        if not isinstance(values, dict):
            raise QlmError(f"[{section}] must be a table", f"write [{section}] followed by key = value lines")
        target = getattr(recipe, section)
        types = _field_types(type(target))
        for key, value in values.items():
            if key not in types:
                raise QlmError(f"unknown key {section}.{key}", _nearest(key, types))
            value = _coerce(f"{section}.{key}", value, types[key])
            check_range(f"{section}.{key}", value, _field_metadata(type(target), key))
            setattr(target, key, value)
    return recipe


def parse_override(text: str) -> tuple[str, str, Any]:
    """`section.key=value`; the value is read as TOML (numbers, true/false, lists, quoted strings), else a string."""
    if "=" not in text or "." not in text.split("=", 1)[0]:
        raise QlmError(f"--set {text!r} is not section.key=value", "e.g. --set parallel.tp=2")
    path, raw = text.split("=", 1)
    section, key = path.strip().split(".", 1)
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return section, key, value


def load_recipe(path: str | Path | None, overrides: list[str] = ()) -> Recipe:
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if path.is_dir():
            raise QlmError(f"recipe {path} is a directory", "pass the path of a .toml recipe")
        if not path.is_file():
            raise QlmError(f"recipe {path} does not exist", "pass the path of a .toml recipe")
        try:
            data = tomllib.loads(path.read_bytes().decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise QlmError(f"recipe {path} is not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset "
                           f"{exc.start})", "save the recipe as UTF-8") from None
        except PermissionError:
            raise QlmError(f"recipe {path} cannot be read (permission denied)", "make it readable") from None
        except OSError as exc:
            raise QlmError(f"recipe {path} cannot be read ({exc.strerror or exc})", "check the file and its disk") \
                from None
        except tomllib.TOMLDecodeError as exc:
            raise QlmError(f"{path} is not valid TOML ({exc})", "fix the syntax at the position shown") from None
        try:  # the file's own mistakes name the file; those of --set name the override
            recipe_from_dict(data)
        except QlmError as exc:
            raise QlmError(f"recipe {path}: {exc.problem}", exc.fix) from None
    for text in overrides:
        section, key, value = parse_override(text)
        if not isinstance(data.setdefault(section, {}), dict):
            raise QlmError(f"[{section}] must be a table", f"write [{section}] followed by key = value lines")
        data[section][key] = value
    return recipe_from_dict(data)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} as TOML")


def recipe_to_toml(recipe: Recipe) -> str:
    lines = []
    for section in SECTIONS:
        lines.append(f"[{section}]")
        for key, value in dataclasses.asdict(getattr(recipe, section)).items():
            if value is not None:  # TOML has no null: an absent key means the default (None)
                lines.append(f"{key} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)
