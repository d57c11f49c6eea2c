"""The CLI surface (`cli:`): user text with Rich markup in it, click/Typer usage errors of every verb, eval and
profile numbers out of range, eval --output and profile --plot problems, unknown tasks, missing optional packages
(simulated by a sitecustomize that blocks their import), eval of one iteration of a run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from battery.case import Case
from battery.fixtures import recipe_text

TAG = "cli:"
REPO = Path(__file__).resolve().parents[2]
TASK = ["--tasks", "qlm_demo_mc", "--limit", "2", "--batch-size", "2"]


def _hf(root, fx, name="hf"):
    dst = root / name
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(fx.hf(), dst)
    return dst


def _shows(*texts, stream="stderr"):
    def check(root, out):
        text = getattr(out, stream)
        missing = [t for t in texts if t not in text]
        return f"not shown as written: {missing}" if missing else None
    return check


def _usage(command: str):
    return _shows(f"run '{command} --help'")


def _site(root: Path, code: str) -> dict:
    """Environment whose sitecustomize runs `code` at start-up (it blocks a package, or denies a write)."""
    site = root / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(code)
    return {"PYTHONPATH": f"{site}:{REPO}"}


BLOCK = "import sys\nsys.modules[{name!r}] = None\n"
DENY_PROBE = """import errno, pathlib
_real = pathlib.Path.write_bytes
def _denied(self, data):
    if self.name.startswith(".qlm-write-check"):
        raise PermissionError(errno.EACCES, "Permission denied", str(self))
    return _real(self, data)
