"""`checkpoint.async_save`: the training thread copies a checkpoint to host memory (reused, pinned buffers on an
accelerator) and goes on training; one background thread writes the files into the staging directory, and once
every rank has written its own, rank 0 renames the directory into place, replaces the latest pointer and prunes, as
a synchronous save does (checkpointing.py). A kill at any moment of the background write leaves the checkpoints
before it loadable and `latest` naming the last complete one.

The next save, the end of the run and its exits (a signal's stop, exit_interval: both end through the same final
save) wait for the pending write first; a write that failed is raised there, on every rank at once: a write fault
as the same one-line QlmError a synchronous save raises, any other exception (a bug) as itself on its rank.

The background thread's collectives (torch_dist's DCP planning, the ranks' agreement before the rename) run on a
gloo group of their own, made once by every rank, never on a group the training's collectives use. On CUDA the
snapshot is copied to pinned memory and a CPU group is what DCP's background saves need (gloo beside nccl)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch.distributed as dist

from qlm_core.checkpoint.io.background import BackgroundWriter
from qlm_core.checkpoint.io.host_buffers import HostBuffers
from qlm_core.train.checkpointing import (
    CheckpointWrite,
    TrainState,
    first_error,
    first_error_in,
    raise_write_failure,
    save_checkpoint,
    snapshot_checkpoint,
)
from qlm_core.train.engine import Engine


def _write_in_background(write: CheckpointWrite, keep_last: int, group) -> tuple[str | None, BaseException | None]:
    """On the writer thread: this rank's files, the ranks' agreement over `group`, rank 0's rename. Returns the
    agreed error text (None: in place) and this rank's exception when it was not a write fault; raises nothing,
    so that no rank leaves the agreement out."""
    failure = None
    try:
        error = write.write_files(process_group=group)
    except BaseException as exc:  # noqa: BLE001 - re-raised on the training thread by CheckpointSaver.wait
        failure, error = exc, f"{write.target}: {type(exc).__name__}: {exc}"
    error = first_error_in(error, group)
    if error is not None:
        if write.rank == 0:
            shutil.rmtree(write.staging, ignore_errors=True)
    elif write.rank == 0:
        error = write.publish(keep_last)
    return error, failure


class CheckpointSaver:
    """save() synchronously, or with `asynchronous` as described above; wait() before anything that needs the
    checkpoint complete, close() at the end (every rank calls each at the same point)."""

    def __init__(self, asynchronous: bool):
        self.asynchronous = asynchronous
        self._writer = BackgroundWriter("qlm-checkpoint") if asynchronous else None
        self._host = HostBuffers()
        self._group = None  # made at the first save, by every rank (new_group is a collective)
        self._group_made = False
        self._pending: CheckpointWrite | None = None

    def save(self, root: Path, engine: Engine, train_state: TrainState, keep_last: int, extra_args: dict, fmt: str):
        if not self.asynchronous:
            save_checkpoint(root, engine, train_state, keep_last, extra_args, fmt)
            return
        self.wait()  # a second save waits for the first; the host buffers are free again after it
        if not self._group_made:
            if dist.is_initialized() and dist.get_world_size() > 1:
                self._group = dist.new_group(backend="gloo")
            self._group_made = True
        write = snapshot_checkpoint(root, engine, train_state, extra_args, fmt, self._host)
        self._writer.submit(_write_in_background, write, keep_last, self._group)
        self._pending = write

    def wait(self):
        """The pending write done and in place; its failure raised here (on every rank)."""
        write, self._pending = self._pending, None
        if write is None:
            return
        error, failure = self._writer.wait()
        error = first_error(error)  # the training thread's group: every rank reaches this point together
        if failure is not None:
            raise failure
        raise_write_failure(error, write.root, write.staging, write.iteration, write.rank)

    def close(self):
        try:
            self.wait()
        finally:
            if self._writer is not None:
                self._writer.close()
