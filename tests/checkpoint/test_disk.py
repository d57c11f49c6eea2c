"""qlm_core/disk.py, the ground floor: a failed write leaves the old file and no temporary, a replaced folder is set
aside until the new one is in place, dead writers are told from live ones, and the errno table names the faults."""

from __future__ import annotations

import errno
import os
import subprocess
import sys

import pytest

from qlm_core.disk import pid_alive, replace_atomically, replace_folder, write_fault, write_text_atomic


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "summary.json"
    write_text_atomic(path, "old")

    def dies(temporary):
        temporary.write_text("half")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError):
        replace_atomically(path, dies)
    assert path.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]


def test_keep_suffix_lets_a_writer_pick_the_format_by_name(tmp_path):
    import numpy as np

    path = tmp_path / "order.npz"
    replace_atomically(path, lambda temporary: np.savez(temporary, a=np.arange(3)), keep_suffix=True)
    with np.load(path) as stored:
        assert stored["a"].tolist() == [0, 1, 2]
    assert [p.name for p in tmp_path.iterdir()] == ["order.npz"]


def test_a_folder_is_replaced_whole_and_put_back_when_the_rename_fails(tmp_path, monkeypatch):
    out, new = tmp_path / "out", tmp_path / "new"
    out.mkdir(), new.mkdir()
    (out / "a").write_text("old"), (new / "a").write_text("new")
    replace_folder(new, out)
    assert (out / "a").read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["out"]

    again = tmp_path / "again"
    again.mkdir()
    real = os.replace

    def second_rename_fails(src, dst):
        if str(src) == str(again):
            raise OSError(errno.EIO, "Input/output error")
        return real(src, dst)

    monkeypatch.setattr(os, "replace", second_rename_fails)
    with pytest.raises(OSError):
        replace_folder(again, out)
    assert (out / "a").read_text() == "new"


def test_a_dead_writer_is_told_from_a_live_one():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert pid_alive(os.getpid()) and not pid_alive(child.pid) and not pid_alive(2**40)


@pytest.mark.parametrize("code,fault", [(errno.ENOSPC, "no_space"), (errno.EACCES, "denied"),
                                        (errno.ENOTDIR, "in_the_way"), (errno.ENOENT, None)])
def test_the_errno_table_names_the_fault(code, fault):
    assert write_fault(OSError(code, os.strerror(code))) == fault
    assert write_fault(ValueError("not an OSError")) is None
