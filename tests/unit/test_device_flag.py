"""``--device`` mistakes in every command that takes the flag: one line naming the flag, the value and
what this machine has, exit 2, no traceback, before anything loads (issue 30, item 4)."""

import pytest
import torch

from hone.cli import main
from hone.train.device import DeviceError, checked_device

#: Every command that takes a free-form --device (hone plan's is a choice of cpu/cuda, checked by argparse).
COMMANDS = (["generate", "RUN", "--prompt", "hi"], ["chat", "RUN"])


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c[0])
@pytest.mark.parametrize("value", ["gpu", "cuda:99", "meta", "cuda:x"])
def test_a_bad_device_is_one_line_and_exit_2(tmp_path, capsys, command, value):
    # the run directory does not exist: the device is checked first, so its message is the one shown
    argv = [str(tmp_path / "run") if a == "RUN" else a for a in command]
    assert main([*argv, "--device", value]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"error: --device '{value}'") and "cpu" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a CUDA GPU")
@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c[0])
def test_cuda_on_a_machine_without_a_gpu(tmp_path, capsys, command):
    argv = [str(tmp_path / "run") if a == "RUN" else a for a in command]
    assert main([*argv, "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert err == "error: --device 'cuda': this machine has no CUDA GPU that torch can use: use cpu\n"


def test_checked_device_against_a_gpu_count():
    assert checked_device("cuda:1", cuda_count=2) == torch.device("cuda", 1)
    assert checked_device("cuda", cuda_count=1) == torch.device("cuda")
    assert checked_device("cpu", cuda_count=0) == torch.device("cpu")
    with pytest.raises(DeviceError, match=r"--device 'cuda:3': this machine has 2 CUDA GPU\(s\).*cpu, cuda, cuda:0, cuda:1$"):
        checked_device("cuda:3", cuda_count=2)
    with pytest.raises(DeviceError, match="^--device 'gpu' is not a device hone runs on: use one of cpu, cuda, cuda:0$"):
        checked_device("gpu", cuda_count=1)
