"""Preference (DPO) data and recipes, precomputed reference tables, a DPO resume whose model.load moved on,
asynchronous checkpoints, caches and run directories (areas `pref:`, `async:`, `cache:`).

The DPO cases train qlm's tiny random-init preference recipe (qlm-tiny, seq_length 32, 4 steps: seconds) on the
demo's pairs or on a file of their own tokenised by the demo's tokenizer (a fixture built once); the async cases
train the battery's tiny SFT fixture recipe. Faults are injected with a sitecustomize.py on the case's PYTHONPATH
(tests/workers/* or one written by the case), a full disk with a tmpfs (root needed, as cases_fulldisk.py).

Cases whose right outcome is either of two (a damaged cache rebuilt, exit 0 and the same numbers; or refused in one
line that names the cache) carry `interrupt=JUDGED` (signal 0 after 1 s sends nothing, as in cases_signals.py): the
judge then leaves the exit code to the case's check, which accepts exactly those two."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from battery.case import Case, says
from battery.fixtures import recipe_text

REPO = Path(__file__).resolve().parents[2]
WORKERS = REPO / "tests" / "workers"
LATEST = "checkpoints/latest_checkpointed_iteration.txt"
CHECKED = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")
JUDGED = (1, 0)  # see the module doc: no signal is sent, the check judges the exit
_LOCK = threading.RLock()
_BACKGROUND: dict[str, subprocess.Popen] = {}

PREF = """[model]
spec = "qlm-tiny"
dtype = "fp32"
{model}
[data]
kind = "preference"
train = {train}
seq_length = 32
packing = false
{data}
[preference]
loss_type = "sigmoid"
beta = 0.1

[train]
micro_batch_size = 2
global_batch_size = 4
train_iters = 4
eval_interval = 2
eval_iters = 1

[optim]
lr = 1e-3

[schedule]
lr_schedule = "constant"

[checkpoint]
save_interval = 2

[logging]
tensorboard = false
plot = false
"""


# ------------------------------------------------------------------------------------------------------- helpers


def _env(root: Path, inject: str | None = None, extra_path: Path | None = None) -> dict:
    """HF caches inside the case; `inject`: a sitecustomize.py the qlm process runs first; `extra_path`: a folder
    (tests/workers/...) put first on PYTHONPATH."""
    env = {"HF_DATASETS_CACHE": str(root / "hf-cache"), "WANDB_SILENT": "true", "OMP_NUM_THREADS": "1"}
    path = [str(REPO)]
    if extra_path is not None:
        path.insert(0, str(extra_path))
    if inject is not None:
        (root / "inject").mkdir(exist_ok=True)
        (root / "inject" / "sitecustomize.py").write_text(inject)
        path.insert(0, str(root / "inject"))
    env["PYTHONPATH"] = os.pathsep.join(path)
    return env


def _qlm(root: Path, *args, env: dict | None = None, expect: int | None = 0) -> subprocess.CompletedProcess:
    """qlm in a subprocess during a case's setup; `expect`: the exit code it must have (None: any)."""
    full = {**os.environ, "COLUMNS": "200", **_env(root), **(env or {})}
    proc = subprocess.run([sys.executable, "-m", "qlm_cli.main", *map(str, args)], cwd=root, env=full,
                          capture_output=True, text=True, timeout=400)
    if expect is not None and proc.returncode != expect:
        raise RuntimeError(f"setup: qlm {' '.join(map(str, args))[-200:]} exited {proc.returncode}, not {expect}: "
                           f"{proc.stderr.strip()[-600:]}")
    return proc


def _demo(fx) -> Path:
    """qlm's demo (tokenizer, preference.jsonl) built once for the cases' own preference files."""
    from qlm_core.data.demo import build_demo

    with _LOCK:
        return fx._built("pref_demo", lambda path: build_demo(path, seed=1234))


def _pref_recipe(root: Path, fx, train: Path | None = None, cache: Path | None = None,
                 name: str = "dpo.toml") -> Path:
    """The tiny DPO recipe: on the demo's pairs (train None) or on `train` with the demo's tokenizer."""
    model = "" if train is None else f"tokenizer = {json.dumps(str(_demo(fx) / 'tokenizer'))}"
    data = "" if cache is None else f"cache_dir = {json.dumps(str(cache))}"
    text = PREF.format(model=model, train=json.dumps(["@demo" if train is None else str(train)]), data=data)
    path = root / name
    path.write_text(text)
    return path


def _sets(*values: str) -> list[str]:
    return [arg for value in values for arg in ("--set", value)]


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _figures(run: Path, keys=CHECKED) -> list[list]:
    return [[row.get(key) for key in keys] for row in _rows(run / "metrics.jsonl")]


def _same_run(run: str, reference: str, keys=CHECKED, steps: int | None = None):
    """run's metrics.jsonl holds the reference's figures, bit for bit (and `steps` rows)."""
    def check(root, out):
        try:
            ours, theirs = _figures(root / run, keys), _figures(root / reference, keys)
        except (OSError, ValueError) as exc:
            return f"cannot compare the runs' metrics: {exc}"
        if steps is not None and len(ours) != steps:
            return f"{run} logged {len(ours)} steps, not {steps}"
        if ours != theirs:
            pairs = enumerate(zip(ours, theirs, strict=False))
            first = next((i for i, (a, b) in pairs if a != b), min(len(ours), len(theirs)))
            return (f"{run}'s figures differ from {reference}'s at row {first + 1}: "
                    f"{ours[first] if first < len(ours) else None} vs {theirs[first] if first < len(theirs) else None}")
        return None
    return check


def _all(*checks):
    def check(root, out):
        for c in checks:
            if (problem := c(root, out)) is not None:
                return problem
        return None
    return check


def _not_written(name: str):
    def check(root, out):
        run = root / name
        rows = run / "metrics.jsonl"
        return f"{name} trained: {rows} written" if rows.exists() and rows.stat().st_size else None
    return check


def _one_line_or_ok(words: tuple[str, ...], ok):
    """For JUDGED cases: exit 0 and `ok` holds, or a non-zero exit with exactly one `error:` line (problem; fix)
    that names every word of `words`."""
    def check(root, out):
        if out.code == 0:
            return ok(root, out)
        errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
        if len(errors) != 1 or "; " not in errors[0]:
            return f"exit {out.code} without one `error: problem; fix` line: {out.stderr.strip()[-300:]}"
        text = " ".join(errors[0].split())
        missing = [w for w in words if w not in text]
        return f"the error does not name {missing}: {errors[0][:300]}" if missing else None
    return check


