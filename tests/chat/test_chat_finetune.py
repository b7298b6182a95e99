"""Fine-tuning on conversations (`decoderlm train --init-from MODEL --data chats.jsonl`): the
loss mask against transformers' own assistant-token mask, the four line shapes, bad lines named
by number, and a tiny chat model that learns a reply and then gives it in `decoderlm chat`."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import tiny_chat
import torch
import torch.nn.functional as F

from decoderlm.cli import main
from decoderlm.data.conversations import Conversations, encode_conversation, read_conversations
from decoderlm.errors import UserError
from decoderlm.evaluate import evaluate
from decoderlm.io.load import load_model_and_tokenizer
from decoderlm.tokenizers.chat_template import ChatTemplate

transformers = pytest.importorskip("transformers")

chat_dir = tiny_chat.chat_dir  # the fixture
SRC = Path(__file__).resolve().parents[2] / "src"

# tiny_chat's ChatML with transformers' generation markers around what an assistant turn
# trains on (its content and <|im_end|>): transformers then returns the assistant-token mask
GENERATION_CHATML = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are helpful.<|im_end|>\\n' }}{% endif %}"
    "{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\\n' }}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CONVERSATIONS = [
    [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "What is two plus two?"},
        {"role": "assistant", "content": "Four."},
    ],
    [  # no system message: the template writes its own
        {"role": "user", "content": "Hello, how are you?"},
        {"role": "assistant", "content": "I am fine, thank you."},
        {"role": "user", "content": "The capital of France?"},
        {"role": "assistant", "content": 'Paris. <html> & "quotes"'},
    ],
]


def _template(directory) -> ChatTemplate:
    _, tokenizer = load_model_and_tokenizer(str(directory))
    return ChatTemplate(tiny_chat.CHATML, tokenizer)


@pytest.mark.parametrize("k", range(len(CONVERSATIONS)))
def test_the_loss_mask_is_transformers_assistant_token_mask(chat_dir, k):
    """The tokens trained on are exactly those transformers marks as the assistant's (its
    content and end-of-turn token, from {% generation %} markers in the same template), and
    the ids are transformers' apply_chat_template ids."""
    directory, _ = chat_dir
    hf_tok = transformers.AutoTokenizer.from_pretrained(directory)
    out = hf_tok.apply_chat_template(
        CONVERSATIONS[k],
        chat_template=GENERATION_CHATML,
        return_dict=True,
        return_assistant_tokens_mask=True,
    )
    ids, trained = encode_conversation(_template(directory), CONVERSATIONS[k])
    assert ids == out["input_ids"]
    assert [int(t) for t in trained] == out["assistant_masks"]
    assert sum(trained) >= 3


def test_a_template_that_rewrites_earlier_turns_is_refused_naming_the_line(chat_dir, tmp_path):
    """A template whose rendering of a prefix is not a prefix of the whole conversation (here:
    it writes only the last two messages) leaves the replies' tokens unknown: refused."""
    directory, _ = chat_dir
    _, tokenizer = load_model_and_tokenizer(str(directory))
    last_two = (
        "{% for message in messages[-2:] %}"
        "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    path = tmp_path / "chats.jsonl"
    one_turn = CONVERSATIONS[0][1:]  # two messages: rendered whole
    lines = [json.dumps({"messages": c}) for c in (one_turn, CONVERSATIONS[1])]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(UserError, match=r"chats.jsonl line 2: .* not a prefix"):
        Conversations.encode(read_conversations(path), ChatTemplate(last_two, tokenizer), path)


def test_alpaca_prompt_completion_and_sharegpt_lines_are_user_and_assistant_turns(tmp_path):
    """Each of the other shapes becomes the messages it stands for."""
    path = tmp_path / "mixed.jsonl"
    lines = [
        {"instruction": "Add.", "input": "2 + 2", "output": "4"},
        {"instruction": "Say hi.", "output": "Hi."},
        {"prompt": "Capital of France?", "completion": "Paris."},
        {"conversations": [{"from": "human", "value": "Yo"}, {"from": "gpt", "value": "Hey"}]},
        {
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": t} for t in "ab"]},
                {"role": "assistant", "content": "c"},
            ]
        },  # fmt: skip
    ]
    path.write_text("\n".join(map(json.dumps, lines)) + "\n\n", encoding="utf-8")

    def turn(user, reply):
        return [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]

    assert read_conversations(path) == [
        (1, turn("Add.\n\n2 + 2", "4")),
        (2, turn("Say hi.", "Hi.")),
        (3, turn("Capital of France?", "Paris.")),
        (4, turn("Yo", "Hey")),
        (5, turn("ab", "c")),
    ]


@pytest.mark.parametrize(
    "line, says",
    [
        ("{not json", "line 2: not JSON"),
        ('{"messages": [{"role": "user", "content": "hi"}]}', "line 2: no assistant message"),
        ('{"messages": [{"role": "robot", "content": "hi"}]}', "line 2, message 1: role must"),
        ('{"messages": [{"role": "user", "content": 3}]}', "line 2, message 1: content must"),
        ('{"text": "plain"}', 'line 2: a line is {"messages"'),
        ("[1, 2]", "line 2: not a JSON object"),
    ],
)
def test_a_bad_line_is_refused_in_one_line_naming_its_number(
    chat_dir, tmp_path, capsys, line, says
):
    """`decoderlm train` exits 2 with one line naming the file's bad line and what is wrong."""
    directory, _ = chat_dir
    path = tmp_path / "chats.jsonl"
    good = json.dumps({"messages": CONVERSATIONS[0]})
    path.write_text(f"{good}\n{line}\n{good}\n", encoding="utf-8")
    out = str(tmp_path / "r")
    code = main(["train", "--init-from", str(directory), "--data", str(path), "--out", out])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert says in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "r").exists()


