"""`decoderlm chat` with piped standard input: one message per line, each reply printed, the
history kept; replies equal transformers' greedy generate on the rendered conversation."""

import subprocess
import sys
from pathlib import Path

import pytest
import tiny_chat

transformers = pytest.importorskip("transformers")

chat_dir = tiny_chat.chat_dir  # the fixture
SRC = Path(__file__).resolve().parents[2] / "src"


def _chat(directory, stdin: str, *flags: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "decoderlm", "chat", "--hf", str(directory), *flags]
    env = {"PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    return subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=300, env=env)


def _greedy(hf_model, hf_tok, messages, max_new_tokens: int) -> str:
    return tiny_chat.hf_greedy_reply(hf_model, hf_tok, messages, max_new_tokens)[0]


def test_piped_messages_get_the_greedy_replies_with_history_reset_and_system(chat_dir):
    directory, hf_model = chat_dir
    hf_tok = transformers.AutoTokenizer.from_pretrained(directory)
    lines = ["Hello, how are you?", "What is two plus two?", "/reset", "/system Answer briefly."]
    stdin = "\n".join([*lines, "The capital?", "/exit", "ignored", ""])
    done = _chat(directory, stdin, "--temperature", "0", "--max-new-tokens", "8")
    assert done.returncode == 0, done.stderr
    history, expected = [], []
    for message in ["Hello, how are you?", "What is two plus two?"]:
        history.append({"role": "user", "content": message})
        expected.append(_greedy(hf_model, hf_tok, history, 8))
        history.append({"role": "assistant", "content": expected[-1]})
    system = [{"role": "system", "content": "Answer briefly."}]
    expected.append(
        _greedy(hf_model, hf_tok, system + [{"role": "user", "content": "The capital?"}], 8)
    )
    assert done.stdout == "".join(f"{reply}\n" for reply in expected)


def test_a_model_without_a_template_is_refused_in_one_line(chat_dir, tmp_path):
    import shutil

    directory, _ = chat_dir
    bare = tmp_path / "bare"
    shutil.copytree(directory, bare)
    config = bare / "tokenizer_config.json"
    config.write_text(config.read_text().replace('"chat_template"', '"unused_template"'))
    done = _chat(bare, "hi\n")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "decoderlm: error: this model has no chat template; give one with --chat-template FILE "
        "(a Jinja template), or use decoderlm sample"
    ]
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}\n{% endfor %}")
    done = _chat(bare, "hi\n", "--chat-template", str(template), "--max-new-tokens", "3")
    assert done.returncode == 0, done.stderr


def test_at_a_terminal_a_message_too_long_is_one_line_and_the_conversation_goes_on(
    chat_dir, monkeypatch, capsys
):
    # a message that cannot fit the context (128 positions) is refused in one line on stderr;
    # the history before it is kept, so the next reply is the one to the conversation without it
    from decoderlm.generation import chat as chat_module
    from decoderlm.options import ModelSource

    directory, hf_model = chat_dir
    hf_tok = transformers.AutoTokenizer.from_pretrained(directory)
    lines = iter(["Hello, how are you?", "Paris " * 200, "What is two plus two?"])

    def typed(prompt=""):
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    monkeypatch.setattr(chat_module.sys.stdin, "isatty", lambda: True, raising=False)
    monkeypatch.setattr("builtins.input", typed)
    assert chat_module.chat(ModelSource(hf=str(directory)), max_new_tokens=8, temperature=0) == 0
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and err.startswith("decoderlm: error: the message is ")
    history = [{"role": "user", "content": "Hello, how are you?"}]
    first = _greedy(hf_model, hf_tok, history, 8)
    history += [{"role": "assistant", "content": first},
                {"role": "user", "content": "What is two plus two?"}]  # fmt: skip
    second = _greedy(hf_model, hf_tok, history, 8)
    assert out.splitlines()[1:] == [first, second, ""]  # after the help line; "" at Ctrl-D


def test_only_the_word_system_sets_the_system_message():
    # "/system TEXT" is a command; a line that merely starts with those letters ("/systems
    # ...") is not one: it is refused, and the history it would have cleared stays
    from types import SimpleNamespace

    from decoderlm.errors import UserError
    from decoderlm.generation.chat import _command

    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    conversation = SimpleNamespace(system="Be kind.", turns=list(turns))
    with pytest.raises(UserError, match="^unknown command /systems; the commands are /reset"):
        _command("/systems thinking, explained", conversation)
    assert conversation.system == "Be kind." and conversation.turns == turns
    assert _command("/system\tAnswer briefly. ", conversation)
    assert conversation.system == "Answer briefly." and conversation.turns == []
    assert _command("/system", conversation) and conversation.system is None


def test_commands_say_what_they_did_and_a_mistyped_one_is_not_sent(capsys):
    # /reset and /system confirm themselves on stderr and /help prints the commands there
    # (standard output holds the replies alone); a line starting with "/" that is no command
    # (a typo of /reset, /sytem with its text) or a command that takes no text given some is
    # refused rather than sent to the model, unless the line starts with a space
    from types import SimpleNamespace

    from decoderlm.errors import UserError
    from decoderlm.generation.chat import HELP, _command

    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    conversation = SimpleNamespace(system=None, turns=list(turns))
    refusals = {
        "/rest": "unknown command /rest; the commands are /reset, /system TEXT, /help and /exit",
        "/sytem Be brief.": "unknown command /sytem;",
        "/reset the story": "/reset takes no text;",
        "/help me": "/help takes no text;",
        "/exit now": "/exit takes no text;",
    }
    for line, start in refusals.items():
        with pytest.raises(UserError) as refused:
            _command(line, conversation)
        assert str(refused.value).startswith(start), str(refused.value)
    assert conversation.turns == turns and conversation.system is None
    assert not _command(" /rest", conversation) and not _command("Hi /reset", conversation)
    assert _command("/help", conversation)
    assert capsys.readouterr() == ("", HELP + "\n")
    assert _command("/system Be brief.", conversation) and conversation.turns == []
    said = "decoderlm: system message set; the conversation starts again\n"
    assert capsys.readouterr() == ("", said)
    conversation.turns = list(turns)
    assert _command("/reset", conversation) and conversation.turns == []
    assert capsys.readouterr() == ("", "decoderlm: the conversation starts again\n")


def test_a_mistyped_command_in_piped_input_ends_the_program_in_one_line(chat_dir):
    directory, _ = chat_dir
    done = _chat(directory, "/rset\nHello\n", "--max-new-tokens", "3")
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().splitlines() == [
        "decoderlm: error: unknown command /rset; the commands are /reset, /system TEXT, /help "
        'and /exit (to send a line starting with "/" to the model, start it with a space)'
    ]
