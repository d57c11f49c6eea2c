"""The rules that tie recipe fields together, each written once. Each field's type and choices were checked when
the recipe was read (config._coerce); what is left needs several fields, the world or the model.

validate_recipe needs only the recipe: `qlm train` runs it before it opens any file the recipe names, and every
worker runs it again (a worker started by srun or a user's torchrun never passed through the launcher). The layout
rules need the world and the model's numbers: `qlm train` runs validate_layout once it has them, and so do the
Engine (built by workers and tests without a Recipe) and `qlm profile`.
"""

from __future__ import annotations

from qlm_core.config import (
    PAIR_KINDS,
    REFERENCE_FREE_LOSSES,
    MoeConfig,
    ParallelConfig,
    PreferenceFormat,
    Recipe,
    SftFormat,
    check_ranges,
    checked_field,
    choices,
)
from qlm_core.disk import file_in_the_way
from qlm_core.errors import QlmError
from qlm_core.models.spec import ModelSpec
from qlm_core.parallel.pipeline_rules import min_microbatches, validate_schedule
from qlm_core.parallel.state import ParallelSizes
from qlm_core.train.objectives.grpo_loss import GrpoLoss
from qlm_core.train.objectives.preference_loss import PreferenceLossConfig


def validate_counts(**counts: int):
    """Batch sizes and sequence length at least 1; loss_chunk_tokens and mean_doc_len at least 0 (0: off). Keys are
    named as the caller's input names them (train.micro_batch_size, --mbs, ...)."""
    for name, value in counts.items():
        short = name.rsplit(".", 1)[-1].lstrip("-").replace("-", "_")
        if short in ("loss_chunk_tokens", "mean_doc_len"):
            if value < 0:
                meaning = ("a token count (e.g. 2048), or 0 for the loss over all logits at once"
                           if short == "loss_chunk_tokens" else
                           "the packed documents' token-weighted mean length E[L^2]/E[L], or 0 for one document "
                           "per sequence")
                raise QlmError(f"{name} must be >= 0, got {value}", f"set it to {meaning}")
        elif value < 1:
            raise QlmError(f"{name} must be >= 1, got {value}", "set it to a positive number")


def validate_recipe(recipe: Recipe):
    validate_counts(**{"train.micro_batch_size": recipe.train.micro_batch_size,
                       "train.global_batch_size": recipe.train.global_batch_size,
                       "data.seq_length": recipe.data.seq_length,
                       "train.loss_chunk_tokens": recipe.train.loss_chunk_tokens,
                       "data.mean_doc_len": recipe.data.mean_doc_len})
    validate_grad_reduce_dtype(recipe.parallel.grad_reduce_dtype, recipe.model.dtype)
    if recipe.schedule.min_lr > recipe.optim.lr:  # Megatron asserts the same: a decay that would raise the rate
        raise QlmError(f"schedule.min_lr {recipe.schedule.min_lr:g} is above optim.lr {recipe.optim.lr:g}: the decay "
                       "would raise the learning rate", "set schedule.min_lr at most optim.lr (often lr / 10)")
    p = recipe.parallel
    if recipe.checkpoint.format == "torch" and p.etp is not None and p.tp % p.etp:
        raise QlmError(f"parallel.etp = {p.etp} does not divide parallel.tp = {p.tp}: the legacy `torch` checkpoint's "
                       "rank folders cannot tell its expert parts apart",
                       'use an etp dividing tp, or checkpoint.format = "torch_dist"')
    if recipe.lora.rank > 0:
        if not recipe.model.load:
            raise QlmError("LoRA needs pretrained weights to adapt", "set model.load (an HF model or a checkpoint)")
        if recipe.checkpoint.format == "torch_dist":
            raise QlmError("checkpoint.format torch_dist does not hold LoRA adapters",
                           "use checkpoint.format = \"torch\" for LoRA runs")
    validate_data_format(recipe)
    if recipe.data.kind == "preference":
        validate_preference(recipe)
    if recipe.data.kind == "reward":
        validate_reward(recipe)
    if recipe.data.kind == "rl":
        validate_rl(recipe)


def validate_data_format(recipe: Recipe):
    kind, fmt = recipe.data.kind, recipe.data.format
    if kind in ("pretrain", "rl"):  # indexed documents; RL prompts are read by their `prompt` field
        return
    formats = choices(PreferenceFormat if kind in PAIR_KINDS else SftFormat)
    if fmt not in formats:
        raise QlmError(f"data.format {fmt!r} is not a {kind} format", f"use one of {', '.join(formats)}")


