"""The Inductor allowlist against the installed torch, how options reach ``torch.compile``
(scoped, never global), and where Inductor's caches go."""

import os
from pathlib import Path

import pytest
import torch
import torch._inductor.config as inductor_config
from torch._inductor.custom_graph_pass import CustomGraphPass

from hone.config.performance import INDUCTOR_OPTIONS, PerformanceConfig
from hone.transforms.inductor import CACHE_ENV, compile_options, configure_cache_dir, installed_defaults, read_option


@pytest.mark.parametrize("key", list(INDUCTOR_OPTIONS))
def test_every_allowlisted_key_exists_on_the_installed_torch_with_its_type(key):
    """A rename upstream fails here, loudly, instead of in a user's run. Dotted keys are walked:
    ``triton.cudagraphs`` is ``config.triton.cudagraphs``."""
    parent = inductor_config
    for part in key.split(".")[:-1]:
        parent = getattr(parent, part)
        assert not isinstance(parent, (bool, int, float, str)), f"{part} of {key} is a value, not a config object"
    value = read_option(key)
    assert type(value) is INDUCTOR_OPTIONS[key], (key, value)


@pytest.mark.parametrize("key", list(INDUCTOR_OPTIONS))
def test_torch_compile_accepts_every_allowlisted_key_as_an_option(key):
    """``torch.compile`` checks ``options`` when called (unknown key or wrong type raise)."""
    flipped = not read_option(key)
    torch.compile(torch.nn.Linear(2, 2), backend="inductor", options={key: flipped})


def test_an_unknown_key_is_refused_by_torch_compile_too():
    with pytest.raises(RuntimeError, match="Unexpected optimization option"):
        torch.compile(torch.nn.Linear(2, 2), backend="inductor", options={"no_such_option": True})


def test_installed_defaults_cover_the_allowlist():
    defaults = installed_defaults()
    assert list(defaults) == list(INDUCTOR_OPTIONS) and all(isinstance(v, bool) for v in defaults.values())


def test_mode_options_merge_under_the_users_options():
    perf = PerformanceConfig(
        torch_compile=True, torch_compile_mode="max-autotune", torch_compile_options={"triton.cudagraphs": False}
    )
    options = compile_options(perf)
    assert options["max_autotune"] is True and options["coordinate_descent_tuning"] is True
    assert options["triton.cudagraphs"] is False  # the user's value wins over the mode's
    assert compile_options(PerformanceConfig(torch_compile=True)) is None
    assert compile_options(PerformanceConfig(torch_compile=True, torch_compile_backend="eager")) is None


class _Recorder(CustomGraphPass):
    """A post-grad pass that only records the value Inductor sees while compiling each graph."""

    def __init__(self) -> None:
        self.seen: list[bool] = []

    def __call__(self, graph) -> None:
        self.seen.append(inductor_config.coordinate_descent_tuning)

    def uuid(self):
        return None  # no caching: every compilation runs the pass


class _Block(torch.nn.Module):
    """User code (Dynamo does not trace a top-level frame that lives inside torch.nn)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.tanh(self.linear(x)) * 2


def test_options_apply_to_the_forward_and_the_lazy_backward_compile_only():
    """The option is on while Inductor compiles the forward *and* the backward (compiled later,
    at the first backward call) and off everywhere else."""
    assert inductor_config.coordinate_descent_tuning is False
    recorder = _Recorder()
    module = _Block()
    with inductor_config.patch(post_grad_custom_post_pass=recorder, fx_graph_cache=False):
        module.compile(backend="inductor", options={"coordinate_descent_tuning": True})
        out = module(torch.randn(4, 8, requires_grad=True)).sum()
        assert inductor_config.coordinate_descent_tuning is False  # between forward and backward
        out.backward()
    assert recorder.seen == [True, True]  # forward graph, backward graph
    assert inductor_config.coordinate_descent_tuning is False


def test_cache_dir_defaults_to_a_persistent_per_user_directory(monkeypatch, tmp_path):
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir as torch_default

    monkeypatch.setenv("HONE_CACHE_DIR", str(tmp_path / "hone"))
    monkeypatch.setenv(CACHE_ENV, torch_default())  # what importing torch._dynamo leaves there
    path, chosen = configure_cache_dir()
    assert chosen and path == tmp_path / "hone" / "inductor" and path.is_dir()
    assert os.environ[CACHE_ENV] == str(path)


def test_cache_dir_chosen_by_the_user_is_kept(monkeypatch, tmp_path):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "mine"))
    path, chosen = configure_cache_dir()
    assert not chosen and path == Path(tmp_path / "mine") and os.environ[CACHE_ENV] == str(tmp_path / "mine")


def test_bench_rows_get_a_cold_or_a_shared_inductor_cache(tmp_path):
    from hone.bench.spec import Condition
    from hone.bench.worker import compile_cache_dir

    spec_file = tmp_path / "spec.json"
    cold_a = compile_cache_dir(Condition(name="a"), spec_file)
    cold_b = compile_cache_dir(Condition(name="b"), spec_file)
    assert cold_a != cold_b and not any(cold_a.iterdir())
    shared = [compile_cache_dir(Condition(name=n, compile_cache="shared"), spec_file) for n in "cd"]
    assert shared[0] == shared[1] == tmp_path / "inductor-shared" and shared[0].is_dir()


def test_bench_rows_keep_triton_kernels_in_their_compile_cache(monkeypatch, tmp_path):
    from hone.bench.worker import use_compile_cache

    monkeypatch.setenv("TRITON_CACHE_DIR", "/somewhere/else")
    monkeypatch.setenv(CACHE_ENV, "/somewhere/else")
    use_compile_cache(tmp_path)
    assert os.environ[CACHE_ENV] == str(tmp_path)
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "triton")
