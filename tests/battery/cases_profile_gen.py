"""`qlm profile`, `qlm generate`, `qlm eval` and recipe numbers: nan / inf / zero / negative / absurd numbers, pipeline
layouts the schedule cannot run (and whether the fix each error suggests is possible), the layout search at its
extremes, odd checkpoints and prompts; and a new user's first day (piped output, metrics, the demo's notes, the GPU
check without a GPU). Names: `prof:`, `gen:`, `num:`, `day:`."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from battery.case import Case, all_of
from battery.fixtures import qlm, recipe_text

REPO = Path(__file__).resolve().parents[2]
RECIPES = REPO / "recipes"
SFT, MOE, DPO = RECIPES / "tiny-sft.toml", RECIPES / "tiny-moe.toml", RECIPES / "tiny-dpo.toml"
LONG_SEARCH = RECIPES / "qwen3-30b-a3b-32gpu.toml"


# ---- helpers ------------------------------------------------------------------------------------------------------

def _error(out) -> str:
    return next((line for line in out.stderr.splitlines() if line.startswith("error:")), "")


def _names(*texts, stream="stderr"):
    """The output (stderr by default) names every one of TEXTS."""
    def check(root, out):
        text = getattr(out, stream)
        missing = [t for t in texts if t not in text]
        return f"does not name {missing}" if missing else None
    return check


def _run_qlm(root: Path, *args, timeout: float = 120) -> subprocess.CompletedProcess:
    """qlm of the tree under test (REPO), from a check: what another command says about the same input."""
    env = {**os.environ, "COLUMNS": "200", "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "qlm_cli.main", *map(str, args)], cwd=root, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _options(command: str, root: Path) -> set[str]:
    code = ("import typer, qlm_cli.main as m\n"
            f"c = typer.main.get_command(m.app).commands[{command!r}]\n"
            "print('\\n'.join(o for p in c.params for o in p.opts + p.secondary_opts))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    return set(proc.stdout.split())


def _flags_exist(command: str):
    """Every --flag the error suggests is an option of `qlm COMMAND` (a fix the user can type)."""
    def check(root, out):
        line = _error(out)
        flags = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", line))
        missing = sorted(flags - _options(command, root))
        return f"suggests options qlm {command} does not have: {missing}: {line}" if missing else None
    return check


def _hf(root: Path, fx, name="hf") -> Path:
    dst = root / name
    shutil.copytree(fx.hf(), dst)
    return dst


def _jsonl(out) -> list[dict]:
    return [json.loads(line) for line in out.stdout.splitlines() if line.strip().startswith("{")]


def _fixture_recipe(root: Path, fx, extra: str = "", steps: int = 4, hf: Path | None = None) -> Path:
    path = root / "recipe.toml"
    path.write_text(recipe_text(hf or fx.hf(), fx.sft_jsonl() / "chat.jsonl", steps) + extra)
    return path


# ---- profile -------------------------------------------------------------------------------------------------------

def _prof(*args):
    return lambda root, fx: ["profile", *args]


def _most_stages(layers: int):
    """--pp beyond the layers: the --pp the error suggests is at most the layer count."""
    def check(root, out):
        line = _error(out)
        fix = line.split("; ", 1)[-1]  # the fix: what the user is told to pass
        suggested = [int(n) for n in re.findall(r"--pp (?:of )?(?:at most )?(\d+)", fix)]
        after = fix.split("e.g.", 1)[1] if "e.g." in fix else ""
        suggested += [int(n) for n in re.findall(r"\b(\d+)\b", after.split(":", 1)[-1])]
        if not suggested:
            return f"no --pp suggested: {line}"
        bad = [n for n in suggested if n > layers]
        return f"suggests --pp {bad} on a {layers}-layer model: {line}" if bad else None
    return check


def _same_line_as_train(recipe: Path, *sets):
    """The profile's error is the very line `qlm train RECIPE --dry-run --set ...` gives for the same layout."""
    def check(root, out):
        train = _run_qlm(root, "train", recipe, "--dry-run", *[a for s in sets for a in ("--set", s)])
        theirs = next((line for line in train.stderr.splitlines() if line.startswith("error:")), "")
        if not theirs:
            return f"qlm train accepted the layout (exit {train.returncode}) that profile refused"
        return None if theirs == _error(out) else f"profile: {_error(out)!r}\n   train: {theirs!r}"
    return check


def _search_table(num_gpus: int):
    def check(root, out):
        if "layouts costed" not in out.stdout or "best" not in out.stdout:
            return f"no search table: {out.stdout[:300]!r}"
        return None if re.search(r"│ 1 │ tp\d+ pp\d+", out.stdout) else f"no layout row: {out.stdout[:400]!r}"
    return check


