"""Multi-process tests on the CPU: 2 processes joined by the gloo backend.

Each test starts 2 processes: forked by :mod:`fsdp_harness` (``spawn``, ``run_worker``) or launched as
``python -m torch.distributed.run --standalone --nproc-per-node 2`` in a
subprocess with a timeout (:mod:`dist_launch`), running either ``dist_worker.py`` (the loop on
tiny fp32 models) or ``hone train`` itself. Every test here is marked ``distributed``.
"""

from pathlib import Path

import pytest
import torch.distributed as dist

HERE = Path(__file__).resolve().parent


def pytest_configure(config):
    config.addinivalue_line("markers", "distributed: starts several processes with torchrun (gloo, CPU)")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if HERE in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.distributed)
            if not (dist.is_available() and dist.is_gloo_available()):
                item.add_marker(pytest.mark.skip(reason="this PyTorch has no torch.distributed with gloo"))