def _validate_pairs(recipe: Recipe, section: str, max_length: int | None):
    """The rules of data kinds made of pairs (`section`: the kind, and its recipe table holding max_length)."""
    data = recipe.data
    if data.packing:
        raise QlmError(f"data.packing with data.kind = \"{section}\": each pair is two padded sequences (chosen, "
                       "rejected) of one micro-batch, never packed", "set data.packing = false")
    if max_length is not None and max_length > data.seq_length:
        raise QlmError(f"{section}.max_length {max_length} is longer than data.seq_length {data.seq_length}",
                       f"lower {section}.max_length or raise data.seq_length")


def validate_preference(recipe: Recipe):
    """data.kind = "preference" with [preference]."""
    pref = recipe.preference
    _validate_pairs(recipe, "preference", pref.max_length)
    PreferenceLossConfig.from_recipe(pref).check()
    if pref.precompute_reference and pref.loss_type in REFERENCE_FREE_LOSSES:
        raise QlmError(f"preference.precompute_reference with the reference-free {pref.loss_type} loss",
                       "remove precompute_reference (simpo and orpo use no reference model)")


def validate_reward(recipe: Recipe):
    """data.kind = "reward" with [reward]."""
    _validate_pairs(recipe, "reward", recipe.reward.max_length)
    if recipe.lora.rank > 0:
        raise QlmError("LoRA with data.kind = \"reward\": the new score head would stay frozen",
                       "set lora.rank = 0 (a reward model trains all its weights)")


def validate_reward_model(spec: ModelSpec):
    """Reward models are dense for now: an MoE router's balancing has not been checked with a score head."""
    if spec.moe is not None:
        raise QlmError("a reward model (data.kind = \"reward\") takes dense models; this one has MoE layers",
                       "train a dense model as the reward model")


def validate_rl_prompts(global_batch_size: int, num_generations: int, dp: int, fix: str = ""):
    """Each data-parallel rank's leader samples whole prompts: the step's prompts divide among the dp ranks."""
    prompts = global_batch_size // num_generations
    if prompts % dp:
        raise QlmError(f"the step's {prompts} prompts (train.global_batch_size / rl.num_generations) do not divide "
                       f"among {dp} data-parallel ranks",
                       f"make train.global_batch_size a multiple of {num_generations * dp}{fix}")


def validate_rl(recipe: Recipe, dp: int | None = None):
    """data.kind = "rl" with [rl]: the loss's settings, the batch in whole groups over the data-parallel ranks
    (`dp`, once the world is known), and the rewards' weights."""
    rl, t = recipe.rl, recipe.train
    GrpoLoss.from_recipe(rl)
    if t.global_batch_size % rl.num_generations:
        raise QlmError(f"train.global_batch_size {t.global_batch_size} (completions per step) is not a multiple of "
                       f"rl.num_generations {rl.num_generations}", "make the batch whole groups of completions")
    if dp is not None:
        validate_rl_prompts(t.global_batch_size, rl.num_generations, dp)
    if rl.reward_weights and len(rl.reward_weights) != len(rl.reward_funcs):
        raise QlmError(f"rl.reward_weights has {len(rl.reward_weights)} entries for {len(rl.reward_funcs)} "
                       "rl.reward_funcs", "give one weight per reward function, or none (1 each)")
    if recipe.lora.rank > 0:
        raise QlmError("RL with LoRA: the rollout model is built from whole weights, and a LoRA run's are the base "
                       "and its adapters apart", "set lora.rank = 0 (RL trains every weight)")


def validate_rl_model(spec: ModelSpec, temperature: float):
    """The trainer scales the final norm's output by 1 / temperature (logits are linear in it), which a logit
    soft-cap (Gemma 2's) does not commute with: its rollouts would sample from other log-probs than it trains on."""
    if spec.logit_softcap is not None and temperature != 1.0:
        raise QlmError(f"rl.temperature = {temperature} on a model whose logits are soft-capped (Gemma 2's "
                       "final_logit_softcapping): the trainer's log-probs would not be the rollout's",
                       "set rl.temperature = 1.0")


def validate_preference_model(spec: ModelSpec):
    """Preference training takes dense models."""
    if spec.moe is not None:
        raise QlmError("preference training takes dense models (an MoE model's router losses and statistics would "
                       "count the reference forward too)", "train a dense model, or use data.kind = \"sft\"")


