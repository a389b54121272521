"""The runner of interpreted kernel checks (tests/interpreted.py): a check's RESULT comes back,
a check that raises, exits non-zero, kills its process or runs past its timeout fails the
calling test with what happened, and the next check still runs (in a new process where the
old one died). No triton needed: the checks here are plain Python."""

import pytest
from interpreted import run_interpreted


def test_a_check_reports_its_result_and_sees_the_interpreter_flag():
    program = "import os, json\nprint('noise')\nprint('RESULT ' + json.dumps({'flag': os.environ['TRITON_INTERPRET']}))"
    assert run_interpreted(["-c", program]) == {"flag": "1"}


def test_a_check_that_raises_fails_with_its_traceback():
    with pytest.raises(AssertionError, match="ValueError: the kernel disagrees"):
        run_interpreted(["-c", "raise ValueError('the kernel disagrees')"])
    assert run_interpreted(["-c", "print('RESULT 7')"]) == 7


def test_a_check_that_exits_non_zero_fails():
    with pytest.raises(AssertionError, match="exited with 3"):
        run_interpreted(["-c", "import sys; sys.exit(3)"])


def test_a_check_that_kills_its_process_fails_and_the_next_one_runs():
    with pytest.raises(AssertionError, match="(?s)ended .code 5.*dying words"):
        run_interpreted(["-c", "import os, sys; sys.stderr.write('dying words\\n'); sys.stderr.flush(); os._exit(5)"])
    assert run_interpreted(["-c", "print('RESULT [1, 2]')"]) == [1, 2]


def test_a_check_past_its_timeout_fails_and_the_next_one_runs():
    with pytest.raises(AssertionError, match="ran past 1 s"):
        run_interpreted(["-c", "import time; time.sleep(30)"], timeout_s=1)
    assert run_interpreted(["-c", "print('RESULT true')"]) is True


def test_a_check_without_a_result_line_fails():
    with pytest.raises(AssertionError, match="no 'RESULT ' line"):
        run_interpreted(["-c", "print('done')"])