# ------------------------------------------------------------------------------------------ preference data files

def _pairs(n: int = 8) -> list[dict]:
    letters = "defghdefgh"
    return [{"prompt": f"Sort: c a b {letters[i % 10]}", "chosen": f"a b c {letters[i % 10]}",
             "rejected": f"{letters[i % 10]} c b a"} for i in range(n)]


def _alpaca(n: int = 8) -> list[dict]:
    return [{"instruction": row["prompt"], "input": "", "chosen": row["chosen"], "rejected": row["rejected"]}
            for row in _pairs(n)]


def _messages(n: int = 8) -> list[dict]:
    return [{"prompt": [{"role": "user", "content": row["prompt"]}],
             "chosen": [{"role": "assistant", "content": row["chosen"]}],
             "rejected": [{"role": "assistant", "content": row["rejected"]}]} for row in _pairs(n)]


def _sharegpt(n: int = 8) -> list[dict]:
    return [{"conversations": [{"from": "human", "value": row["prompt"]}],
             "chosen": {"from": "gpt", "value": row["chosen"]}, "rejected": {"from": "gpt", "value": row["rejected"]}}
            for row in _pairs(n)]


def _jsonl(records) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in records).encode()


def _pref_file(content, name: str = "pairs.jsonl", *sets: str):
    """A run of the tiny DPO recipe on a data file holding `content` (records, or bytes, or a callable writing
    the file at the path it is given)."""
    def setup(root, fx):
        path = root / "data" / name
        path.parent.mkdir()
        if callable(content):
            content(path)
        elif isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_bytes(_jsonl(content))
        recipe = _pref_recipe(root, fx, train=path)
        return ["train", recipe, "--output", root / "run", *_sets(*sets)], _env(root)
    return setup


def _parquet(columns: dict):
    def write(path: Path):
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table(columns), path)
    return write


def _with(base: list[dict], at: int, **changes) -> list[dict]:
    """`base` with record number `at` (1-based) changed (a value None: the key removed)."""
    rows = [dict(r) for r in base]
    for key, value in changes.items():
        if value is None:
            rows[at - 1].pop(key, None)
        else:
            rows[at - 1][key] = value
    return rows


def _names(*words):
    """The error names the data file and these words; nothing was trained."""
    return _all(says("pairs", *words), _not_written("run"))


LONG_PROMPT = "Sort: " + " ".join("abcdefgh"[i % 8] for i in range(60))
TRUNCATED = says("preference records were truncated", stream="stdout")

PREF_DATA = [
    Case("pref data", "pref: a record without a chosen key (record 9)",
         _pref_file(_pairs(8) + [{"prompt": "Sort: b a", "rejected": "b a"}]), check=_names("record 9", "chosen")),
    Case("pref data", "pref: the first record without a rejected key",
         _pref_file([{"prompt": "Sort: b a", "chosen": "a b"}] + _pairs(8)), check=_names("rejected")),
    Case("pref data", "pref: an empty chosen response (record 3)",
         _pref_file(_with(_pairs(), 3, chosen="")), check=_names("record 3", "chosen", "empty")),
    Case("pref data", "pref: a blank (' ') chosen response (record 3)",
         _pref_file(_with(_pairs(), 3, chosen=" ")), check=_names("record 3", "chosen", "empty")),
    Case("pref data", "pref: a null chosen response (record 4)",
         _pref_file([*_pairs(3), {"prompt": "Sort: b a", "chosen": None, "rejected": "b a"}, *_pairs(4)]),
         check=_names("record 4", "chosen")),
    Case("pref data", "pref: a chosen response that is a number, at record 5 (named)",
         _pref_file(_with(_pairs(), 5, chosen=7)), check=_names("record 5", "chosen")),
    Case("pref data", "pref: every chosen response a number",
         _pref_file([{**r, "chosen": i} for i, r in enumerate(_pairs(), 1)]), check=_names("record 1", "chosen")),
    Case("pref data", "pref: a chosen response that is a list of ints (record 2)",
         _pref_file(_with(_pairs(), 2, chosen=[1, 2, 3])), check=_names("record 2", "chosen")),
    Case("pref data", "pref: chosen == rejected is refused naming the record (record 6)",
         _pref_file(_with(_pairs(), 6, chosen="a b c", rejected="a b c")), check=_names("record 6", "same")),
    Case("pref data", "pref: identical message-list responses (record 2)",
         _pref_file(_with(_messages(), 2, rejected=[{"role": "assistant", "content": "a b c d"}],
                          chosen=[{"role": "assistant", "content": "a b c d"}])), check=_names("record 2", "same")),
    Case("pref data", "pref: a chosen column mixing text (record 1) and a message list (record 7)",
         _pref_file(_with(_pairs(), 7, chosen=[{"role": "assistant", "content": "x"}])),
         check=_names("chosen", "record 7")),
    Case("pref data", "pref: a chosen string '\"c g h a\"' (with its quotes) beside a message list (record 4)",
         _pref_file(_with(_with(_pairs(), 1, chosen='"c g h a"'), 4, chosen=[{"role": "assistant", "content": "x"}])),
         check=_names("chosen", "record 4")),
    Case("pref data", "pref: chosen strings that are valid JSON ('\"c g h a\"', '[1, 2]', '12') train as text",
         _pref_file(_with(_with(_with(_pairs(), 1, chosen='"c g h a"'), 2, chosen="[1, 2]"), 3, chosen="12")),
         expect_ok=True),
    Case("pref data", "pref: alpaca records first, a TRL record later (record 9)",
         _pref_file(_alpaca() + [{"prompt": "Sort: b a", "chosen": "a b", "rejected": "b a"}]),
         check=_names("record 9", "trl")),
    Case("pref data", "pref: TRL records first, a sharegpt record later (record 9)",
         _pref_file(_pairs() + [{"conversations": [{"from": "human", "value": "Sort: b a"}], "chosen": "a b",
                                 "rejected": "b a"}]), check=_names("record 9", "sharegpt")),
    Case("pref data", "pref: an alpaca instruction and input both empty (record 2)",
         _pref_file(_with(_alpaca(), 2, instruction="", input="")), check=_names("record 2", "prompt")),
    Case("pref data", "pref: an alpaca record without instruction and input (record 3)",
         _pref_file(_with(_alpaca(), 3, instruction=None, input=None)), check=_names("record 3", "instruction")),
    Case("pref data", "pref: a sharegpt human turn '' (record 2)",
         _pref_file(_with(_sharegpt(), 2, conversations=[{"from": "human", "value": ""}])),
         check=_names("record 2", "empty")),
    Case("pref data", "pref: a TRL prompt ' ' (record 8)",
         _pref_file(_with(_pairs(), 8, prompt=" ")), check=_names("record 8", "prompt")),
    Case("pref data", "pref: a TRL message-list prompt whose user content is ' ' (record 5)",
         _pref_file(_with(_messages(), 5, prompt=[{"role": "user", "content": " "}])),
         check=_names("record 5", "empty")),
    Case("pref data", "pref: a chosen message list that starts with a user turn (record 3)",
         _pref_file(_with(_messages(), 3, chosen=[{"role": "user", "content": "x"}])),
         check=_names("record 3", "chosen")),
    Case("pref data", "pref: a prompt longer than the context is truncated and said (TRL truncation)",
         _pref_file(_with(_pairs(), 2, prompt=LONG_PROMPT)), expect_ok=True, check=TRUNCATED),
    Case("pref data", "pref: preference.max_length > data.seq_length",
         _pref_file(_pairs(), "pairs.jsonl", "preference.max_length=64"),
         check=_all(says("max_length", "64", "seq_length"), _not_written("run"))),
    Case("pref data", "pref: a preference file that is not UTF-8 (latin-1)",
         _pref_file('{"prompt": "caf\xe9", "chosen": "a", "rejected": "b"}\n'.encode("latin-1")),
         check=_names("not UTF-8", "0xe9")),
    Case("pref data", "pref: a jsonl with a line cut off (line 9)",
         _pref_file(_jsonl(_pairs()) + b'{"prompt": "Sort: b a", "chosen": "a'), check=_names("line 9")),
    Case("pref data", "pref: a parquet whose chosen column is int64",
         _pref_file(_parquet({"prompt": ["Sort: b a"] * 8, "chosen": list(range(8)), "rejected": ["b a"] * 8}),
                    "pairs.parquet"), check=_names("record 1", "chosen")),
    Case("pref data", "pref: a parquet whose chosen column is binary",
         _pref_file(_parquet({"prompt": ["Sort: b a"] * 8, "chosen": [b"a b"] * 8, "rejected": ["b a"] * 8}),
                    "pairs.parquet"), check=_names("record 1", "chosen")),
    Case("pref data", "pref: data.format forced to alpaca on a TRL file",
         _pref_file(_pairs(), "pairs.jsonl", 'data.format="alpaca"'), check=_names("alpaca")),
    Case("pref data", "pref: data.format forced to sharegpt on an alpaca file",
         _pref_file(_alpaca(), "pairs.jsonl", 'data.format="sharegpt"'), check=_names("sharegpt")),
]


