"""The recipe's rules: each enumerated field is checked by its Literal type when the recipe is read (from TOML or
--set), and the rules across fields by train/validate.py."""

import typing

import pytest
from parallel_cases import SPEC

from qlm_core.config import (
    ParallelConfig,
    PpSchedule,
    Recipe,
    checked_field,
    choices,
    load_recipe,
    recipe_to_toml,
)
from qlm_core.errors import QlmError
from qlm_core.parallel.state import resolve_sizes
from qlm_core.train.validate import validate_layout, validate_recipe

# every enumerated recipe key, and a value it does not take
ENUM_KEYS = {
    "parallel.cp_comm_type": "ring",
    "parallel.pp_schedule": "dualpipe",
    "parallel.recompute": "some",
    "parallel.zero_stage": 4,
    "parallel.grad_reduce_dtype": "int8",
    "model.dtype": "fp16",
    "data.kind": "rlhf",
    "data.format": "csv",
    "data.truncation": "left",
    "schedule.lr_schedule": "linear",
    "checkpoint.format": "zarr",
    "moe.aux_loss_type": "switch",
    "preference.loss_type": "kto",
    "preference.truncation_mode": "keep_middle",
    "rl.loss_type": "ppo",
    "rl.importance_sampling_level": "batch",
    "rl.kl_estimator": "k4",
    "rl.scale_rewards": "median",
    "rl.rollout_correction": "clip",
}


def literal_keys() -> dict[str, tuple]:
    keys = {}
    for section, cls in typing.get_type_hints(Recipe).items():
        for name, kind in typing.get_type_hints(cls).items():
            if typing.get_origin(kind) is typing.Literal:
                keys[f"{section}.{name}"] = choices(kind)
    return keys


def toml_value(value) -> str:
    return f'"{value}"' if isinstance(value, str) else str(value)


def test_every_enumerated_key_is_typed_by_its_choices():
    assert set(literal_keys()) == set(ENUM_KEYS)


@pytest.mark.parametrize("key", sorted(ENUM_KEYS))
def test_a_bad_choice_in_toml_fails_when_read(key, tmp_path):
    section, name = key.split(".")
    path = tmp_path / "recipe.toml"
    path.write_text(f"[{section}]\n{name} = {toml_value(ENUM_KEYS[key])}\n")
    with pytest.raises(QlmError) as raised:
        load_recipe(path)
    line = str(raised.value)
    assert f"{key} {ENUM_KEYS[key]!r} is not one of {', '.join(map(str, literal_keys()[key]))}" in line
    assert "\n" not in line


@pytest.mark.parametrize("key", sorted(ENUM_KEYS))
def test_a_bad_choice_in_an_override_fails_when_read(key):
    with pytest.raises(QlmError, match=f"^{key} {ENUM_KEYS[key]!r} is not one of "):
        load_recipe(None, [f"{key}={ENUM_KEYS[key]}"])


@pytest.mark.parametrize("key", sorted(ENUM_KEYS))
def test_every_choice_is_accepted(key):
    section, name = key.split(".")
    for value in literal_keys()[key]:
        recipe = load_recipe(None, [f"{key}={value}"])
        assert getattr(getattr(recipe, section), name) == value


def test_the_nearest_choice_is_named():
    with pytest.raises(QlmError, match=r"parallel.pp_schedule '1F1B' is not one of .*; did you mean '1f1b'\?"):
        load_recipe(None, ["parallel.pp_schedule=1F1B"])
    with pytest.raises(QlmError, match=r"data.truncation 'dorp' is not one of right, drop; did you mean 'drop'\?"):
        load_recipe(None, ["data.truncation=dorp"])
    with pytest.raises(QlmError, match=r"parallel.zero_stage 5 is not one of 0, 1, 2, 3; did you mean 3\?"):
        load_recipe(None, ["parallel.zero_stage=5"])
    with pytest.raises(QlmError, match="set data.kind to one of them"):  # nothing close
        load_recipe(None, ["data.kind=xyz"])


def test_a_choice_must_have_the_choices_type():
    for value in ("true", '"1"', "1.0"):  # True == 1 == 1.0, yet none of them is a ZeRO stage
        with pytest.raises(QlmError, match="parallel.zero_stage .* is not one of 0, 1, 2, 3"):
            load_recipe(None, [f"parallel.zero_stage={value}"])


def test_a_resolved_recipe_reads_back(tmp_path):
    recipe = load_recipe(None, ["parallel.zero_stage=2", "data.truncation=drop", "parallel.pp_schedule=zero_bubble"])
    text = recipe_to_toml(recipe)
    assert "zero_stage = 2" in text and 'truncation = "drop"' in text
    (tmp_path / "resolved.toml").write_text(text)
    assert load_recipe(tmp_path / "resolved.toml") == recipe


