"""Put on PYTHONPATH by tests/train/test_dpo_parallel.py: with QLM_TEST_KILL_IN_TABLE set, the process that writes the
precomputed reference table (rank 0) writes half of it under its temporary name and SIGKILLs itself, as a kill -9
or a lost node would stop it in the middle of the write."""

import os

if os.environ.get("QLM_TEST_KILL_IN_TABLE"):
    import signal

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