# --------------------------------------------------------------------------------------------- recipe numbers

def _pref_set(*sets: str):
    def setup(root, fx):
        return ["train", _pref_recipe(root, fx), "--output", root / "run", *_sets(*sets)], _env(root)
    return setup


def _refused(*words):
    return _all(says(*words), lambda root, out: "run dir written" if (root / "run" / "metrics.jsonl").exists()
                else None)


PREF_RECIPE = [
    Case("pref recipe", "pref: preference.beta = nan", _pref_set("preference.beta=nan"), check=_refused("beta")),
    Case("pref recipe", "pref: preference.beta = inf", _pref_set("preference.beta=inf"), check=_refused("beta")),
    Case("pref recipe", "pref: preference.beta = 0", _pref_set("preference.beta=0"), check=_refused("beta")),
    Case("pref recipe", "pref: preference.beta = -1", _pref_set("preference.beta=-1"), check=_refused("beta")),
    Case("pref recipe", "pref: preference.label_smoothing = 0.5", _pref_set("preference.label_smoothing=0.5"),
         check=_refused("label_smoothing")),
    Case("pref recipe", "pref: preference.rpo_alpha = nan", _pref_set("preference.rpo_alpha=nan"),
         check=_refused("rpo_alpha")),
    Case("pref recipe", "pref: precompute_reference with simpo (no reference)",
         _pref_set('preference.loss_type="simpo"', "preference.precompute_reference=true"),
         check=_refused("precompute_reference", "simpo")),
    Case("pref recipe", "pref: preference.max_prompt_length = 0", _pref_set("preference.max_prompt_length=0"),
         check=_refused("max_prompt_length")),
    Case("pref recipe", "pref: an unknown preference.truncation_mode", _pref_set('preference.truncation_mode="middle"'),
         check=_refused("truncation_mode")),
]


# ---------------------------------------------------------------------------------- precomputed reference tables

PRE = "preference.precompute_reference=true"


def _table_of(root: Path) -> Path:
    tables = sorted((root / "cache" / "datasets").glob("reference-logps-*.safetensors"))
    if len(tables) != 1:
        raise RuntimeError(f"setup: expected one reference table, found {[t.name for t in tables]}")
    return tables[0]


def _damaged_table(damage, inject: str | None = None):
    """A first run writes the table into data.cache_dir; `damage(table)` then harms it; the case's run (another
    output, the same cache) must compute it again."""
    def setup(root, fx):
        recipe = _pref_recipe(root, fx, cache=root / "cache")
        _qlm(root, "train", recipe, "--output", root / "first", *_sets(PRE))
        damage(_table_of(root))
        return ["train", recipe, "--output", root / "run", *_sets(PRE)], _env(root, inject)
    return setup