def _search_json(num_gpus: int, recipe: Path, experts: int | None = None, train_top: int = 0):
    """--search --json: every ranked layout uses exactly NUM_GPUS, they come fastest first, EP divides the experts;
    the best TRAIN_TOP layouts pass `qlm train --dry-run` with the same keys (the search's checks are the trainer's)."""
    def check(root, out):
        try:
            doc = json.loads(out.stdout)
        except json.JSONDecodeError:
            return f"not one JSON document: {out.stdout[:200]!r}"
        results = doc.get("results") or []
        if not results:
            return "no layout ranked"
        times = [r["time"]["s_per_sample"] for r in results]
        if times != sorted(times):
            return f"not fastest first: {times}"
        for r in results:
            lay = r["layout"]
            used = lay["tp"] * lay["pp"] * lay["cp"] * lay["dp"]
            if used != num_gpus or lay["num_gpus"] != num_gpus:
                return f"{lay['describe']} uses {used} of {num_gpus} GPUs"
            if experts and experts % lay["ep"]:
                return f"{lay['describe']}: ep {lay['ep']} does not divide {experts} experts"
            if not r["memory"]["fits"]:
                return f"{lay['describe']} ranked but does not fit"
        for r in results[:train_top]:
            lay = r["layout"]
            sets = [f"parallel.{k}={json.dumps(lay[k])}" for k in
                    ("tp", "pp", "vpp", "cp", "dp", "sp", "cp_comm_type", "pp_schedule", "zero_stage", "recompute")]
            if lay.get("ep", 1) > 1:
                sets += [f"parallel.ep={lay['ep']}", f"parallel.etp={lay['etp']}"]
            sets += [f"train.micro_batch_size={lay['micro_batch_size']}",
                     f"train.global_batch_size={lay['global_batch_size']}"]
            train = _run_qlm(root, "train", recipe, "--dry-run", *[a for s in sets for a in ("--set", s)])
            if train.returncode != 0:
                tail = train.stderr.strip().splitlines()[-1:] or [""]
                return f"search ranked {lay['describe']} but qlm train --dry-run refuses it: {tail[0][:300]}"
        return None
    return check


def _plot_dir_search(root, fx):
    (root / "mem.png").mkdir()
    return ["profile", SFT, "--search", "--num-gpus", "4", "--plot", root / "mem.png"]


def _long_search_check(root, out):
    lines = [line for line in out.stderr.splitlines() if re.match(r"search on 64 GPUs: \d+/\d+ layouts", line)]
    if not lines:
        return f"no plain progress line on stderr: {out.stderr[-300:]!r}"
    if "layouts costed" not in out.stdout or "best 5 layouts" not in out.stdout:
        return f"no result table: {out.stdout[:300]!r}"
    return None