def validate_grad_reduce_dtype(grad_reduce_dtype: str, dtype: str):
    """Gradients are reduced in fp32 or in the training dtype (model.dtype) itself."""
    if grad_reduce_dtype not in ("fp32", dtype):
        raise QlmError(f'parallel.grad_reduce_dtype "{grad_reduce_dtype}" needs model.dtype "{grad_reduce_dtype}" '
                       f'(it is "{dtype}")',
                       'set parallel.grad_reduce_dtype = "fp32"' + (f' or "{dtype}"' if dtype != "fp32" else ""))


def validate_moe(spec: ModelSpec, moe: MoeConfig, config: ParallelConfig, lora_rank: int = 0):
    """The recipe's [moe] against the model and layout (a dense model ignores it)."""
    checked_field(MoeConfig, "aux_loss_type", moe.aux_loss_type, "moe.aux_loss_type")
    check_ranges("moe", moe)
    if spec.moe is not None and spec.moe.expert_bias and lora_rank and moe.router_bias_update_rate:
        raise QlmError("moe.router_bias_update_rate with LoRA: the routers' expert biases would change while a LoRA "
                       "checkpoint saves only the adapters", "set moe.router_bias_update_rate = 0 (the loaded "
                       "biases stay as they are) or train without LoRA")
    if spec.moe is not None and moe.aux_loss_type == "transformers" and config.pp > 1:
        raise QlmError("moe.aux_loss_type = 'transformers' needs parallel.pp = 1 (its one loss couples every layer's "
                       "router, and each pipeline stage holds only some)",
                       "use moe.aux_loss_type = 'megatron' (per layer) or set parallel.pp = 1")
    expert_parallel = config.ep > 1 or (config.etp is not None and config.etp != config.tp)
    if spec.moe is not None and moe.capacity_factor is not None and expert_parallel and config.tp > 1:
        raise QlmError("moe.capacity_factor with expert parallelism under tp > 1: each sequence-parallel rank would "
                       "drop tokens by its own share of the micro-batch, unlike one process",
                       "drop moe.capacity_factor (drop-less), or set parallel.tp = 1")
    if spec.moe is not None and moe.capacity_factor is not None and config.cp > 1:
        raise QlmError("moe.capacity_factor with parallel.cp > 1: each context-parallel rank would drop tokens by "
                       "its own share of the sequence, unlike one process", "drop moe.capacity_factor (drop-less) "
                       "or set parallel.cp = 1")


def validate_experts(spec: ModelSpec, config: ParallelConfig):
    """parallel.ep / parallel.etp against the model (each rule Megatron-Core has too)."""
    ep, etp, tp = config.ep, config.tp if config.etp is None else config.etp, config.tp
    if (ep, etp) == (1, tp):
        return
    if spec.moe is None:
        raise QlmError(f"parallel.ep = {ep} / etp = {etp} needs a Mixture-of-Experts model "
                       f"({spec.model_type} is dense)",
                       "remove parallel.ep and parallel.etp")
    if spec.moe.num_experts % ep:
        raise QlmError(f"parallel.ep = {ep} does not divide the model's {spec.moe.num_experts} experts",
                       "choose ep dividing num_experts")
    if spec.moe.ffn_hidden_size % etp:
        raise QlmError(f"parallel.etp = {etp} does not divide the experts' ffn size {spec.moe.ffn_hidden_size}",
                       "choose etp dividing moe_intermediate_size")
    if tp > 1 and not config.sp:
        raise QlmError(f"parallel.ep = {ep} / etp = {etp} with tp = {tp} needs sequence parallelism (each rank "
                       "dispatches its own tokens, so TP ranks must not hold the same ones)", "set parallel.sp = true")