def _cut(table: Path):
    data = table.read_bytes()
    table.write_bytes(data[:len(data) // 2])


def _flip(table: Path):
    data = bytearray(table.read_bytes())
    for k in range(1, 9):  # the last bytes: numbers of the table, not its header
        data[-k * 8] ^= 0x40
    table.write_bytes(bytes(data))


def _other_table(table: Path):
    """A well-formed table of the right names and shapes, all zeros, with no checksum (not what the run wrote)."""
    from safetensors import safe_open
    from safetensors.numpy import save_file

    with safe_open(str(table), framework="np") as handle:
        shapes = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118
    save_file({name: value * 0 - 1.0 for name, value in shapes.items()}, str(table))


def _text_file(table: Path):
    table.write_text("[model]\nspec = 'not a table'\n")


def _directory(table: Path):
    table.unlink()
    table.mkdir()
    (table / "inside.txt").write_text("x")


UNREADABLE = """
import errno, os, safetensors
_real = safetensors.safe_open
def _denied(filename, *args, **kwargs):  # root reads any file: a read-permission fault is injected
    if "reference-logps" in str(filename):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(filename))
    return _real(filename, *args, **kwargs)
safetensors.safe_open = _denied
"""


def _recomputed(root, out):
    """One warning naming the damaged table, the first run's numbers bit for bit, a whole table in place."""
    from safetensors import safe_open

    warnings = [line for line in out.stderr.splitlines() if "reference table" in line]
    if len(warnings) != 1 or not warnings[0].startswith("warning:"):
        return f"expected one warning line about the table, got: {out.stderr.strip()[-300:]}"
    table = _table_of(root)
    try:
        with safe_open(str(table), framework="np") as handle:
            list(handle.keys())
    except Exception as exc:  # noqa: BLE001
        return f"the table left in place does not read: {exc}"
    return _same_run("run", "first")(root, out)


# tests/workers/kill_in_table_write/sitecustomize.py, written by the case (so that it runs on trees without it too):
# the table is written half under its temporary name, then the process SIGKILLs itself
KILL_TABLE = """
import os, signal
import safetensors.numpy
_real = safetensors.numpy.save_file
def _dying(tensors, filename, *args, **kwargs):
    if "reference-logps" in str(filename):
        _real(tensors, filename, *args, **kwargs)
        with open(filename, "r+b") as fh:
            fh.truncate(os.path.getsize(filename) // 2)
        os.kill(os.getpid(), signal.SIGKILL)
    return _real(tensors, filename, *args, **kwargs)
safetensors.numpy.save_file = _dying
"""


def _killed_table(root, fx):
    """A run killed (SIGKILL) while it writes the table, its temporary aged as a writer dead for two minutes; the
    case re-runs it. `whole` is an uninterrupted run with a cache of its own."""
    recipe = _pref_recipe(root, fx, cache=root / "cache")
    _qlm(root, "train", recipe, "--output", root / "whole", *_sets(PRE, f"data.cache_dir='{root / 'cache2'}'"))
    _qlm(root, "train", recipe, "--output", root / "run", *_sets(PRE), env=_env(root, KILL_TABLE),
         expect=-signal.SIGKILL)
    if list((root / "cache" / "datasets").glob("reference-logps-*")):
        raise RuntimeError("setup: the killed run left a table under its own name")
    for temporary in (root / "cache" / "datasets").glob(".reference-logps-*"):
        os.utime(temporary, (time.time() - 120, time.time() - 120))
    return ["train", recipe, "--output", root / "run", *_sets(PRE)], _env(root)


def _table_path_is_dir_or_file(kind: str):
    """data.cache_dir/datasets (where the tables live) is a file."""
    def setup(root, fx):
        (root / "cache").mkdir()
        if kind == "datasets":
            (root / "cache" / "datasets").write_text("not a folder")
            cache = root / "cache"
        else:
            (root / "cachefile").write_text("not a folder")
            cache = root / "cachefile"
        recipe = _pref_recipe(root, fx, cache=cache)
        return ["train", recipe, "--output", root / "run", *_sets(PRE)], _env(root)
    return setup


PREF_TABLE = [
    Case("pref reference", "pref: a precomputed table cut short is recomputed (warning, same losses)",
         _damaged_table(_cut), expect_ok=True, check=_recomputed),
    Case("pref reference", "pref: a precomputed table with bytes flipped is recomputed",
         _damaged_table(_flip), expect_ok=True, check=_recomputed),
    Case("pref reference", "pref: a precomputed table replaced by a well-formed table of zeros is recomputed",
         _damaged_table(_other_table), expect_ok=True, check=_recomputed),
    Case("pref reference", "pref: a precomputed table replaced by a text file is recomputed",
         _damaged_table(_text_file), expect_ok=True, check=_recomputed),
    Case("pref reference", "pref: a precomputed table that is a directory",
         _damaged_table(_directory), interrupt=JUDGED,
         check=_one_line_or_ok(("reference-logps",), _same_run("run", "first"))),
    Case("pref reference", "pref: an unreadable precomputed table (EACCES) is recomputed",
         _damaged_table(lambda table: None, UNREADABLE), interrupt=JUDGED,
         check=_one_line_or_ok(("reference-logps", "Permission denied"), _recomputed)),
    Case("pref reference", "pref: kill -9 while the table is written, then a re-run: the uninterrupted losses",
         _killed_table, expect_ok=True, check=_same_run("run", "whole", steps=4), timeout=400),
    Case("pref reference", "pref: data.cache_dir/datasets is a file (precompute_reference)",
         _table_path_is_dir_or_file("datasets"), check=_refused("cache/datasets")),
    Case("pref reference", "pref: data.cache_dir is a file (precompute_reference)",
         _table_path_is_dir_or_file("cache"), check=_refused("cachefile")),
]


# ------------------------------------------------------------ DPO resume from a model.load whose latest moved on

def _pin_fixture(fx) -> Path:
    """src: a DPO run with checkpoints 4 and 8 (latest set back to 4); straight: an uninterrupted 4-step DPO run
    from src (iteration 4); stopped: the same run stopped after 2 steps (exit_interval) with src still at 4."""
    def build(path: Path):
        path.mkdir()
        recipe = _pref_recipe(path, fx)
        _qlm(path, "train", recipe, "--output", path / "src",
             *_sets("train.train_iters=8", "checkpoint.save_interval=4", "checkpoint.keep_last=0"))
        (path / "src" / LATEST).write_text("4")
        load = f"model.load={json.dumps(str(path / 'src'))}"
        _qlm(path, "train", recipe, "--output", path / "straight", *_sets(load))
        _qlm(path, "train", recipe, "--output", path / "stopped", *_sets(load, "train.exit_interval=2"))

    with _LOCK:
        return fx._built("pref_pin", build)


def _pinned_resume(damage=None, latest: str = "8"):
    """A private copy of the pin fixture; src's latest moves to `latest`; the stopped run's pin points at the copy
    (damaged by `damage(run)` when given); the case resumes the stopped run."""
    def setup(root, fx):
        pin = root / "pin"
        shutil.copytree(_pin_fixture(fx), pin, symlinks=True)
        src = pin / "src"
        (src / LATEST).write_text(latest)
        record = pin / "stopped" / "model_load.json"
        if record.exists():
            data = json.loads(record.read_text())
            data["load"] = str(src)
            record.write_text(json.dumps(data) + "\n")
        if damage is not None:
            damage(pin)
        recipe = _pref_recipe(root, fx)
        return (["train", recipe, "--output", pin / "stopped", *_sets(f"model.load={json.dumps(str(src))}")],
                _env(root))
    return setup


def _pin_text(data: bytes):
    def damage(pin: Path):
        (pin / "stopped" / "model_load.json").write_bytes(data)
    return damage


def _pin_deleted(pin: Path):
    shutil.rmtree(pin / "src" / "checkpoints" / "iter_0000004")


def _pin_dir(pin: Path):
    record = pin / "stopped" / "model_load.json"
    record.unlink(missing_ok=True)
    record.mkdir()


def _stopped_unchanged(root, out):
    rows = _rows(root / "pin" / "stopped" / "metrics.jsonl")
    return None if [r["step"] for r in rows] == [1, 2] else f"the stopped run now logs {[r['step'] for r in rows]}"


PIN_DAMAGED = _all(says("model_load.json"), _stopped_unchanged)

PREF_PIN = [
    Case("pref resume", "pref: DPO resume after model.load's latest moved 4 -> 8 uses iteration 4",
         _pinned_resume(), expect_ok=True,
         check=lambda root, out: _same_run("pin/stopped", "pin/straight", steps=4)(root, out), timeout=400),
    Case("pref resume", "pref: RUN/model_load.json not UTF-8", _pinned_resume(_pin_text(b'{"load": "\xff\xfe"}')),
         check=PIN_DAMAGED, timeout=400),
    Case("pref resume", "pref: RUN/model_load.json not JSON", _pinned_resume(_pin_text(b"iteration 4, I think")),
         check=PIN_DAMAGED, timeout=400),
    Case("pref resume", "pref: RUN/model_load.json with wrong types",
         _pinned_resume(_pin_text(b'{"load": 3, "iteration": "4"}\n')), check=PIN_DAMAGED, timeout=400),
    Case("pref resume", "pref: RUN/model_load.json with iteration true",
         lambda root, fx: _pinned_resume(_pin_text(json.dumps({"load": str(root / "pin" / "src"),
                                                               "iteration": True}).encode()))(root, fx),
         check=PIN_DAMAGED, timeout=400),
    Case("pref resume", "pref: RUN/model_load.json with a negative iteration",
         lambda root, fx: _pinned_resume(_pin_text(json.dumps({"load": str(root / "pin" / "src"),
                                                               "iteration": -4}).encode()))(root, fx),
         check=PIN_DAMAGED, timeout=400),
    Case("pref resume", "pref: RUN/model_load.json is a directory", _pinned_resume(_pin_dir),
         check=PIN_DAMAGED, timeout=400),
    Case("pref resume", "pref: the pinned iteration of model.load was deleted", _pinned_resume(_pin_deleted),
         check=_all(says("iteration 4"), _stopped_unchanged), timeout=400),
]


# ------------------------------------------------------------------------------------------ async checkpoints

KILL_WRITE = WORKERS / "kill_in_background_write"
ASYNC = "checkpoint.async_save=true"

SIGTERM_IN_WRITE = """
import os, signal, threading, time
from qlm_core.train.checkpointing import CheckpointWrite
_real, _calls = CheckpointWrite.write_files, [0]
def _write(write, *args, **kwargs):
    _calls[0] += 1
    on_background = threading.current_thread() is not threading.main_thread()
    if _calls[0] == int(os.environ["QLM_BATTERY_TERM_AT"]) and on_background:
        os.kill(os.getpid(), signal.SIGTERM)  # the stop arrives while this write is under way
        time.sleep(1.0)
    return _real(write, *args, **kwargs)
CheckpointWrite.write_files = _write
"""


def _sft(root: Path, fx, out: Path, *sets: str) -> list:
    return ["train", fx.recipe(), "--output", out, *_sets(f"data.cache_dir='{root / 'cache'}'", *sets)]


def _async_killed(fmt: str, at: int):
    """`whole`: an uninterrupted 6-step async run; `run`: the same run SIGKILLed in the middle of its `at`-th
    background checkpoint write; the case resumes it."""
    def setup(root, fx):
        sets = ("train.train_iters=6", ASYNC, f'checkpoint.format="{fmt}"')
        _qlm(root, *_sft(root, fx, root / "whole", *sets))
        env = {**_env(root, extra_path=KILL_WRITE), "QLM_TEST_KILL_AT_SAVE": str(at), "QLM_TEST_KILL_RANK": "0",
               "QLM_TEST_MARKER": str(root / "marker")}
        _qlm(root, *_sft(root, fx, root / "run", *sets), env=env, expect=-signal.SIGKILL)
        if (root / "marker").exists():
            raise RuntimeError("setup: the checkpoint was written on the training thread")
        return _sft(root, fx, root / "run", *sets), _env(root)
    return setup


def _async_sigterm(root, fx):
    """`run` gets SIGTERM while its 2nd background write (iteration 4) is under way; the case resumes it."""
    sets = ("train.train_iters=6", ASYNC)
    _qlm(root, *_sft(root, fx, root / "whole", *sets))
    env = {**_env(root, SIGTERM_IN_WRITE), "QLM_BATTERY_TERM_AT": "2"}
    _qlm(root, *_sft(root, fx, root / "run", *sets), env=env, expect=128 + signal.SIGTERM)
    return _sft(root, fx, root / "run", *sets), _env(root)


def _async_sigterm_itself(root, fx):
    sets = ("train.train_iters=6", ASYNC)
    return _sft(root, fx, root / "run", *sets), {**_env(root, SIGTERM_IN_WRITE), "QLM_BATTERY_TERM_AT": "1"}


def _sigterm_stop_check(root, out):
    """The run stopped with 143; its latest checkpoint is whole and is the newest one saved; no traceback."""
    if out.code != 128 + signal.SIGTERM:
        return f"exit {out.code}, not 143: {out.stderr.strip()[-300:]}"
    latest = (root / "run" / LATEST)
    if not latest.is_file():
        return "no latest pointer after the stop"
    iteration = int(latest.read_text().strip())
    saved = sorted(p.name for p in (root / "run" / "checkpoints").glob("iter_*"))
    if f"iter_{iteration:07d}" != saved[-1]:
        return f"latest names {iteration}, saved: {saved}"
    steps = [r["step"] for r in _rows(root / "run" / "metrics.jsonl")]
    return None if steps and steps[-1] == iteration else f"metrics end at {steps[-1:]} but latest is {iteration}"


def _resumed_exactly(root, out):
    problem = _same_run("run", "whole", keys=("loss", "grad_norm", "lr"), steps=6)(root, out)
    if problem:
        return problem
    latest = (root / "run" / LATEST).read_text().strip()
    return None if latest == "6" else f"latest is {latest!r} after the resume, not 6"


def _mount(root: Path, size: str) -> Path:
    disk = root / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(disk)], check=True,
                   capture_output=True)
    return disk


