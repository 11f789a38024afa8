"""Test-only fault injection in real client processes, kept out of the product.

``tests/conftest.child_env`` puts this folder first on ``PYTHONPATH`` when a test passes a
``FEDMITR_TEST_*`` variable, so the interpreter of every process of that test runs it at start:
``FEDMITR_TEST_STALL_RANK=r`` makes client process r hang before its upload (for
``FEDMITR_TEST_STALL_S`` seconds, default an hour); ``FEDMITR_TEST_NAN_RANK=r`` puts a NaN in its
uploaded weights. Used by ``tests/test_robust_*.py``.
"""
import os

if os.environ.get("FEDMITR_TEST_NAN_RANK") or os.environ.get("FEDMITR_TEST_STALL_RANK"):
    import functools
    import logging
    import sys
    import time

    from fedml_fedmitr.fedml_adapter import trainer as _trainer

    _log = logging.getLogger("fedml_fedmitr")
    _original_train = _trainer.FedMITRClientTrainer.train

    def _inject(args, uploads):
        rank = str(getattr(args, "rank", ""))
        if os.environ.get("FEDMITR_TEST_NAN_RANK") == rank:
            for payload in uploads:
                key = next(k for k, v in payload["state_dict"].items() if v.is_floating_point())
                payload["state_dict"][key].view(-1)[0] = float("nan")
            _log.warning("test hook: client process %s uploads a NaN weight", rank)
        if os.environ.get("FEDMITR_TEST_STALL_RANK") == rank:
            seconds = float(os.environ.get("FEDMITR_TEST_STALL_S", "3600"))
            _log.warning("test hook: client process %s stalls for %.0f s before its upload", rank, seconds)
            stream = sys.__stderr__
            type(stream).write(stream, f"fedml_fedmitr: test hook: client process {rank} stalls before its upload\n")
            stream.flush()
            time.sleep(seconds)

    @functools.wraps(_original_train)
    def _train(self, train_data, device, args):
        result = _original_train(self, train_data, device, args)
        _inject(self.args, self.uploads)
        return result

    _trainer.FedMITRClientTrainer.train = _train
