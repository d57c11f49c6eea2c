"""Put on PYTHONPATH by tests/checkpoint/test_async_checkpoint.py, so that every process of a `qlm train` launch
(the launcher,
torchrun, each worker) runs this at start-up. With QLM_TEST_KILL_AT_SAVE=N set, the process of global rank
QLM_TEST_KILL_RANK SIGKILLs itself in the middle of its N-th checkpoint write (part of the bytes out) when that write
runs on a background thread; on the training thread (async_save not in effect) it leaves the file
QLM_TEST_MARKER and exits 3 instead."""

import os

if os.environ.get("QLM_TEST_KILL_AT_SAVE"):
    import signal
    import threading
    from pathlib import Path

    from qlm_core.train.checkpointing import CheckpointWrite

    _calls = {"n": 0}
    _real = CheckpointWrite.write_files

    def _dying(write, *args, **kwargs):
        _calls["n"] += 1
        if _calls["n"] == int(os.environ["QLM_TEST_KILL_AT_SAVE"]) and write.rank == int(
                os.environ["QLM_TEST_KILL_RANK"]):
            if threading.current_thread() is threading.main_thread():
                Path(os.environ["QLM_TEST_MARKER"]).write_text("written on the training thread")
                os._exit(3)
            target = write.target if write.legacy is not None else write.staging / write.name / "__0_0.distcp"
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(b"half a checkpoint")
            os.kill(os.getpid(), signal.SIGKILL)
        return _real(write, *args, **kwargs)

    CheckpointWrite.write_files = _dying
