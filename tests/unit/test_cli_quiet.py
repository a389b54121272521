"""The CLI quietens what optional libraries log on import (torchao's and bitsandbytes' GPU-only
kernels failing to load on a CPU) through the loggers' levels, unless --verbose."""

import logging
import subprocess
import sys


def test_optional_library_import_noise_is_quietened():
    from hone.cli import _prepare_libraries

    _prepare_libraries(verbose=False)
    for name in ("torchao", "bitsandbytes", "torch.utils._pytree"):
        assert logging.getLogger(name).getEffectiveLevel() >= logging.ERROR, name


def test_plan_prints_no_library_noise():
    proc = subprocess.run(
        [sys.executable, "-m", "hone.cli", "plan", "examples/quickstart.yml"], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    assert "Failed to load" not in proc.stderr and "register_constant" not in proc.stderr