def _unmount(root: Path):
    subprocess.run(["umount", str(root / "disk")], check=False, capture_output=True)


def _fill(disk: Path, leave: int):
    """Fill the tmpfs up to `leave` bytes free."""
    stat = os.statvfs(disk)
    free = stat.f_bavail * stat.f_frsize
    with open(disk / "filler", "wb") as fh:
        fh.write(b"\0" * max(0, free - leave))


def _digest(folder: Path) -> dict:
    import hashlib

    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _async_full_disk(fmt: str):
    """A 4-step async run on a tmpfs, the disk then filled to 256 KiB free; the case continues it to 6 steps:
    the save at 6 does not fit."""
    def setup(root, fx):
        disk = _mount(root, "64m")
        sets = (ASYNC, f'checkpoint.format="{fmt}"')
        _qlm(root, *_sft(root, fx, disk / "run", *sets))
        (root / "before.json").write_text(json.dumps(_digest(disk / "run" / "checkpoints" / "iter_0000004")))
        _fill(disk, 256 << 10)
        return _sft(root, fx, disk / "run", *sets, "train.train_iters=6"), _env(root)
    return setup


def _old_checkpoint_intact(root, out):
    run = root / "disk" / "run"
    if not (run / "checkpoints" / "iter_0000004").is_dir():
        return "iteration 4 is gone"
    if _digest(run / "checkpoints" / "iter_0000004") != json.loads((root / "before.json").read_text()):
        return "iteration 4's files changed"
    latest = (run / LATEST).read_text().strip()
    if latest != "4":
        return f"latest is {latest!r}, not 4"
    if "No space left on device" not in out.stderr:
        return f"the cause is not named: {out.stderr.strip()[-300:]}"
    return None


