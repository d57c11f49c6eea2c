"""The code's structure as a spec: the import floors in pyproject.toml hold."""

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_import_floors_hold():
    """No module imports from a higher floor and no package imports form a cycle (import-linter's contracts in
    pyproject.toml)."""
    exe = shutil.which("lint-imports")
    if exe is None:
        pytest.fail("lint-imports is missing: pip install -e '.[test]'")
    proc = subprocess.run([exe, "--no-cache"], cwd=ROOT, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


def test_ruff_is_clean():
    """`ruff check .` with the pyproject configuration (E, F, W, I, B, UP; line length 120) finds nothing."""
    exe = shutil.which("ruff")
    if exe is None:
        pytest.fail("ruff is missing: pip install -e '.[test]'")
    proc = subprocess.run([exe, "check", "--no-cache", "."], cwd=ROOT, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


HEAVY = ("torch._dynamo", "torch.distributed.checkpoint", "torch.distributed.pipelining", "torch.distributed.fsdp")


@pytest.mark.parametrize("module", ["qlm_cli.main", "qlm_core.train.trainer", "qlm_core.checkpoint.convert.hf_megatron",
                                    "qlm_core.eval.runner", "qlm_core.profile.search"])
def test_start_up_imports_no_machinery_it_may_not_use(module):
    """DCP, torch's pipelining (both bring torch._dynamo) and FSDP cost ~2 s per process, paid by every torchrun
    worker and CLI call: they are imported where a torch_dist checkpoint, pp > 1 or ZeRO 3 needs them, not before."""
    import sys

    code = f"import sys, {module}; print([m for m in {HEAVY!r} if m in sys.modules])"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]", proc.stdout


def test_disk_helpers_live_on_the_ground_floor_only():
    """Process liveness and rename-into-place are written once, in qlm_core/disk.py: no other module probes a pid
    with os.kill(pid, 0) or builds its own `.tmp` sibling by hand."""
    import re

    probe = re.compile(r"os\.kill\([^,]+,\s*0\)")
    by_hand = re.compile(r"with_name\([^)]*\.tmp")
    offenders = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "qlm_core").rglob("*.py")) + sorted(
        (ROOT / "qlm_cli").rglob("*.py")) if p.name != "disk.py" and (probe.search(p.read_text())
                                                                       or by_hand.search(p.read_text()))]
    assert offenders == []


def test_no_module_cycle_inside_the_code():
    """No module reaches itself through imports (lazy imports inside functions included): each package reads
    bottom-up (grimp, import-linter's graph)."""
    import grimp

    graph = grimp.build_graph("qlm_core", "qlm_cli", cache_dir=None)
    edges = {m: graph.find_modules_directly_imported_by(m) for m in graph.modules}
    index, low, on_stack, stack, cycles = {}, {}, set(), [], []

    def visit(module):  # Tarjan's strongly connected components
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for other in edges.get(module, ()):
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in on_stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    import sys

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10_000))
    try:
        for module in sorted(edges):
            if module not in index:
                visit(module)
    finally:
        sys.setrecursionlimit(limit)
    assert cycles == []


@pytest.mark.slow
def test_every_module_imports_first():
    """Each module imported first in a fresh set of qlm modules (third-party ones kept, for speed): a cycle through
    a package's __init__, which the graph above does not see, fails here as the ImportError a user would meet."""
    import sys

    code = """
import importlib, pkgutil, sys
import qlm_cli, qlm_core
names = sorted({m.name for pkg in (qlm_core, qlm_cli) for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + ".")})
failed = []
for name in names:
    for loaded in [m for m in sys.modules if m.split(".")[0] in ("qlm_core", "qlm_cli")]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except ImportError as exc:
        failed.append(f"{name}: {exc}")
print("\\n".join(failed))
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=False)
    assert proc.returncode == 0 and proc.stdout.strip() == "", proc.stdout[-4000:] + proc.stderr[-2000:]


def test_cli_commands_stay_thin():
    """The verbs keep their policy in qlm_core: past the options it declares, no function of qlm_cli runs more
    than 40 lines (options -> one or two calls -> render, as `qlm eval` does)."""
    import ast

    long = []
    for path in sorted((ROOT / "qlm_cli").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef):
                continue
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                body = body[1:]  # the docstring
            if body and body[-1].end_lineno - body[0].lineno + 1 > 40:
                long.append(f"{path.relative_to(ROOT)}:{node.name} ({body[-1].end_lineno - body[0].lineno + 1})")
    assert not long, f"CLI functions doing the core's work: {', '.join(long)}"