def test_conversations_need_a_model_with_a_chat_template(tmp_path, capsys):
    """A new model (no --init-from) has no template to render conversations: one line."""
    path = tmp_path / "chats.jsonl"
    path.write_text(json.dumps({"messages": CONVERSATIONS[0]}) + "\n", encoding="utf-8")
    assert main(["train", "--data", str(path), "--out", str(tmp_path / "r")]) == 2
    assert "--init-from MODEL" in capsys.readouterr().err


def test_the_validation_loss_is_the_mean_over_reply_tokens_of_transformers_logits(chat_dir):
    """`evaluate` on Conversations: the cross-entropy of transformers' own logits over the
    tokens transformers marks as the assistant's, averaged over those tokens only."""
    directory, hf_model = chat_dir
    hf_tok = transformers.AutoTokenizer.from_pretrained(directory)
    model, tokenizer = load_model_and_tokenizer(str(directory))
    template = ChatTemplate(tiny_chat.CHATML, tokenizer)
    data = Conversations.encode(list(enumerate(CONVERSATIONS, 1)), template, "test")
    total, count = 0.0, 0
    for messages in CONVERSATIONS:
        out = hf_tok.apply_chat_template(
            messages, chat_template=GENERATION_CHATML, return_dict=True,
            return_assistant_tokens_mask=True,
        )  # fmt: skip
        ids, mask = torch.tensor([out["input_ids"]]), torch.tensor(out["assistant_masks"])
        with torch.no_grad():
            logits = hf_model(ids).logits[0, :-1]
        nll = F.cross_entropy(logits, ids[0, 1:], reduction="none")
        total += float(nll[mask[1:].bool()].sum())
        count += int(mask[1:].sum())
    assert evaluate(model.eval(), data, batch_size=1) == pytest.approx(total / count, rel=1e-5)


def _chat(directory, stdin: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "decoderlm", "chat", "--run", str(directory)]
    cmd += ["--temperature", "0", "--max-new-tokens", "40"]
    env = {"PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    return subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=300, env=env)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_fine_tuned_chat_model_gives_the_taught_reply_in_decoderlm_chat(chat_dir, tmp_path, lora):
    """Trained on conversations that answer one question one way, the model gives that
    answer in `decoderlm chat` (fully trained or with LoRA adapters merged); the held-out
    reply loss falls."""
    directory, _ = chat_dir
    path = tmp_path / "chats.jsonl"
    reply = "Four, I am sure."
    lines = [
        {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": reply}]}
        for q in ["What is two plus two?", "two plus two?", "What is 2 + 2?", "Two plus two"] * 4
    ]
    path.write_text("\n".join(map(json.dumps, lines)) + "\n", encoding="utf-8")
    out = tmp_path / "run"
    flags = ["--lora-rank", "8", "--lora-alpha", "16", "--merge", "--optimizer", "adamw"]
    flags = flags if lora else []
    assert main([
        "train", "--init-from", str(directory), "--data", str(path), "--out", str(out),
        "--max-steps", "150", "--batch-size", "4", "--lr", "1e-2" if lora else "3e-3",
        "--eval-interval", "50", "--eval-batches", "1", "--no-progress", "--dropout", "0",
        "--sample-chars", "5", "--dtype", "float32", "--threads", "1", *flags,
    ]) == 0  # fmt: skip
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["val_loss"] for r in records if "val_loss" in r]
    base, tokenizer = load_model_and_tokenizer(str(directory))
    _, val = Conversations.encode(
        read_conversations(path), ChatTemplate(tiny_chat.CHATML, tokenizer), path
    ).split(0.1)
    assert losses[-1] < 0.1 * evaluate(base.eval(), val), losses
    hf_tok = transformers.AutoTokenizer.from_pretrained(directory)
    longest = max(len(hf_tok.apply_chat_template(x["messages"], return_dict=False)) for x in lines)
    assert records[-1]["tokens"] == 150 * 4 * longest  # a window is a conversation long
    config = json.loads((out / "config.json").read_text())
    assert config["data_spec"]["path"] == str(path)
    done = _chat(out / "merged" if lora else out, "What is two plus two?\n")
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"{reply}\n"


def test_one_conversation_is_refused_and_a_long_one_is_said_to_be_cut(chat_dir, tmp_path, capsys):
    """One conversation leaves no validation split: refused, asking for two. A reply longer
    than the context trains, with a note that its tokens past the context are not trained."""
    directory, _ = chat_dir
    path = tmp_path / "chats.jsonl"
    path.write_text(json.dumps({"messages": CONVERSATIONS[0]}) + "\n", encoding="utf-8")
    argv = ["train", "--init-from", str(directory), "--data", str(path), "--max-steps", "1"]
    argv += ["--batch-size", "1", "--eval-batches", "1", "--no-progress", "--sample-chars", "2"]
    assert main([*argv, "--out", str(tmp_path / "one")]) == 2
    assert "at least two conversations" in capsys.readouterr().err
    long = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "yes " * 40}]
    lines = [json.dumps({"messages": m}) for m in (long, *CONVERSATIONS)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    assert main([*argv, "--block-size", "120", "--out", str(tmp_path / "long")]) == 0
    assert "note: 1 of 3 conversations are longer than block_size 120" in capsys.readouterr().out