PROFILE = [
    # device figures: nan / inf / zero / negative
    Case("profile numbers", "prof: --gpu-memory-gb inf", _prof("--gpu-memory-gb", "inf"),
         check=_names("--gpu-memory-gb")),
    Case("profile numbers", "prof: --gpu-memory-gb nan", _prof("--gpu-memory-gb", "nan"),
         check=_names("--gpu-memory-gb")),
    Case("profile numbers", "prof: --peak-tflops nan", _prof("--peak-tflops", "nan"), check=_names("--peak-tflops")),
    Case("profile numbers", "prof: --nvlink-gbps -1", _prof("--nvlink-gbps", "-1"), check=_names("--nvlink-gbps")),
    Case("profile numbers", "prof: --internode-gbps inf", _prof("--internode-gbps", "inf"),
         check=_names("--internode-gbps")),
    Case("profile numbers", "prof: --nvlink-domain -8", _prof("--nvlink-domain", "-8"),
         check=_names("--nvlink-domain")),
    Case("profile numbers", "prof: --gpus-per-node 0", _prof("--gpus-per-node", "0"), check=_names("gpus_per_node")),
    Case("profile numbers", "prof: --efficiency 0", _prof("--efficiency", "0"), check=_names("--efficiency")),
    Case("profile numbers", "prof: --efficiency 1.5", _prof("--efficiency", "1.5"), check=_names("--efficiency")),
    Case("profile numbers", "prof: --efficiency nan", _prof("--efficiency", "nan"), check=_names("--efficiency")),
    Case("profile numbers", "prof: --comm-efficiency inf", _prof("--comm-efficiency", "inf"),
         check=_names("--comm-efficiency")),
    Case("profile numbers", "prof: --allocator-fraction 1 (nothing left)", _prof("--allocator-fraction", "1"),
         check=_names("--allocator-fraction")),
    Case("profile numbers", "prof: --context-gb nan", _prof("--context-gb", "nan"), check=_names("--context-gb")),
    Case("profile numbers", "prof: --context-gb -1", _prof("--context-gb", "-1"), check=_names("--context-gb")),
    Case("profile numbers", "prof: --loss-chunk-tokens -1 on tiny-sft",
         _prof(SFT, "--num-gpus", "1", "--loss-chunk-tokens", "-1"), check=_names("loss-chunk-tokens")),
    # MoE imbalance
    Case("profile numbers", "prof: tiny-moe --ep 2 --moe-imbalance 1e300",
         _prof(MOE, "--ep", "2", "--num-gpus", "2", "--moe-imbalance", "1e300"), check=_names("--moe-imbalance")),
    Case("profile numbers", "prof: tiny-moe --ep 2 --moe-imbalance 0.5",
         _prof(MOE, "--ep", "2", "--num-gpus", "2", "--moe-imbalance", "0.5"), check=_names("--moe-imbalance")),
    Case("profile numbers", "prof: tiny-moe --ep 2 --moe-imbalance nan",
         _prof(MOE, "--ep", "2", "--num-gpus", "2", "--moe-imbalance", "nan"), check=_names("--moe-imbalance")),
    # device counts, answered at once
    Case("profile search", "prof: --search --num-gpus 0", _prof("--search", "--num-gpus", "0"),
         check=_names("num-gpus"), timeout=60),
    Case("profile search", "prof: --search --num-gpus -4", _prof("--search", "--num-gpus", "-4"),
         check=_names("num-gpus"), timeout=60),
    Case("profile search", "prof: --search --num-gpus 1000000000 (answers within seconds)",
         _prof("--search", "--num-gpus", "1000000000"), check=_names("1000000000", "--num-gpus"), timeout=60),
    Case("profile search", "prof: tiny-sft --search --num-gpus 1000000000 (answers within seconds)",
         _prof(SFT, "--search", "--num-gpus", "1000000000"), check=_names("1000000000", "--num-gpus"), timeout=60),
    Case("profile search", "prof: tiny-sft --search --num-gpus 7 (prime: no layout)",
         _prof(SFT, "--search", "--num-gpus", "7"), check=_names("7 GPUs"), timeout=60),
    # batch and sequence
    Case("profile layouts", "prof: --seq-len 0 (no search)", _prof("--seq-len", "0"), check=_names("seq-len")),
    Case("profile layouts", "prof: tiny-sft --mbs -3", _prof(SFT, "--num-gpus", "1", "--mbs", "-3"),
         check=_names("mbs")),
    Case("profile layouts", "prof: --gbs 3 --mbs 2 (not a multiple)", _prof("--gbs", "3", "--mbs", "2"),
         check=_names("global batch of 3")),
    # layouts the model cannot take
    Case("profile layouts", "prof: tiny-sft --tp 3 on 4 heads", _prof(SFT, "--tp", "3", "--num-gpus", "3"),
         check=_names("--tp 3", "4")),
    Case("profile layouts", "prof: tiny-sft --pp 8 on 4 layers (suggests at most 4 stages)",
         _prof(SFT, "--pp", "8", "--num-gpus", "8"), check=_most_stages(4)),
    Case("profile layouts", "prof: tiny-sft --pp 3 on 4 layers (suggested options exist)",
         _prof(SFT, "--pp", "3", "--num-gpus", "3"), check=_flags_exist("profile")),
    Case("profile layouts", "prof: --pp 8 on qwen2-7b's 28 layers (suggested options exist)",
         _prof("--pp", "8"), check=_flags_exist("profile")),
    Case("profile layouts", "prof: tiny-sft --cp 3 (seq 128 not in 6 chunks)",
         _prof(SFT, "--cp", "3", "--num-gpus", "3"),
         check=_names("cp")),
    Case("profile layouts", "prof: tiny-sft --pp 2 --vpp 3", _prof(SFT, "--pp", "2", "--vpp", "3", "--num-gpus", "2"),
         check=_names("3")),
    Case("profile layouts", "prof: tiny-sft --pp 4 --vpp 2 (8 chunks, 4 layers)",
         _prof(SFT, "--pp", "4", "--vpp", "2", "--num-gpus", "4"), check=_names("vpp")),
    Case("profile layouts", "prof: --zero 4", _prof("--zero", "4"), check=_names("zero_stage 4")),
    Case("profile layouts", "prof: --recompute full --recompute-num-layers 0",
         _prof("--recompute", "full", "--recompute-num-layers", "0"), check=_names("recompute_num_layers")),
    Case("profile layouts", "prof: tiny-moe --ep 3 (8 experts)", _prof(MOE, "--ep", "3", "--num-gpus", "3"),
         check=_names("--ep 3", "8")),
    Case("profile layouts", "prof: tiny-moe --ep 2 --etp 3", _prof(MOE, "--ep", "2", "--etp", "3", "--num-gpus", "6"),
         check=_names("--etp 3")),
    Case("profile layouts", "prof: tiny-dpo --ep 2 (not MoE)", _prof(DPO, "--ep", "2", "--num-gpus", "2"),
         check=_names("--ep")),
    Case("profile layouts", "prof: tiny-moe --ep 2 --pp 2 --dp 2 (1 micro-batch): the line qlm train gives",
         _prof(MOE, "--ep", "2", "--pp", "2", "--dp", "2"),
         check=_same_line_as_train(MOE, "parallel.ep=2", "parallel.pp=2", "parallel.dp=2")),
    Case("profile layouts", "prof: tiny-dpo --pp 2 --dp 2 (1 micro-batch): the line qlm train gives",
         _prof(DPO, "--pp", "2", "--dp", "2"),
         check=_same_line_as_train(DPO, "parallel.pp=2", "parallel.dp=2")),
    # the search on tiny models
    Case("profile search", "prof: tiny-sft --search --num-gpus 4 (table)", _prof(SFT, "--search", "--num-gpus", "4"),
         check=_search_table(4), expect_ok=True, timeout=120),
    Case("profile search", "prof: tiny-sft --search --num-gpus 2 --json: the best layouts train",
         _prof(SFT, "--search", "--num-gpus", "2", "--json"), check=_search_json(2, SFT, train_top=3),
         expect_ok=True, timeout=180),
    Case("profile search", "prof: tiny-moe --search --num-gpus 4 --json: layouts sane, the best train",
         _prof(MOE, "--search", "--num-gpus", "4", "--json"), check=_search_json(4, MOE, experts=8, train_top=3),
         expect_ok=True, timeout=180),
    Case("profile search", "prof: tiny-dpo --search --num-gpus 2 (table)", _prof(DPO, "--search", "--num-gpus", "2"),
         check=_search_table(2), expect_ok=True, timeout=120),
    Case("profile search", "prof: --search --plot that is a directory (refused before the search)", _plot_dir_search,
         check=all_of(_names("is a directory"),
                    lambda root, out: "searched before refusing the plot" if "layouts costed" in out.stdout else None)),
    Case("profile search", "prof: qwen3-30b-a3b --search --num-gpus 64 shows progress without a terminal",
         _prof(LONG_SEARCH, "--search", "--num-gpus", "64"), check=_long_search_check, expect_ok=True, timeout=1500),
]