ASYNC_CASES = [
    Case("async checkpoint", "async: kill -9 in the background write of iteration 4, resume: exact losses",
         _async_killed("torch", 2), expect_ok=True, check=_resumed_exactly, timeout=400),
    Case("async checkpoint", "async: kill -9 in the first background write (nothing saved), re-run: exact losses",
         _async_killed("torch", 1), expect_ok=True, check=_resumed_exactly, timeout=400),
    Case("async checkpoint", "async: torch_dist, kill -9 in the background write of iteration 4, resume: exact",
         _async_killed("torch_dist", 2), expect_ok=True, check=_resumed_exactly, timeout=400),
    Case("async checkpoint", "async: SIGTERM during the background write, resume: exact losses",
         _async_sigterm, expect_ok=True, check=_resumed_exactly, timeout=400),
    Case("async checkpoint", "async: SIGTERM during the first background write stops with 143 and a whole checkpoint",
         _async_sigterm_itself, interrupt=JUDGED, check=_sigterm_stop_check),
    Case("async checkpoint", "async: exit_interval=2 then a resume gives the uninterrupted losses",
         lambda root, fx: (_qlm(root, *_sft(root, fx, root / "whole", "train.train_iters=6", ASYNC)),
                           _qlm(root, *_sft(root, fx, root / "run", "train.train_iters=6", ASYNC,
                                            "train.exit_interval=2")),
                           (_sft(root, fx, root / "run", "train.train_iters=6", ASYNC), _env(root)))[-1],
         expect_ok=True, check=_resumed_exactly, timeout=400),
    Case("async checkpoint", "async: a one-process torch_dist + async run prints no torch warning",
         lambda root, fx: (_sft(root, fx, root / "run", ASYNC, 'checkpoint.format="torch_dist"'), _env(root)),
         expect_ok=True, check=lambda root, out: (f"stderr is not quiet: {out.stderr.strip()[-300:]}"
                                                  if "Warning" in out.stderr else None)),
    Case("async checkpoint", "async: full disk (tmpfs) during an async save keeps the old checkpoint",
         _async_full_disk("torch"), check=_old_checkpoint_intact, cleanup=_unmount, timeout=400),
    Case("async checkpoint", "async: torch_dist + async on a full disk keeps the old checkpoint",
         _async_full_disk("torch_dist"), check=_old_checkpoint_intact, cleanup=_unmount, timeout=400),
]


# ------------------------------------------------------------------------------------------------------ caches

def _datasets_damaged(damage):
    """A first DPO run on a file of its own fills data.cache_dir (root/store: datasets' Arrow caches);
    `damage(path)` harms each Arrow file; a second run into another output with the same cache."""
    def setup(root, fx):
        data = root / "data" / "pairs.jsonl"
        data.parent.mkdir()
        data.write_bytes(_jsonl(_pairs(16)))
        recipe = _pref_recipe(root, fx, train=data, cache=root / "store")
        _qlm(root, "train", recipe, "--output", root / "first")
        files = sorted((root / "store" / "datasets").rglob("*.arrow"))
        if not files:
            raise RuntimeError("setup: no Arrow cache files")
        for path in files:
            damage(path)
        return ["train", recipe, "--output", root / "run"], _env(root)
    return setup


def _arrow_cut(path: Path):
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])


