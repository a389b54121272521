"""``hone.train.torchrun``: torchrun's launch with a one-line ending. A failed rank's launch ends with
the rank that failed first, how it ended and the matching exit code, not torchrun's traceback;
a signal to the launcher ends quietly with 128 + its number. torchrun's ``run`` is replaced by
a stand-in here (the 2-process launch is tests/distributed/test_launch.py's)."""

import signal

import pytest
import torch.distributed.run as torch_run
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from hone.train import torchrun


def _failed(**exitcodes: int) -> ChildFailedError:
    """rank N -> exit code, in order of failure (earlier keyword, earlier timestamp)."""
    failures = {}
    for order, (rank, code) in enumerate(exitcodes.items()):
        failure = ProcessFailure(local_rank=int(rank[1:]), pid=100 + order, exitcode=code, error_file="/nonexistent")
        failure.timestamp = 1_000 + order
        failures[int(rank[1:])] = failure
    return ChildFailedError("hone", failures)


def test_the_first_failed_rank_is_named_with_its_exit_code_and_the_others_after_it():
    assert torchrun.failure_line(1, 2, [1]) == "error: rank 1 failed first (exit code 2): its error is above"
    line = torchrun.failure_line(1, 1, [0, 1, 3])
    assert line == "error: rank 1 failed first (exit code 1); ranks 0, 3 stopped after it: its error is above"
    assert "rank 0 stopped after it" in torchrun.failure_line(1, 1, [1, 0])
    assert torchrun.exit_code(2) == 2 and torchrun.exit_code(1) == 1


def test_a_rank_killed_by_a_signal_is_named_with_the_signal():
    killed = torchrun.failure_line(0, -signal.SIGKILL, [0])
    assert killed.startswith("error: rank 0 was killed by SIGKILL before it could report an error")
    assert "run out of host memory" in killed  # what usually sends SIGKILL
    assert "memory" not in torchrun.failure_line(0, -signal.SIGSEGV, [0])
    assert "SIGSEGV" in torchrun.failure_line(0, -signal.SIGSEGV, [0])
    assert torchrun.exit_code(-signal.SIGKILL) == 137 and torchrun.exit_code(-signal.SIGTERM) == 143


@pytest.mark.parametrize(
    "raised, code, last",
    [
        (_failed(r1=2, r0=2), 2, "error: rank 1 failed first (exit code 2); rank 0 stopped after it: its error is above"),
        (_failed(r0=-9), 137, "error: rank 0 was killed by SIGKILL"),
        (SignalException("stopped", signal.SIGTERM), 143, None),
        (None, 0, None),
    ],
)
def test_main_runs_torchruns_launch_and_ends_in_one_line(monkeypatch, capsys, raised, code, last):
    seen = []

    def launch(args):
        seen.append(args)
        if raised is not None:
            raise raised

    monkeypatch.setattr(torch_run, "run", launch)
    assert torchrun.main(["--standalone", "--nproc-per-node=2", "-m", "hone", "train", "cfg.yml"]) == code
    args = seen[0]  # torchrun's own parser read the arguments
    assert args.standalone and args.nproc_per_node == "2" and args.training_script == "hone"
    assert args.training_script_args == ["train", "cfg.yml"]
    err = capsys.readouterr().err
    if last is None:
        assert err == ""
    else:
        assert err.strip().splitlines()[-1].startswith(last) and "Traceback" not in err