# ---- generate ------------------------------------------------------------------------------------------------------

def _gen(*args):
    return lambda root, fx: ["generate", fx.hf(), "--raw", *args]


def _file(root: Path, name: str, data: bytes) -> Path:
    (root / name).write_bytes(data)
    return root / name


def _tokens_at_most(n: int, rows: int = 1):
    def check(root, out):
        got = _jsonl(out)
        if len(got) != rows:
            return f"expected {rows} answer(s): {out.stdout[:200]!r}"
        long = [len(r["token_ids"]) for r in got if len(r["token_ids"]) > n]
        return f"answers of {long} tokens, more than {n}" if long else None
    return check


def _window_warning(root, out):
    warns = [line for line in out.stderr.splitlines() if line.startswith("warning:")]
    return None if warns and "256" in warns[0] else f"no warning naming the 256-token window: {out.stderr[-300:]!r}"


def _fox(words: int) -> str:
    return " ".join(["fox"] * words)  # 2 * words tokens with the fixture's tokenizer


def _short_with_long(root, fx):
    return ["generate", fx.hf(), "--raw", "--jsonl", "--max-new-tokens", "5", "-p", _fox(127), "-p", "hi"]


def _short_row_full(root, out):
    rows = _jsonl(out)
    if len(rows) != 2:
        return f"expected 2 answers: {out.stdout[:200]!r}"
    short = rows[1]
    if short["finish"] == "length" and len(short["token_ids"]) != 5:
        return (f"the short prompt got {len(short['token_ids'])} of --max-new-tokens 5 tokens: capped by the other "
                f"prompt of its batch (alone it gets 5)")
    return None


def _lora_run(root: Path, fx, move_base: bool) -> Path:
    base = _hf(root, fx, "base")
    recipe = _fixture_recipe(root, fx, "\n[lora]\nrank = 4\nalpha = 8.0\n", steps=2, hf=base)
    qlm("train", recipe, "--output", root / "lora-run")
    if move_base:
        base.rename(root / "base.moved")
    return root / "lora-run"


