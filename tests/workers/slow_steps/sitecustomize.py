"""Put on PYTHONPATH by tests/train/test_train_signals.py, so that every process of a `qlm train` launch runs this at
start-up. With QLM_TEST_STEP_SECONDS set, every training step of every rank takes at least that long, so that a
signal sent after the first step surely lands before the last one, however fast the machine."""

import os

if os.environ.get("QLM_TEST_STEP_SECONDS"):
    import time

    from qlm_core.train.trainer import Trainer

    _real = Trainer._lr

    def _slow(trainer, step):
        time.sleep(float(os.environ["QLM_TEST_STEP_SECONDS"]))
        return _real(trainer, step)

    Trainer._lr = _slow