def test_a_config_built_in_code_is_held_to_the_same_choices():
    """The Engine and qlm profile take a ParallelConfig built in Python, never read from a recipe."""
    from qlm_core.config import ParallelConfig

    for key, value in (("zero_stage", 4), ("recompute", "some"), ("cp_comm_type", "ring"), ("pp_schedule", "x")):
        with pytest.raises(QlmError, match=f"parallel.{key} .* is not one of"):
            validate_layout(SPEC, ParallelConfig(**{key: value}), resolve_sizes(1), 32, 1, 8)


def test_checked_field_names_where_the_value_came_from():
    assert checked_field(ParallelConfig, "cp_comm_type", "a2a", "--cp-comm-type") == "a2a"
    with pytest.raises(QlmError, match="^--cp-comm-type 'ring' is not one of p2p, allgather, a2a"):
        checked_field(ParallelConfig, "cp_comm_type", "ring", "--cp-comm-type")


def test_lower_layers_take_their_choices_from_the_schema():
    from qlm_core.config import CpCommType, DataFormat, PreferenceFormat, RecomputeMode, SftFormat
    from qlm_core.data.sft import FORMATS
    from qlm_core.models.gpt import RECOMPUTE_MODES
    from qlm_core.parallel.context_parallel import CP_COMM_TYPES
    from qlm_core.parallel.pipeline import SCHEDULES
    from qlm_core.profile.search import CP_COMM, RECOMPUTE

    assert RECOMPUTE_MODES == RECOMPUTE == choices(RecomputeMode)
    assert CP_COMM_TYPES == CP_COMM == choices(CpCommType)
    assert tuple(SCHEDULES) == choices(PpSchedule)
    assert ("auto", *FORMATS) == choices(SftFormat)
    assert set(choices(SftFormat)) | set(choices(PreferenceFormat)) == set(choices(DataFormat))


# ---- rules across fields (train/validate.py) ------------------------------------------------------------------------


def test_recipe_rules_across_fields():
    validate_recipe(Recipe())
    lora = load_recipe(None, ["lora.rank=4"])
    with pytest.raises(QlmError, match="^LoRA needs pretrained weights to adapt; set model.load"):
        validate_recipe(lora)
    lora.model.load = "base"
    lora.checkpoint.format = "torch_dist"
    with pytest.raises(QlmError, match="checkpoint.format torch_dist does not hold LoRA adapters"):
        validate_recipe(lora)
    with pytest.raises(QlmError, match="data.mean_doc_len must be >= 0, got -1"):
        validate_recipe(load_recipe(None, ["data.mean_doc_len=-1"]))


def test_layout_rules_across_fields():
    def check(**parallel):
        config = ParallelConfig(**parallel)
        sizes = resolve_sizes(config.tp * config.pp * config.cp, config.tp, config.pp, config.cp)
        validate_layout(SPEC, config, sizes, 32, 1, 8)

    check(pp=2, vpp=2, pp_schedule="interleaved_1f1b")
    with pytest.raises(QlmError, match=r"^vpp > 1 needs pp > 1; raise parallel.pp"):
        check(vpp=2)
    with pytest.raises(QlmError, match="interleaved_1f1b needs vpp >= 2; adjust parallel.pp_schedule"):
        check(pp=2, pp_schedule="interleaved_1f1b")
    with pytest.raises(QlmError, match="overlap_param_gather needs zero_stage 1 or 2"):
        check(zero_stage=3, overlap_param_gather=True)


@pytest.mark.parametrize("sets,message", [
    (["train.micro_batch_size=0"], "train.micro_batch_size must be >= 1, got 0"),
    (["data.seq_length=0"], "data.seq_length must be >= 1, got 0"),
    (["train.loss_chunk_tokens=-1"], "train.loss_chunk_tokens must be >= 0, got -1"),
])
def test_counts_out_of_range_are_named(sets, message):
    with pytest.raises(QlmError, match=message):
        validate_recipe(load_recipe(None, sets))


def test_a_zero_parallel_size_is_named_not_divided_by():
    with pytest.raises(QlmError, match="tp must be >= 1, got 0"):
        resolve_sizes(4, tp=0)