pathlib.Path.write_bytes = _denied
"""


# ---- markup in paths: some succeed, showing the path as written ----------------------------------------------------

def _eval_markup_ok(root, fx):
    ckpt = _hf(root, fx, "e[red]v/hf")
    return ["eval", ckpt.relative_to(root), *TASK, "--output", "o[bold]ut"]


def _eval_markup_check(root, out):
    if "e[red]v/hf" not in out.stdout or "o[bold]ut" not in out.stdout:
        return "paths not shown as written"
    if not list((root / "o[bold]ut").rglob("results_*.json")):
        return "no results file"
    if (root / "o[bold]ut" / "None").exists():
        return "results under None/"
    return None


def _dry_run_markup(root, fx):
    hf = _hf(root, fx, "m[red]x/hf")
    recipe = root / "r[bold]/recipe.toml"
    recipe.parent.mkdir()
    recipe.write_text(recipe_text(hf, fx.sft_jsonl() / "chat.jsonl"))
    return ["train", recipe, "--dry-run"]


def _profile_model_markup(root, fx):
    hf = _hf(root, fx, "p[bold]m/hf")
    return ["profile", "--model", hf, "--seq-len", "64", "--mbs", "1", "--gbs", "4", "--dtype", "fp32"]


def _convert_markup(root, fx):
    hf = _hf(root, fx, "h[red]f")
    return ["convert", "hf2mcore", "--hf", hf, "--out", root / "o[x]" / "mc"]


def _preprocess_markup(root, fx):
    src = root / "in[red].jsonl"
    src.write_text("".join(json.dumps({"text": f"doc {i} [bold]x"}) + "\n" for i in range(4)))
    return ["data", "preprocess", "--input", src, "--tokenizer", fx.tokenizer(), "--output", root / "d[bold]" / "c"]


def _unknown_section(root, fx):
    recipe = root / "s[red]x.toml"
    recipe.write_text("[foo]\nx = 1\n")
    return ["train", recipe]


def _plot_markup(root, fx):
    return ["profile", "--plot", root / "p[red]x" / "mem.png"]


# ---- the iteration of a run ----------------------------------------------------------------------------------------

def _iteration_dir(root, fx):
    run = fx.run()
    latest = (run / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip()
    return ["eval", run / "checkpoints" / f"iter_{int(latest):07d}", *TASK]


CASES = [
    # markup in user text, valid: the command succeeds and shows it as written
    Case("5 rich markup", f"{TAG} eval ckpt and --output with [brackets] succeed", _eval_markup_ok,
         check=_eval_markup_check, expect_ok=True),
    Case("5 rich markup", f"{TAG} train --dry-run, model path with [red]", _dry_run_markup,
         check=_shows("m[red]x/hf", stream="stdout"), expect_ok=True),
    Case("5 rich markup", f"{TAG} profile --model HF dir with [bold]", _profile_model_markup,
         check=_shows("p[bold]m/hf", stream="stdout"), expect_ok=True),
    Case("5 rich markup", f"{TAG} profile --plot under a [red] folder", _plot_markup,
         check=lambda root, out: (None if (root / "p[red]x" / "mem.png").is_file() and "p[red]x/mem.png" in out.stdout
                                  else "plot missing or its path not shown as written"), expect_ok=True),
    Case("5 rich markup", f"{TAG} convert hf2mcore from/to [bracket] paths", _convert_markup,
         check=lambda root, out: None if (root / "o[x]" / "mc").is_dir() else "no output", expect_ok=True),
    Case("5 rich markup", f"{TAG} data preprocess [red] input, [bold] output", _preprocess_markup,
         check=lambda root, out: None if (root / "d[bold]" / "c.bin").is_file() else "no .bin", expect_ok=True),
    # markup in user text, errors: the message shows it as written
    Case("5 rich markup", f"{TAG} train: unknown section [foo] in a [red] path", _unknown_section,
         check=_shows("unknown section [foo]")),  # the message does not name the file (config.py: the lead's)
    Case("5 rich markup", f"{TAG} eval: missing [red] checkpoint",
         lambda root, fx: ["eval", "[red]missing", "--tasks", "qlm_demo_mc"], check=_shows("[red]missing")),
    Case("5 rich markup", f"{TAG} profile: missing [bold] recipe",
         lambda root, fx: ["profile", "[bold]r.toml"], check=_shows("[bold]r.toml")),
    Case("5 rich markup", f"{TAG} convert inspect: missing [red] dir",
         lambda root, fx: ["convert", "inspect", root / "i[red]x"], check=_shows("i[red]x")),
    Case("5 rich markup", f"{TAG} data preprocess: missing [bold] input",
         lambda root, fx: ["data", "preprocess", "--input", "[bold]none.jsonl", "--tokenizer", fx.tokenizer(),
                           "--output", root / "c"], check=_shows("[bold]none.jsonl")),
    # click / Typer usage errors of every verb: one line, exit 2
    Case("usage", f"{TAG} train without its recipe argument", lambda root, fx: ["train"],
         check=_usage("qlm train")),
    Case("usage", f"{TAG} train --nnodes not a number", lambda root, fx: ["train", fx.recipe(), "--nnodes", "x"],
         check=_usage("qlm train")),
    Case("usage", f"{TAG} eval without --tasks", lambda root, fx: ["eval", fx.hf()], check=_usage("qlm eval")),
    Case("usage", f"{TAG} eval --backend not a choice",
         lambda root, fx: ["eval", fx.hf(), "--tasks", "x", "--backend", "vllm"], check=_usage("qlm eval")),
    Case("usage", f"{TAG} profile --tp not an integer", lambda root, fx: ["profile", "--tp", "two"],
         check=_usage("qlm profile")),
    Case("usage", f"{TAG} profile --gpu not a preset", lambda root, fx: ["profile", "--gpu", "v100"],
         check=_usage("qlm profile")),
    Case("usage", f"{TAG} convert hf2mcore without --hf", lambda root, fx: ["convert", "hf2mcore", "--out", root / "o"],
         check=_usage("qlm convert hf2mcore")),
    Case("usage", f"{TAG} convert: no such subcommand", lambda root, fx: ["convert", "frobnicate"],
         check=_usage("qlm convert")),
    Case("usage", f"{TAG} data preprocess --workers 0",
         lambda root, fx: ["data", "preprocess", "--input", "a", "--tokenizer", "b", "--output", "c", "--workers", "0"],
         check=_usage("qlm data preprocess")),
    Case("usage", f"{TAG} qlm --no-such-flag", lambda root, fx: ["--no-such-flag"], check=_usage("qlm")),
    # zero and negative numbers
    Case("4 zero and negative", f"{TAG} eval --limit 0", lambda root, fx: ["eval", fx.hf(), "--tasks", "qlm_demo_mc",
                                                                            "--limit", "0"], check=_shows("(0, 1)")),
    Case("4 zero and negative", f"{TAG} eval --limit -1",
         lambda root, fx: ["eval", fx.hf(), "--tasks", "qlm_demo_mc", "--limit", "-1"], check=_shows("--limit -1")),
    Case("4 zero and negative", f"{TAG} eval --limit 2.5 (neither count nor fraction)",
         lambda root, fx: ["eval", fx.hf(), "--tasks", "qlm_demo_mc", "--limit", "2.5"], check=_shows("--limit 2.5")),
    Case("4 zero and negative", f"{TAG} eval --num-fewshot -1",
         lambda root, fx: ["eval", fx.hf(), "--tasks", "qlm_demo_mc", "--num-fewshot", "-1"],
         check=_shows("--num-fewshot")),
    Case("4 zero and negative", f"{TAG} eval --iteration -1",
         lambda root, fx: ["eval", fx.hf(), "--tasks", "qlm_demo_mc", "--iteration", "-1"],
         check=_shows("--iteration")),
    Case("4 zero and negative", f"{TAG} profile --mbs 0", lambda root, fx: ["profile", "--mbs", "0"],
         check=_shows("mbs must be >= 1")),
    Case("4 zero and negative", f"{TAG} profile --gbs -4", lambda root, fx: ["profile", "--gbs", "-4"],
         check=_shows("gbs must be >= 1")),
    Case("4 zero and negative", f"{TAG} profile --search --seq-len 0",
         lambda root, fx: ["profile", "--search", "--seq-len", "0", "--num-gpus", "8"], check=_shows("seq-len")),
    Case("4 zero and negative", f"{TAG} profile --vpp 0", lambda root, fx: ["profile", "--vpp", "0"],
         check=_shows("vpp must be >= 1")),
    Case("4 zero and negative", f"{TAG} profile --dp 0", lambda root, fx: ["profile", "--dp", "0"],
         check=_shows("dp must be >= 1")),
    Case("4 zero and negative", f"{TAG} profile --num-gpus -1", lambda root, fx: ["profile", "--num-gpus", "-1"],
         check=_shows("num-gpus")),
    Case("4 zero and negative", f"{TAG} profile --gpu-memory-gb 0",
         lambda root, fx: ["profile", "--gpu-memory-gb", "0"], check=_shows("--gpu-memory-gb 0")),
    Case("4 zero and negative", f"{TAG} profile --allocator-fraction 1.5",
         lambda root, fx: ["profile", "--allocator-fraction", "1.5"], check=_shows("--allocator-fraction")),
    Case("4 zero and negative", f"{TAG} profile --model with --pp 0",
         lambda root, fx: ["profile", "--model", "llama3-8b", "--pp", "0"], check=_shows("pp must be >= 1")),
    # output locations
    Case("output", f"{TAG} eval --output is a regular file",
         lambda root, fx: (root / "f").write_text("x") and ["eval", fx.hf(), *TASK, "--output", root / "f"],
         check=_shows("is a file, not a folder")),
    Case("output", f"{TAG} eval --output under a regular file",
         lambda root, fx: (root / "f").write_text("x") and ["eval", fx.hf(), *TASK, "--output", root / "f" / "sub"],
         check=_shows("cannot write to --output")),
    Case("output", f"{TAG} eval --output unwritable (EACCES)",
         lambda root, fx: (["eval", fx.hf(), *TASK, "--output", root / "ro"], _site(root, DENY_PROBE)),
         check=_shows("Permission denied")),
    Case("output", f"{TAG} profile --plot under a regular file",
         lambda root, fx: (root / "f").write_text("x") and ["profile", "--plot", root / "f" / "mem.png"],
         check=_shows("is a file, not a folder")),
    Case("output", f"{TAG} profile --plot is a directory",
         lambda root, fx: (root / "d.png").mkdir() or ["profile", "--plot", root / "d.png"],
         check=_shows("is a directory")),
    Case("output", f"{TAG} profile --plot unwritable (EACCES)",
         lambda root, fx: (["profile", "--plot", root / "ro" / "mem.png"], _site(root, DENY_PROBE)),
         check=lambda root, out: None if not (root / "ro" / "mem.png").exists() else "plot written"),
    Case("output", f"{TAG} profile --plot without an image suffix",
         lambda root, fx: ["profile", "--plot", root / "mem.txt"], check=_shows("image suffix")),
    # tasks and checkpoints
    Case("eval input", f"{TAG} eval: unknown task", lambda root, fx: ["eval", fx.hf(), "--tasks", "no_such_task_x"],
         check=_shows("unknown task(s) no_such_task_x")),
    Case("eval input", f"{TAG} eval: --tasks names nothing", lambda root, fx: ["eval", fx.hf(), "--tasks", " , "],
         check=_shows("names no task")),
    Case("eval input", f"{TAG} eval: --include-path missing",
         lambda root, fx: ["eval", fx.hf(), "--tasks", "mine", "--include-path", root / "nope"],
         check=_shows("does not exist")),
    Case("eval input", f"{TAG} eval: a regular file as checkpoint",
         lambda root, fx: (root / "ckpt.bin").write_bytes(b"x") and ["eval", root / "ckpt.bin", *TASK],
         check=_shows("is not a directory")),
    Case("eval input", f"{TAG} eval: --iteration on an HF model",
         lambda root, fx: ["eval", fx.hf(), *TASK, "--iteration", "2"], check=_shows("needs a Megatron checkpoint")),
    Case("eval input", f"{TAG} eval: --iteration the run does not have",
         lambda root, fx: ["eval", fx.run(), *TASK, "--iteration", "99"], check=_shows("has no iteration 99")),
    Case("first hour", f"{TAG} eval a run's checkpoints/iter_N directory", _iteration_dir, expect_ok=True,
         check=_shows("qlm_demo_mc: acc", stream="stdout")),
    # missing optional packages
    Case("first hour", f"{TAG} eval without lm-eval installed",
         lambda root, fx: (["eval", fx.hf(), *TASK], _site(root, BLOCK.format(name="lm_eval"))),
         check=_shows('pip install -e ".[eval]"')),
    Case("first hour", f"{TAG} eval --backend hf without accelerate",
         lambda root, fx: (["eval", fx.hf(), *TASK, "--backend", "hf"], _site(root, BLOCK.format(name="accelerate"))),
         check=_shows("accelerate", ".[eval]")),
]