def _arrow_flip(path: Path):
    data = bytearray(path.read_bytes())
    for k in range(64, len(data), max(1, len(data) // 16)):
        data[k] ^= 0xFF
    path.write_bytes(bytes(data))


def _arrow_dir(path: Path):
    path.unlink()
    path.mkdir()


def _cache_ok_or_named(*words):
    return _one_line_or_ok(words, _same_run("run", "first"))


def _demo_damaged(damage):
    def setup(root, fx):
        recipe = _pref_recipe(root, fx, cache=root / "cache")
        _qlm(root, "train", recipe, "--output", root / "first")
        damage(root / "cache" / "demo")
        return ["train", recipe, "--output", root / "run"], _env(root)
    return setup


def _demo_cut_line(demo: Path):
    data = (demo / "preference.jsonl").read_bytes()
    (demo / "preference.jsonl").write_bytes(data[:len(data) // 2 + 7])


def _demo_half_lines(demo: Path):
    lines = (demo / "preference.jsonl").read_bytes().splitlines(keepends=True)
    (demo / "preference.jsonl").write_bytes(b"".join(lines[:len(lines) // 2]))


def _demo_garbage_tokenizer(demo: Path):
    (demo / "tokenizer" / "tokenizer.json").write_bytes(b"\x00garbage{")


# pretraining data (indexed datasets) and its samples cache

def _indexed(prefix: Path, documents: int = 60):
    from qlm_core.data.indexed import IndexedWriter

    with IndexedWriter(prefix, "uint16") as writer:
        for i in range(documents):
            writer.add_document([1 + (i + k) % 50 for k in range(40 + i % 7)])


def _pretrain_recipe(root: Path, fx, prefix: Path, cache: Path | None) -> Path:
    text = recipe_text(fx.hf(), prefix).replace('kind = "sft"', 'kind = "pretrain"').replace(
        'chat_template = "chatml"\n', "" if cache is None else f"cache_dir = {json.dumps(str(cache))}\n")
    path = root / "pretrain.toml"
    path.write_text(text)
    return path


IDX_HEADER = 9 + 8 + 1 + 8 + 8


def _lying_idx(lie: str):
    """A well-sized .idx whose numbers lie (the .bin's length still matches its last sequence)."""
    def setup(root, fx):
        import numpy as np

        _indexed(root / "a")
        idx = bytearray((root / "a.idx").read_bytes())
        count = int.from_bytes(idx[18:26], "little")
        lengths = IDX_HEADER
        pointers = lengths + 4 * count
        documents = pointers + 8 * count
        # every sequence / document boundary but the first and the last (which the reader checks)
        inner = range(1, count if lie == "documents" else count - 1)
        for k in inner:
            if lie == "pointer":  # sequences that start past the end of the .bin
                idx[pointers + 8 * k:pointers + 8 * (k + 1)] = np.int64(10 ** 9 + k).tobytes()
            elif lie == "length":  # sequences of -7 tokens
                idx[lengths + 4 * k:lengths + 4 * (k + 1)] = np.int32(-7).tobytes()
            elif lie == "documents":  # document boundaries that go backwards
                idx[documents + 8 * k:documents + 8 * (k + 1)] = np.int64(count - k).tobytes()
        (root / "a.idx").write_bytes(bytes(idx))
        return ["train", _pretrain_recipe(root, fx, root / "a", None), "--output", root / "run"], _env(root)
    return setup


def _samples_damaged(damage):
    """A first pretraining run writes its samples cache (.qlm-samples.npz) into data.cache_dir/index; `damage`
    harms it; a second run into another output."""
    def setup(root, fx):
        _indexed(root / "a")
        recipe = _pretrain_recipe(root, fx, root / "a", root / "cache")
        _qlm(root, "train", recipe, "--output", root / "first")
        caches = sorted((root / "cache" / "index").glob("*.qlm-samples.npz"))
        if not caches:
            raise RuntimeError("setup: no samples cache")
        for path in caches:
            damage(path)
        return ["train", recipe, "--output", root / "run"], _env(root)
    return setup


def _npz_lies(path: Path):
    """Arrays of the right shapes whose sample boundaries point far past the dataset."""
    import numpy as np

    with np.load(path) as cached:
        order, index, shuffle = cached["sequence_order"], cached["sample_index"], cached["shuffle"]
    index = index.copy()
    index[:, 0] += 10 ** 6
    np.savez(path.with_suffix(""), sequence_order=order, sample_index=index, shuffle=shuffle)


SAME_PRETRAIN = _same_run("run", "first", keys=("loss", "grad_norm"))


# torch.compile's cache, wandb's run id

def _inductor_cache(kind: str):
    def setup(root, fx):
        target = root / "inductor"
        if kind == "file":
            target.write_text("not a folder")
        else:
            for sub in ("fxgraph/ab", "triton/0", "aotautograd/cd", "cpp/ef"):
                (target / sub).mkdir(parents=True)
                (target / sub / "entry").write_bytes(os.urandom(512))
                (target / sub / "ab0123456789").write_bytes(b"\x80\x04garbage pickle")
        env = {**_env(root), "TORCHINDUCTOR_CACHE_DIR": str(target)}
        return _sft(root, fx, root / "run", "train.compile=true"), env
    return setup


def _run_copy(root: Path, fx) -> Path:
    with _LOCK:
        fx.run()
    return fx.copy("run", root)


def _wandb_id(content):
    def setup(root, fx):
        run = _run_copy(root, fx)
        target = run / "wandb_run_id"
        if content is None:
            target.mkdir()
        else:
            target.write_bytes(content)
        env = {**_env(root), "WANDB_MODE": "offline", "WANDB_DIR": str(root / "wandb-home")}
        return ["train", fx.recipe(), "--output", run, *_sets('logging.wandb_project="qlm-battery"',
                                                              "train.train_iters=6")], env
    return setup


def _old_run_untouched(root, out):
    steps = [r["step"] for r in _rows(root / "run" / "metrics.jsonl")]
    latest = (root / "run" / LATEST).read_text().strip()
    if steps != [1, 2, 3, 4] or latest != "4":
        return f"the run went on: steps {steps}, latest {latest}"
    return None


def _run_cache_is_file(root, fx):
    run = _run_copy(root, fx)
    shutil.rmtree(run / "cache", ignore_errors=True)
    (run / "cache").write_text("not a folder")
    return ["train", fx.recipe(), "--output", run, *_sets("train.train_iters=6")], _env(root)


CACHE_CASES = [
    Case("cache data", "cache: datasets Arrow cache files cut short", _datasets_damaged(_arrow_cut),
         interrupt=JUDGED, check=_cache_ok_or_named("store/datasets")),
    Case("cache data", "cache: datasets Arrow cache files with bytes flipped", _datasets_damaged(_arrow_flip),
         interrupt=JUDGED, check=_cache_ok_or_named("store/datasets")),
    Case("cache data", "cache: datasets Arrow cache files replaced by directories", _datasets_damaged(_arrow_dir),
         interrupt=JUDGED, check=_cache_ok_or_named("store/datasets")),
    Case("cache data", "cache: the demo's preference.jsonl cut mid-line in data.cache_dir",
         _demo_damaged(_demo_cut_line), interrupt=JUDGED, check=_cache_ok_or_named("cache/demo")),
    Case("cache data", "cache: the demo's preference.jsonl cut to half its lines in data.cache_dir",
         _demo_damaged(_demo_half_lines), interrupt=JUDGED, check=_cache_ok_or_named("cache/demo")),
    Case("cache data", "cache: the demo's tokenizer.json garbage in data.cache_dir",
         _demo_damaged(_demo_garbage_tokenizer), interrupt=JUDGED, check=_cache_ok_or_named("tokenizer")),
    Case("cache data", "cache: RUN/cache is a file when a run is resumed", _run_cache_is_file,
         check=_all(says("run/cache"), _old_run_untouched)),
    Case("cache index", "cache: an .idx whose sequence pointer lies past the .bin", _lying_idx("pointer"),
         check=_all(says("a.idx"), _not_written("run"))),
    Case("cache index", "cache: an .idx with a negative sequence length", _lying_idx("length"),
         check=_all(says("a.idx"), _not_written("run"))),
    Case("cache index", "cache: an .idx whose document indices go backwards", _lying_idx("documents"),
         check=_all(says("a.idx"), _not_written("run"))),
    Case("cache index", "cache: a samples cache (.qlm-samples.npz) cut short is rebuilt",
         _samples_damaged(_arrow_cut), expect_ok=True, check=SAME_PRETRAIN),
    Case("cache index", "cache: a samples cache replaced by a directory is rebuilt",
         _samples_damaged(_arrow_dir), expect_ok=True, check=SAME_PRETRAIN),
    Case("cache index", "cache: a samples cache whose sample boundaries point past the dataset",
         _samples_damaged(_npz_lies), interrupt=JUDGED,
         check=_one_line_or_ok(("qlm-samples",), SAME_PRETRAIN)),
    Case("cache compile", "cache: TORCHINDUCTOR_CACHE_DIR is a file (train.compile=true)", _inductor_cache("file"),
         check=says("TORCHINDUCTOR_CACHE_DIR"), timeout=300),
    Case("cache compile", "cache: TORCHINDUCTOR_CACHE_DIR holding garbage (train.compile=true)",
         _inductor_cache("garbage"), expect_ok=True, timeout=300),
    Case("cache wandb", "cache: RUN/wandb_run_id holding non-UTF-8 bytes", _wandb_id(b"\xff\xfe\x00id"),
         check=_all(says("wandb_run_id", "not UTF-8"), _old_run_untouched)),
    Case("cache wandb", "cache: RUN/wandb_run_id holding 'not/an id'", _wandb_id(b"not/an id\n"),
         check=_all(says("wandb_run_id", "not/an id"), _old_run_untouched)),
    Case("cache wandb", "cache: RUN/wandb_run_id is a directory", _wandb_id(None),
         check=_all(says("wandb_run_id"), _old_run_untouched)),
]


# ----------------------------------------------------------------------------------- two runs at once

WAIT_FOR_GO = """
import os, time
import qlm_core.train.metrics as metrics
real = metrics.MetricsWriter.log_step
def waiting(self, m):
    deadline = time.time() + 300
    while not os.path.exists(os.environ["QLM_BATTERY_GO"]) and time.time() < deadline:
        time.sleep(0.05)
    real(self, m)
metrics.MetricsWriter.log_step = waiting
"""


def _background(root: Path, argv: list, env: dict) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "qlm_cli.main", *map(str, argv)], cwd=root,
                            env={**os.environ, "COLUMNS": "200", **env}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, start_new_session=True)
    _BACKGROUND[str(root)] = proc
    return proc


def _two_into_one(root, fx):
    """A DPO run holds RUN (waiting before its first logged step) when a second one starts into it."""
    recipe = _pref_recipe(root, fx)
    out = root / "run"
    first = _background(root, ["train", recipe, "--output", out],
                        {**_env(root, WAIT_FOR_GO), "QLM_BATTERY_GO": str(root / "go")})
    deadline = time.time() + 240
    while not (out / ".qlm.lock").exists() and first.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    if not (out / ".qlm.lock").exists():
        first.kill()
        raise RuntimeError("setup: the first run never took its lock")
    return ["train", recipe, "--output", out], _env(root)


def _wait_first(root: Path) -> str | None:
    first = _BACKGROUND.pop(str(root))
    (root / "go").touch()
    try:
        first.wait(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(first.pid, signal.SIGKILL)
        return "the first run did not finish"
    if first.returncode:
        return f"the first run failed ({first.returncode}): {first.stderr.read().decode()[-300:]}"
    return None


def _two_into_one_check(root, out):
    problem = _wait_first(root)
    if problem:
        return problem
    steps = [r["step"] for r in _rows(root / "run" / "metrics.jsonl")]
    if steps != [1, 2, 3, 4]:
        return f"metrics.jsonl of the first run: steps {steps}"
    if (root / "run" / LATEST).read_text().strip() != "4":
        return "the first run's latest checkpoint is not 4"
    return says("in use by another qlm train")(root, out)


def _shared_table(root, fx):
    """Two DPO runs with precompute_reference start at once into two outputs sharing one data.cache_dir (both
    build the demo, the Arrow caches and the reference table)."""
    recipe = _pref_recipe(root, fx, cache=root / "cache")
    _background(root, ["train", recipe, "--output", root / "a", *_sets(PRE)], _env(root))
    return ["train", recipe, "--output", root / "b", *_sets(PRE)], _env(root)


def _shared_table_check(root, out):
    first = _BACKGROUND.pop(str(root))
    try:
        first.wait(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(first.pid, signal.SIGKILL)
        return "the first run did not finish"
    if first.returncode:
        return f"the first run failed ({first.returncode}): {first.stderr.read().decode()[-300:]}"
    return _same_run("b", "a", steps=4)(root, out)


RUNDIR_CASES = [
    Case("pref rundir", "pref: a second DPO run into a directory a running DPO run holds", _two_into_one,
         check=_two_into_one_check, timeout=400),
    Case("pref rundir", "pref: two DPO runs at once sharing one data.cache_dir and reference table",
         _shared_table, expect_ok=True, check=_shared_table_check, timeout=400),
]

CASES = PREF_DATA + PREF_RECIPE + PREF_TABLE + PREF_PIN + ASYNC_CASES + CACHE_CASES + RUNDIR_CASES