def validate_layout(spec: ModelSpec, config: ParallelConfig, sizes: ParallelSizes, seq_length: int,
                    micro_batch_size: int, global_batch_size: int, rows_per_sample: int = 1):
    """Everything that can be checked before a process group exists (ModelLayout checks heads/layers). The batch
    sizes count rows; errors name them in the recipe's samples (a preference pair is two rows)."""
    for key in ("cp_comm_type", "pp_schedule", "recompute", "zero_stage", "grad_reduce_dtype"):  # built in code
        checked_field(ParallelConfig, key, getattr(config, key), f"parallel.{key}")
    check_ranges("parallel", config)
    cp, tp = config.cp, config.tp
    if (sizes.ep, sizes.etp) != (config.ep, tp if config.etp is None else config.etp):
        raise QlmError(f"the process grid has ep {sizes.ep} / etp {sizes.etp}, the recipe ep {config.ep} / etp "
                       f"{config.etp}", "build the grid with the recipe's parallel.ep and parallel.etp")
    validate_experts(spec, config)
    if config.vpp > 1 and config.pp == 1:
        raise QlmError("vpp > 1 needs pp > 1", "raise parallel.pp or set vpp = 1")
    if cp > 1 and seq_length % (2 * cp):
        raise QlmError(f"seq_length {seq_length} is not divisible by 2*cp = {2 * cp}",
                       "context parallelism cuts each sequence into 2*cp equal chunks")
    if config.sp and tp > 1 and (seq_length // cp) % tp:
        raise QlmError(f"seq_length/cp = {seq_length // cp} is not divisible by tp = {tp}",
                       "sequence parallelism shards each rank's tokens over the TP group")
    if cp > 1 and config.cp_comm_type == "a2a" and (spec.num_attention_heads // tp) % cp:
        raise QlmError(f"cp_comm_type a2a needs heads per TP rank ({spec.num_attention_heads // tp}) divisible by "
                       f"cp = {cp}", "use p2p or allgather, or change tp/cp")
    if config.recompute == "op" and config.pp > 1 and config.pp_schedule == "zero_bubble":
        raise QlmError('recompute "op" cannot run under pp_schedule zero_bubble (its weight pass would recompute '
                       "each layer a second time, which torch's selective checkpointing refuses)",
                       'use recompute = "selective" or "full", or another pp_schedule')
    if config.recompute != "selective" and list(config.recompute_modules) != ["core_attn"]:
        raise QlmError(f"parallel.recompute_modules {list(config.recompute_modules)} applies only with "
                       f'recompute = "selective" (it is "{config.recompute}")',
                       'set parallel.recompute = "selective", or remove recompute_modules')
    if config.overlap_param_gather and config.zero_stage not in (1, 2):
        raise QlmError("overlap_param_gather needs zero_stage 1 or 2", "set parallel.zero_stage or turn it off")
    rows = micro_batch_size * sizes.dp
    if global_batch_size % rows:
        raise QlmError(f"global_batch_size {global_batch_size} is not divisible by micro_batch_size*dp = {rows}",
                       "make the global batch a multiple of micro_batch_size * dp")
    if config.pp > 1:
        microbatches = global_batch_size // rows
        try:
            validate_schedule(config.pp_schedule, config.pp, config.vpp, microbatches)
        except ValueError as exc:
            least, multiple = min_microbatches(config.pp_schedule, config.pp)
            if microbatches >= least and microbatches % multiple == 0:  # not a micro-batch count rule
                raise QlmError(str(exc), "adjust parallel.pp_schedule or parallel.vpp") from None
            samples = rows // rows_per_sample
            target = (f"a multiple of {samples * multiple}" if multiple > 1
                      else f"at least {samples * least} (a multiple of micro_batch_size x dp = {samples})")
            gpipe_runs = config.pp_schedule != "gpipe" and config.vpp == 1  # gpipe takes no virtual stages
            raise QlmError(f"{exc} (train.global_batch_size {global_batch_size // rows_per_sample} / "
                           f"(train.micro_batch_size {micro_batch_size // rows_per_sample} x dp {sizes.dp}))",
                           f"make train.global_batch_size {target} (--gbs in qlm profile), or lower "
                           "train.micro_batch_size" + (', or use pp_schedule = "gpipe"' if gpipe_runs else "")
                           ) from None


def validate_compile_cache(environ=None):
    """torch inductor's cache folder (TORCHINDUCTOR_CACHE_DIR, when set) must be a folder or creatable: torch
    creates it while torch._dynamo is imported, where a file in the way is a traceback."""
    import os

    value = (environ if environ is not None else os.environ).get("TORCHINDUCTOR_CACHE_DIR", "")
    part = file_in_the_way(value) if value else None
    if part is not None:
        raise QlmError(f"TORCHINDUCTOR_CACHE_DIR {value}: {part} is a file, not a folder",
                       "point TORCHINDUCTOR_CACHE_DIR at a folder (or unset it), or set train.compile = false")