def test_a_section_that_is_not_a_table_is_named(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("parallel = 3\n")
    with pytest.raises(QlmError, match=r"\[parallel\] must be a table"):
        load_recipe(path, ["parallel.tp=2"])


def test_an_error_ending_in_a_question_gets_no_period():
    assert QlmError("bad key x", "did you mean 'y'?").line() == "bad key x; did you mean 'y'?"



def test_a_recipe_that_is_not_utf8_is_named(tmp_path):
    recipe = tmp_path / "r.toml"
    recipe.write_bytes(b"[train]\n# caf\xe9\ntrain_iters = 1\n")
    with pytest.raises(QlmError, match=r"r.toml is not UTF-8 text \(byte 0xe9 at offset 13\); save the recipe"):
        load_recipe(recipe)
    with pytest.raises(QlmError, match="is a directory"):
        load_recipe(tmp_path)


@pytest.mark.parametrize("sets, message", [
    (["optim.lr=0"], r"optim.lr must be > 0, got 0.0; set it > 0 \(the peak learning rate"),
    (["optim.lr=-1e-3"], "optim.lr must be > 0, got -0.001"),
    (["parallel.cp=-2"], "parallel.cp must be >= 1, got -2"),
    (["train.train_iters=-1"], "train.train_iters must be >= 0, got -1"),
    (["data.weights=[0.5, -1]"], "data.weights must be >= 0, got -1.0"),
    (["lora.dropout=1.0"], "lora.dropout must be >= 0 and < 1, got 1.0"),
    (["checkpoint.load_iteration=0"], "checkpoint.load_iteration must be >= 1, got 0"),
    (["parallel.num_layers_in_first_pipeline_stage=0"], "num_layers_in_first_pipeline_stage must be >= 1"),
])
def test_out_of_range_values_are_named_when_the_recipe_is_read(sets, message):
    with pytest.raises(QlmError, match=message):
        load_recipe(None, sets)


def test_a_parallel_config_built_in_code_meets_the_same_ranges():
    from qlm_core.config import ParallelConfig
    from qlm_core.models.presets import PRESETS
    from qlm_core.parallel.state import ParallelSizes
    from qlm_core.train.validate import validate_layout

    with pytest.raises(QlmError, match="parallel.bucket_size_mb must be > 0"):
        validate_layout(PRESETS["qlm-tiny"], ParallelConfig(bucket_size_mb=0), ParallelSizes(), 128, 1, 8)


def test_a_mistake_in_the_recipe_file_names_the_file(tmp_path):
    recipe = tmp_path / "my[1].toml"
    recipe.write_text("[trian]\ntrain_iters = 1\n")
    with pytest.raises(QlmError, match=r"^recipe .*my\[1\].toml: unknown section \[trian\]; did you mean 'train'"):
        load_recipe(recipe)
    recipe.write_text("[train]\ntrain_iters = 1\n")
    with pytest.raises(QlmError, match=r"^unknown key train.bogus"):
        load_recipe(recipe, ["train.bogus=1"])


def test_compile_defaults_on_for_long_runs_only():
    from qlm_core.config import COMPILE_AUTO_STEPS, TrainConfig, compiles

    assert not compiles(TrainConfig(), COMPILE_AUTO_STEPS - 1) and compiles(TrainConfig(), COMPILE_AUTO_STEPS)
    assert compiles(TrainConfig(compile=True), 10) and not compiles(TrainConfig(compile=False), 10**6)
    # an RL run stays eager unless asked: its rollouts decode with the eager forward
    assert not compiles(TrainConfig(), 10**6, rl=True) and compiles(TrainConfig(compile=True), 10, rl=True)
    assert load_recipe(None, ["train.compile=false"]).train.compile is False and Recipe().train.compile is None
    assert "compile" not in recipe_to_toml(Recipe())  # left out: the default, decided by the run's length


def test_compile_without_a_cpp_compiler_on_a_cpu(monkeypatch):
    """torch inductor builds CPU kernels with a C++ compiler: without one the default stays off (said in the run
    header), and an explicit train.compile = true is a one-line error."""
    from types import SimpleNamespace

    import torch

    from qlm_core.train import trainer

    monkeypatch.setattr(trainer, "cpp_compiler", lambda: None)
    run = SimpleNamespace(recipe=Recipe(), steps=1000, grid=SimpleNamespace(device=torch.device("cpu")))
    assert trainer.Trainer._compile_decision(run) is False and "no C++ compiler" in run.compile_text
    run.recipe.train.compile = True
    with pytest.raises(QlmError, match="train.compile = true on a CPU needs a C\\+\\+ compiler"):
        trainer.Trainer._compile_decision(run)
    monkeypatch.setattr(trainer, "cpp_compiler", lambda: "/usr/bin/g++")
    assert trainer.Trainer._compile_decision(run) is True and run.compile_text == "on (train.compile)"
