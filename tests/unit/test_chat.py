"""``hone chat``: driven through stdin with a tiny chat run (built as in test_models_generate)."""

import io
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hone.errors import HoneError
from hone.export.chat import Conversation, TextOut, chat_loop, load_chat_model, render
from hone.testing import greedy_by_hand, save_tiny_model, tiny_tokenizer
from tests.unit.test_models_generate import make_run

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory, tokenizer):
    run = tmp_path_factory.mktemp("runs") / "chat"
    # LoRA's init and make_run's noise draw from the global generator: a seed whose model's
    # replies depend on the history (the first test checks that they do), whatever ran before
    torch.manual_seed(2)
    trained = make_run(run, tokenizer, {"preset": "tiny-qwen3"}, data_type="chat")
    return run, trained


def greedy_reply(model, tokenizer, messages, steps: int) -> str:
    """The reference: render the history with the template, decode argmax by hand."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return greedy_by_hand(model, tokenizer, text, steps, add_special_tokens=False)


class Recorder(io.StringIO):
    """An output stream that remembers each write (to see the reply arrive in pieces)."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[str] = []

    def write(self, text: str) -> int:
        self.writes.append(text)
        return super().write(text)


def run_chat(model, tok, setup, lines: str, **kwargs) -> Recorder:
    out = Recorder()
    assert chat_loop(model, tok, setup, io.StringIO(lines), out, max_new_tokens=8, **kwargs) == 0
    return out


def test_two_turns_reset_and_exit_stream_the_replies(chat_run, tokenizer):
    run, trained = chat_run
    model, tok, setup = load_chat_model(run, device="cpu")
    assert setup.style == "chat"
    out = run_chat(model, tok, setup, "hello there\nwhat next\n/reset\nwhat next\n/exit\nnever read\n")
    lines = out.getvalue().split("\n")

    first = greedy_reply(trained, tokenizer, [{"role": "user", "content": "hello there"}], 8)
    history = [
        {"role": "user", "content": "hello there"},
        {"role": "assistant", "content": first.strip()},
        {"role": "user", "content": "what next"},
    ]
    second = greedy_reply(trained, tokenizer, history, 8)
    fresh = greedy_reply(trained, tokenizer, [{"role": "user", "content": "what next"}], 8)
    assert second != fresh  # the history changes the reply, so the check below can fail
    assert out.getvalue() == f"{first}\n{second}\n(new conversation)\n{fresh}\n"
    assert len(lines) == 5
    # streamed: the first reply arrived in several writes, token by token
    assert len([w for w in out.writes if w and w in first]) >= 2


def test_end_of_input_exits_cleanly_and_blank_lines_are_skipped(chat_run):
    run, _ = chat_run
    model, tok, setup = load_chat_model(run, device="cpu")
    out = run_chat(model, tok, setup, "\n   \nhi")  # no trailing newline, then EOF
    assert out.getvalue().count("\n") == 1 and out.getvalue().strip()


def test_sampling_is_reproducible_by_seed(chat_run):
    run, _ = chat_run
    model, tok, setup = load_chat_model(run, device="cpu")
    kwargs = dict(temperature=1.5, top_p=1.0)
    a = run_chat(model, tok, setup, "hi\n", seed=1, **kwargs).getvalue()
    assert a == run_chat(model, tok, setup, "hi\n", seed=1, **kwargs).getvalue()
    assert a != run_chat(model, tok, setup, "hi\n", seed=2, **kwargs).getvalue()


def test_bad_settings_and_paths(chat_run, tmp_path):
    run, _ = chat_run
    model, tok, setup = load_chat_model(run, device="cpu")
    with pytest.raises(HoneError, match="temperature: -1"):
        chat_loop(model, tok, setup, io.StringIO(""), io.StringIO(), temperature=-1)
    with pytest.raises(HoneError, match="neither a run directory"):
        load_chat_model(tmp_path, device="cpu")
    with pytest.raises(HoneError, match="does not exist"):
        load_chat_model(tmp_path / "nope", device="cpu")


def test_system_message_and_render(tokenizer):
    conversation = Conversation(system="be brief", turns=[{"role": "user", "content": "x"}])
    from hone.export.load import PromptSetup

    text, add_special = render(tokenizer, PromptSetup("chat"), conversation)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "x"}]
    assert add_special is False and "be brief" in text
    assert text == tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    conversation.reset()
    assert conversation.messages() == [{"role": "system", "content": "be brief"}]


def test_streamer_waits_for_whole_characters(tokenizer):
    out = io.StringIO()
    streamer = TextOut(tokenizer, out)
    ids = tokenizer.encode("é ü", add_special_tokens=False)
    streamer.put(torch.tensor([[1, 2]]))  # the prompt: skipped
    for i in ids:
        streamer.put(torch.tensor([i]))
        assert "\ufffd" not in out.getvalue()
    streamer.end()
    assert out.getvalue() == tokenizer.decode(ids, skip_special_tokens=True)


def test_model_directory(tmp_path, tokenizer):
    base = save_tiny_model(tmp_path / "base", "tiny-llama", tokenizer, seed=3)
    tokenizer.save_pretrained(str(base))
    model, tok, setup = load_chat_model(base, device="cpu")
    assert setup.style == "chat"
    out = run_chat(model, tok, setup, "hi\n")
    assert out.getvalue() == greedy_reply(model, tok, [{"role": "user", "content": "hi"}], 8) + "\n"


def test_cli_through_stdin(chat_run):
    run, _ = chat_run
    result = subprocess.run(
        [sys.executable, "-m", "hone", "chat", str(run), "--device", "cpu", "--max-new-tokens", "4"],
        input="hello\n/reset\nhello\n",
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    first, marker, second, rest = result.stdout.split("\n")
    assert marker == "(new conversation)" and first == second and first and rest == ""


def test_an_unknown_command_lists_the_commands_and_is_not_sent(chat_run, tokenizer):
    run, trained = chat_run
    model, tok, setup = load_chat_model(run, device="cpu")
    out = run_chat(model, tok, setup, "/exti\n/help\nhello there\n//slash\n/ 2\n/exit\n")
    first = greedy_reply(trained, tokenizer, [{"role": "user", "content": "hello there"}], 8)
    lines = out.getvalue().split("\n")
    assert lines[0].startswith("unknown command '/exti' (nothing was sent to the model)") and "/reset" in lines[0]
    assert "/exit" in lines[1] and "/reset" in lines[1]
    # nothing of '/exti' reached the conversation: the first reply is that of a fresh chat
    assert lines[2] == first
    history = [
        {"role": "user", "content": "hello there"},
        {"role": "assistant", "content": first.strip()},
        {"role": "user", "content": "/slash"},  # '//' escapes a leading slash
    ]
    assert lines[3] == greedy_reply(trained, tokenizer, history, 8)
    assert len(lines) == 6 and lines[5] == ""  # '/ 2' is text: answered
