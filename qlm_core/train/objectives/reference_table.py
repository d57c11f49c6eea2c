"""preference.precompute_reference: the reference log-probs of every pair, computed once with the starting weights
and kept beside the tokenised data, then read by every epoch and every resume instead of a reference forward per
step (TRL's precompute_ref_log_probs).

The table of a dataset is [pairs, 2] float64 (chosen, rejected) by the pair's position in the run's dataset. It is
computed by the engine right after it is built from the model's source, before a checkpoint is loaded, so a resumed
run whose table went missing recomputes the same numbers. The file is named by a hash of what the numbers depend on
(the model source, the data files and their tokenisation); it is written to a temporary name and renamed.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from qlm_core.config import Recipe
from qlm_core.data.loader import GlobalBatchSampler
from qlm_core.data.preference import PositionedPairs, collate_pairs, pair_rows
from qlm_core.disk import TEMPORARY_MARK, pid_alive, replace_atomically
from qlm_core.errors import QlmError
from qlm_core.parallel.comm import all_reduce
from qlm_core.train.engine import Batch, Engine
from qlm_core.train.sources import ModelSource


def _file_stamp(name: str) -> list:
    """A file's or a directory's identity: path, size and mtime of it or of every file below it (a run directory
    that saved another checkpoint, an HF directory whose weights were replaced: another stamp)."""
    path = Path(name)
    if not path.exists():
        return [name]
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    return [str(path.resolve())] + [[str(f.relative_to(path)) if path.is_dir() else "", f.stat().st_size,
                                     f.stat().st_mtime_ns] for f in files]


def table_path(recipe: Recipe, cache_dir: Path, source: ModelSource | None = None) -> Path:
    """The file of this recipe's tables: named by the model and data it depends on. `source`: the model as the
    run resolved it; the directory its weights were read from (one iteration of a run, load_pin.py) and its
    tokenizer are stamped instead of all of model.load (a run directory that saved more checkpoints since still
    names the same table)."""
    load = str(source.weights_dir) if source is not None and source.weights_dir is not None else recipe.model.load
    tokenizer = recipe.model.tokenizer or (str(source.tokenizer_dir) if source is not None and source.tokenizer_dir
                                           else "")
    key = {
        "model": [_file_stamp(recipe.model.spec), _file_stamp(load) if load else None,
                  _file_stamp(tokenizer) if tokenizer else None, recipe.model.dtype],
        "data": {k: v for k, v in asdict(recipe.data).items() if k not in ("workers", "cache_dir")},
        "files": [_file_stamp(name) for name in [*recipe.data.train, *recipe.data.valid]],
        "truncation": [recipe.preference.max_length, recipe.preference.max_prompt_length,
                       recipe.preference.truncation_mode],
        "seed": recipe.train.seed,
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return Path(cache_dir) / f"reference-logps-{digest}.safetensors"


def compute_table(engine: Engine, dataset, pairs_per_global: int, pairs_per_micro: int) -> np.ndarray:
    """[len(dataset), 2] reference log-probs; every rank calls it and every rank gets the table."""
    g = engine.grid
    n = len(dataset)
    table = torch.zeros(n, 2, dtype=torch.float64, device=g.device)
    have = torch.zeros(n, dtype=torch.float64, device=g.device)
    sampler = GlobalBatchSampler(n, pairs_per_global, g.dp_rank, g.sizes.dp)
    positioned = PositionedPairs(dataset)
    holds = g.is_last_stage and g.tp_rank == 0 and g.cp_rank == 0  # one copy of each number
    for _, positions in zip(range(math.ceil(n / pairs_per_global)), sampler, strict=False):
        input_ids, labels, _ = collate_pairs([positioned[i] for i in positions], pairs_per_micro)
        rows = engine.objective.reference_logps(Batch(input_ids, labels)).double()
        if holds:
            for k, position in enumerate(positions):
                chosen, rejected = pair_rows(k, pairs_per_micro)
                table[position] = torch.stack([rows[chosen], rows[rejected]])
                have[position] = 1.0
    world = dist.group.WORLD if dist.is_initialized() else None  # None: one process, nothing to reduce
    all_reduce(table, world)  # a wrapped last batch may hold a pair twice: `have` counts the copies
    all_reduce(have, world)
    return (table / have.clamp(min=1.0)[:, None]).cpu().numpy()


def load_or_compute(engine: Engine, path: Path, datasets: dict, pairs_per_global: int, pairs_per_micro: int,
                    is_rank0: bool) -> dict[str, np.ndarray]:
    """{name: table} for each non-None dataset of `datasets`: read from `path` when it holds them all with the right
    lengths, else computed (every rank) and written by rank 0."""
    from safetensors.numpy import save_file

    wanted = {name: ds for name, ds in datasets.items() if ds is not None}
    stored = read_table(path) if is_rank0 or not dist.is_initialized() else {}
    usable = [all(name in stored and stored[name].shape == (len(ds), 2) for name, ds in wanted.items())]
    if dist.is_initialized() and dist.get_world_size() > 1:  # rank 0's look decides for every rank (no rank may
        dist.broadcast_object_list(usable, src=0)  # read while others compute: the computation is collective)
    if usable[0]:
        stored = stored or read_table(path)  # the other ranks read what rank 0 found whole
        if all(name in stored for name in wanted):
            return {name: stored[name] for name in wanted}
        raise QlmError(f"the precomputed reference table {path} changed while the run started",
                       "start the run again (and leave the cache alone while it starts)")
    tables = {name: compute_table(engine, ds, pairs_per_global, pairs_per_micro) for name, ds in wanted.items()}
    if is_rank0:
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_dead_temporaries(path)
        replace_atomically(path, lambda temporary: save_file(tables, str(temporary),
                                                             metadata={DIGEST_KEY: _digest(tables)}))
    return tables


def remove_dead_temporaries(path: Path, min_age_s: float = 60.0):
    """The temporaries of a table's writer that was killed (kill -9, a node lost) before its rename: removed when
    their process is gone and they are a minute old (a live writer on another node shares no pids with us)."""
    import time

    for temporary in path.parent.glob(f".{path.name}{TEMPORARY_MARK}*"):
        pid = temporary.name.rsplit("-", 1)[-1]
        try:
            stale = time.time() - temporary.stat().st_mtime >= min_age_s
        except OSError:
            continue
        if pid.isdigit() and not pid_alive(int(pid)) and stale:
            temporary.unlink(missing_ok=True)


DIGEST_KEY = "qlm_sha256"  # the tables' bytes, checked on reading: a damaged file is recomputed, never trusted


def _digest(tables: dict[str, np.ndarray]) -> str:
    digest = hashlib.sha256()
    for name in sorted(tables):
        digest.update(name.encode())
        digest.update(np.ascontiguousarray(tables[name], dtype=np.float64).tobytes())
    return digest.hexdigest()


def read_table(path: Path) -> dict[str, np.ndarray]:
    """The stored tables, or {} when there are none or the file is damaged (cut short, overwritten, not what it
    claims): a damaged table is said in one line and recomputed."""
    from safetensors import SafetensorError, safe_open

    if path.exists() and not path.is_file():
        raise QlmError(f"the precomputed reference table {path} is a directory, not a file",
                       "remove it (the table is computed again)")
    if not path.is_file():
        return {}
    try:
        with safe_open(str(path), framework="np") as handle:
            digest = (handle.metadata() or {}).get(DIGEST_KEY)
            tables = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118 (not a dict)
    except (SafetensorError, OSError, ValueError) as exc:
        problem = " ".join(str(exc).split())[:120] or type(exc).__name__
    else:
        if digest is not None and digest == _digest(tables):
            return tables
        problem = "its contents do not match the checksum written with them" if digest else "it has no checksum"
    print(f"warning: the precomputed reference table {path} is damaged ({problem}); computing it again",
          file=sys.stderr, flush=True)
    return {}