def _mixtral_window0(root, fx):
    from conftest import make_hf_model

    path = root / "mixtral"
    try:
        make_hf_model(path, "mixtral", sliding_window=0)
    except Exception:  # a transformers that refuses 0: write the number into config.json by hand
        make_hf_model(path, "mixtral")
    config = json.loads((path / "config.json").read_text())
    config["sliding_window"] = 0
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return ["generate", path, "--raw", "-p", "hi", "--max-new-tokens", "3"]


GENERATE = [
    Case("generate prompts", "gen: empty --prompt ''", _gen("-p", ""), check=_names("empty")),
    Case("generate prompts", "gen: blank --prompt of spaces and a tab", _gen("-p", "  \t "), check=_names("empty")),
    Case("generate prompts", "gen: --prompt-file that is empty",
         lambda root, fx: ["generate", fx.hf(), "--raw", "--prompt-file", _file(root, "p.txt", b"")],
         check=_names("p.txt")),
    Case("generate prompts", "gen: --prompt-file that is binary (PNG bytes)",
         lambda root, fx: ["generate", fx.hf(), "--raw", "--prompt-file",
                           _file(root, "p.png", b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xfe")],
         check=_names("p.png")),
    Case("generate prompts", "gen: --prompt-file that is a directory",
         lambda root, fx: (root / "prompts").mkdir() or ["generate", fx.hf(), "--raw", "--prompt-file",
                                                         root / "prompts"],
         check=_names("prompts", "directory")),
    Case("generate options", "gen: --max-new-tokens -1", _gen("-p", "hi", "--max-new-tokens", "-1"),
         check=_names("--max-new-tokens")),
    Case("generate options", "gen: --max-new-tokens 10**12 (capped at the window, warned)",
         _gen("-p", "hi", "--jsonl", "--max-new-tokens", str(10**12)),
         check=all_of(_window_warning, _tokens_at_most(256)), expect_ok=True, timeout=120),
    Case("generate options", "gen: --max-new-tokens 10**30 (past int64)",
         _gen("-p", "hi", "--jsonl", "--max-new-tokens", str(10**30)),
         check=all_of(_window_warning, _tokens_at_most(256)), expect_ok=True, timeout=120),
    Case("generate options", "gen: --temperature nan", _gen("-p", "hi", "--temperature", "nan"),
         check=_names("--temperature")),
    Case("generate options", "gen: --temperature inf", _gen("-p", "hi", "--temperature", "inf"),
         check=_names("--temperature")),
    Case("generate options", "gen: --temperature 1e-300 (positive: sampling, near greedy)",
         _gen("-p", "hi", "--jsonl", "--temperature", "1e-300", "--max-new-tokens", "3"),
         check=_tokens_at_most(3), expect_ok=True),
    Case("generate options", "gen: --top-p nan", _gen("-p", "hi", "--temperature", "1", "--top-p", "nan"),
         check=_names("--top-p")),
    Case("generate options", "gen: --top-p 0", _gen("-p", "hi", "--temperature", "1", "--top-p", "0"),
         check=_names("--top-p")),
    Case("generate options", "gen: --top-p 2", _gen("-p", "hi", "--temperature", "1", "--top-p", "2"),
         check=_names("--top-p")),
    Case("generate options", "gen: --top-k -1 while sampling", _gen("-p", "hi", "--temperature", "1", "--top-k", "-1"),
         check=_names("--top-k")),
    Case("generate options", "gen: --seed -1", _gen("-p", "hi", "--temperature", "1", "--seed", "-1"),
         check=_names("--seed")),
    Case("generate options", "gen: --seed 2**63 (past int64)", _gen("-p", "hi", "--temperature", "1", "--seed",
                                                                      str(2**63)), check=_names("--seed")),
    Case("generate options", "gen: --batch-size -2", _gen("-p", "hi", "--batch-size", "-2"),
         check=_names("--batch-size")),
    # checkpoints of other formats
    Case("generate checkpoints", "gen: a DeepSpeed checkpoint",
         lambda root, fx: ["generate", fx.checkpoints("deepspeed"), "--raw", "-p", "hi", "--max-new-tokens", "3",
                           "--jsonl"], check=_tokens_at_most(3), expect_ok=True),
    Case("generate checkpoints", "gen: a torch_dist checkpoint (TP1)",
         lambda root, fx: ["generate", fx.checkpoints("torch_dist"), "--raw", "-p", "hi", "--max-new-tokens", "3",
                           "--jsonl"], check=_tokens_at_most(3), expect_ok=True),
    Case("generate checkpoints", "gen: a plain file as the checkpoint",
         lambda root, fx: ["generate", _file(root, "model.safetensors", b"\x00" * 64), "--raw", "-p", "hi"],
         check=_names("model.safetensors")),
    Case("generate checkpoints", "gen: a LoRA-only run (adapters merged onto model.load)",
         lambda root, fx: ["generate", _lora_run(root, fx, False), "--raw", "-p", "hi", "--max-new-tokens", "3",
                           "--jsonl"], check=_tokens_at_most(3), expect_ok=True, timeout=180),
    Case("generate checkpoints", "gen: a LoRA-only run whose base was moved",
         lambda root, fx: ["generate", _lora_run(root, fx, True), "--raw", "-p", "hi"],
         check=lambda root, out: None if str(root / "base") in out.stderr else "the missing base is not named",
         timeout=180),
    Case("generate checkpoints", "gen: a Mixtral with sliding_window 0", _mixtral_window0,
         check=_names("sliding_window")),
    # the context window
    Case("generate prompts", "gen: prompt + answer past the context window (warned, exit 0)",
         _gen("-p", _fox(127), "--jsonl", "--max-new-tokens", "5"),
         check=all_of(_window_warning, _tokens_at_most(2)), expect_ok=True),
    Case("generate prompts", "gen: a prompt exactly the context window (256 tokens)",
         _gen("-p", _fox(128), "--max-new-tokens", "5"), check=_names("256")),
    Case("generate prompts", "gen: a short prompt batched with one near the window still gets its tokens",
         _short_with_long, check=all_of(_window_warning, _short_row_full), expect_ok=True),
]


# ---- numbers: eval flags, eval tasks, recipe keys, pipeline layouts --------------------------------------------------

def _eval(*args):
    return lambda root, fx: ["eval", fx.hf(), "--tasks", "qlm_demo_mc", *args]


LISTY_PPL = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
    aggregation: weighted_perplexity
    higher_is_better: false
metadata:
  version: 1.0
"""

LISTY_LL = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood
doc_to_text: "{{{{q}}}}"
doc_to_target: "{{{{a}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


def _listy_task(template: str, rows: list[dict], backend: str):
    def setup(root, fx):
        tasks = root / "tasks"
        tasks.mkdir()
        (tasks / "docs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (tasks / "mine.yaml").write_text(template.format(name="my_listy", data=tasks / "docs.jsonl"))
        return ["eval", fx.hf(), "--tasks", "my_listy", "--include-path", tasks, "--backend", backend]
    return setup


def _train(*sets, recipe=SFT):
    return lambda root, fx: ["train", recipe, "--dry-run", *[a for s in sets for a in ("--set", s)]]


def _gpipe_fix_possible(root, out):
    """An interleaved layout (vpp 2) whose micro-batches the schedule cannot take: a suggested gpipe must come with
    dropping vpp (gpipe refuses vpp 2), or the fix does not run."""
    line = _error(out)
    if "gpipe" in line and "vpp" not in line:
        fixed = _run_qlm(root, "train", SFT, "--dry-run", "--set", "parallel.pp=2", "--set", "parallel.vpp=2",
                         "--set", "train.global_batch_size=24", "--set", "parallel.pp_schedule=gpipe")
        if fixed.returncode != 0:
            return f"suggests gpipe, which refuses this layout's vpp 2: {fixed.stderr.strip().splitlines()[-1][:200]}"
    return None


def _seq_warning(root, out):
    warns = [line for line in out.stderr.splitlines() if line.startswith("warning:")]
    hit = [w for w in warns if "512" in w and "256" in w]
    return None if hit else f"no warning naming 512 and 256: {out.stderr[-300:]!r}"


def _blend_overflow(root, fx):
    data = root / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": f"document number {i} " * 20}) + "\n" for i in range(100)))
    for name in ("a", "b"):
        qlm("data", "preprocess", "--input", data, "--tokenizer", fx.tokenizer(), "--output", root / name)
    recipe = root / "pretrain.toml"
    recipe.write_text(f"""[model]
spec = "{fx.hf()}"
dtype = "fp32"

[data]
kind = "pretrain"
train = ["{root / 'a'}", "{root / 'b'}"]
weights = [1e308, 1e308]
seq_length = 32

[train]
micro_batch_size = 2
global_batch_size = 4
train_iters = 2

[logging]
plot = false
tensorboard = false
""")
    return ["train", recipe, "--output", root / "run"]


NUMBERS = [
    # eval flags
    Case("numbers eval", "num: eval --limit inf", _eval("--limit", "inf"), check=_names("--limit")),
    Case("numbers eval", "num: eval --limit nan", _eval("--limit", "nan"), check=_names("--limit")),
    Case("numbers eval", "num: eval --limit -inf", _eval("--limit", "-inf"), check=_names("--limit")),
    Case("numbers eval", "num: eval --limit 1e300 (a count past the task: all of it)", _eval("--limit", "1e300"),
         check=_names("qlm_demo_mc: acc", stream="stdout"), expect_ok=True, timeout=120),
    Case("numbers eval", "num: eval --limit 0.0 --backend hf", _eval("--limit", "0.0", "--backend", "hf"),
         check=_names("--limit")),
    Case("numbers eval", "num: eval --tasks ''", lambda root, fx: ["eval", fx.hf(), "--tasks", ""],
         check=_names("--tasks")),
    Case("numbers eval", "num: eval --num-fewshot -1 --backend hf", _eval("--num-fewshot", "-1", "--backend", "hf"),
         check=_names("--num-fewshot")),
    Case("numbers eval", "num: eval --batch-size 0", _eval("--batch-size", "0"), check=_names("--batch-size")),
    Case("numbers eval", "num: eval --tp 0", _eval("--tp", "0"), check=_names("--tp")),
    Case("numbers eval", "num: eval --max-length 1 (shorter than every answer)",
         _eval("--limit", "2", "--max-length", "1"),
         check=_names("--max-length"), timeout=120),
    Case("numbers eval", "num: eval --max-length 2 --backend hf", _eval("--limit", "2", "--max-length", "2",
                                                                         "--backend", "hf"),
         check=_names("--max-length"), timeout=120),
    Case("numbers eval", "num: user perplexity task whose text looks like a list (qlm backend)",
         _listy_task(LISTY_PPL, [{"text": "[1, 2, 3]"}, {"text": "plain words"}], "qlm"),
         check=_names("my_listy", "document 0"), timeout=120),
    Case("numbers eval", "num: user perplexity task whose text looks like a list (hf backend)",
         _listy_task(LISTY_PPL, [{"text": "plain words"}, {"text": "[1, 2, 3]"}], "hf"),
         check=_names("my_listy", "document 1"), timeout=120),
    Case("numbers eval", "num: user loglikelihood task whose target looks like a list",
         _listy_task(LISTY_LL, [{"q": "count:", "a": "[1, 2]"}], "qlm"),
         check=_names("my_listy", "document 0"), timeout=120),
    # recipe numbers
    Case("numbers recipe", "num: optim.lr nan", _train("optim.lr=nan"), check=_names("optim.lr")),
    Case("numbers recipe", "num: optim.lr inf", _train("optim.lr=inf"), check=_names("optim.lr")),
    Case("numbers recipe", "num: optim.lr 0", _train("optim.lr=0"), check=_names("optim.lr")),
    Case("numbers recipe", "num: optim.clip_grad -inf", _train("optim.clip_grad=-inf"),
         check=_names("optim.clip_grad")),
    Case("numbers recipe", "num: optim.beta2 1", _train("optim.beta2=1"), check=_names("optim.beta2")),
    Case("numbers recipe", "num: schedule.min_lr nan", _train("schedule.min_lr=nan"), check=_names("schedule.min_lr")),
    Case("numbers recipe", "num: schedule.min_lr above optim.lr (the schedule would raise the rate)",
         _train("schedule.min_lr=1.0"), check=_names("schedule.min_lr", "optim.lr")),
    Case("numbers recipe", "num: train.exit_duration_minutes inf", _train("train.exit_duration_minutes=inf"),
         check=_names("train.exit_duration_minutes")),
    Case("numbers recipe", "num: data.weights [1.0, nan]", _train("data.weights=[1.0, nan]"),
         check=_names("data.weights")),
    Case("numbers recipe", "num: logging.peak_tflops inf", _train("logging.peak_tflops=inf"),
         check=_names("logging.peak_tflops")),
    Case("numbers recipe", "num: parallel.bucket_size_mb nan", _train("parallel.bucket_size_mb=nan"),
         check=_names("parallel.bucket_size_mb")),
    Case("numbers recipe", "num: train.global_batch_size 1e3 (a float)", _train("train.global_batch_size=1e3"),
         check=_names("train.global_batch_size")),
    # finite weights whose sum overflows: a 1:1 blend (scaled before it is summed; see test_hardening_second_wave)
    Case("numbers recipe", "num: pretrain blend weights [1e308, 1e308] (their sum overflows) train 1:1",
         _blend_overflow, expect_ok=True, timeout=180),
    # pipeline layouts
    Case("numbers layout", "num: 1f1b pp=2 with one micro-batch per step",
         _train("parallel.pp=2", "train.global_batch_size=8"),
         check=_names("1 (", "train.global_batch_size", "train.micro_batch_size")),
    Case("numbers layout", "num: interleaved_1f1b vpp=2, 3 micro-batches (the fix suggested runs)",
         _train("parallel.pp=2", "parallel.vpp=2", "parallel.pp_schedule=interleaved_1f1b",
                "train.global_batch_size=24"), check=all_of(_names("3 ("), _gpipe_fix_possible)),
    Case("numbers layout", "num: zero_bubble pp=2, 3 micro-batches",
         _train("parallel.pp=2", "parallel.pp_schedule=zero_bubble", "train.global_batch_size=24"),
         check=_names("zero_bubble", "3 (")),
    Case("numbers layout", "num: gpipe pp=2 with one micro-batch (valid)",
         _train("parallel.pp=2", "parallel.pp_schedule=gpipe", "train.global_batch_size=8"), expect_ok=True),
    Case("numbers layout", "num: data.seq_length 512 past the loaded HF model's 256 positions (warned)",
         lambda root, fx: ["train", fx.recipe(), "--dry-run", "--set", "data.seq_length=512"],
         check=_seq_warning, expect_ok=True),
]


# ---- a new user's first day ----------------------------------------------------------------------------------------

def _day_train(root, fx):
    return ["train", SFT, "--set", "train.train_iters=40", "--output", root / "run"]


def _day_train_check(root, out):
    steps = re.findall(r"^step (\d+)/40 loss ", out.stdout, re.M)
    if not steps:
        return f"no plain step line on stdout: {out.stdout[:400]!r}"
    summary_at = out.stdout.find("summary")
    if int(steps[0]) >= 40 or out.stdout.find(f"step {steps[0]}/40") > (summary_at if summary_at >= 0 else 10**9):
        return f"only the last step shown, or after the summary: steps {steps}"
    metrics = [json.loads(line) for line in (root / "run" / "metrics.jsonl").read_text().splitlines() if line]
    if not metrics or "label_tokens" not in metrics[0] or "tokens" in metrics[0]:
        return f"metrics.jsonl keys: {sorted(metrics[0]) if metrics else None} (want label_tokens, not tokens)"
    summary = json.loads((root / "run" / "summary.json").read_text())
    missing = [k for k in ("tokens", "label_tokens") if k not in summary]
    return f"summary.json lacks {missing}" if missing else None


def _day_killed(root, fx):
    return ["train", SFT, "--set", "train.train_iters=4000", "--set", "checkpoint.save_interval=0",
            "--set", "train.eval_interval=0", "--output", root / "run"]


def _day_killed_check(root, out):
    return None if re.search(r"^step 1/4000 loss ", out.stdout, re.M) else (
        f"killed after 30 s with no step line on stdout (buffered until the end?): {out.stdout[-300:]!r}")


def _gpu_check(root, fx):
    env = {**os.environ, "OUT": str(root / "gpu_out")}
    proc = subprocess.run(["bash", str(REPO / "bench" / "gpu_check.sh")], env=env, capture_output=True, text=True,
                          timeout=120)
    (root / "gpu_check.json").write_text(json.dumps({"rc": proc.returncode, "stdout": proc.stdout,
                                                      "stderr": proc.stderr}))
    return ["--version"]


def _gpu_check_result(root, out):
    got = json.loads((root / "gpu_check.json").read_text())
    if got["rc"] == 0:
        return "bench/gpu_check.sh exit 0 without CUDA"
    if "nothing was checked" not in got["stdout"] + got["stderr"]:
        return f"exit {got['rc']} without saying nothing was checked: {got['stderr'][-200:]!r}"
    return None


def _day_generate(root, fx):
    qlm("train", SFT, "--set", "train.train_iters=20", "--set", "checkpoint.save_interval=20", "--output",
        root / "run")
    return ["generate", root / "run", "-p", "reverse: a b c d", "--max-new-tokens", "8"]


FIRST_DAY = [
    Case("first day", "day: tiny-sft piped (no terminal): step lines, label_tokens, summary tokens", _day_train,
         check=_day_train_check, expect_ok=True, timeout=240),
    Case("first day", "day: tiny-sft piped, killed after 30 s: step lines already written", _day_killed,
         check=_day_killed_check, interrupt=(30, signal.SIGKILL), timeout=120),
    Case("first day", "day: eval a chat-tuned run on qlm_demo_ppl explains the perplexity",
         lambda root, fx: ["eval", fx.run(), "--tasks", "qlm_demo_ppl", "--limit", "4"],
         check=_names("note:", "chat", stream="stdout"), expect_ok=True, timeout=120),
    Case("first day", "day: bench/gpu_check.sh without CUDA says nothing was checked, exit non-zero", _gpu_check,
         check=_gpu_check_result, expect_ok=True, timeout=60),
    Case("first day", "day: tiny-dpo before tiny-sft was trained", lambda root, fx: ["train", DPO],
         check=_names("runs/tiny-sft")),
    Case("first day", "day: generate with the run tiny-sft just wrote", _day_generate, expect_ok=True, timeout=240),
]


CASES = PROFILE + GENERATE + NUMBERS + FIRST_DAY
