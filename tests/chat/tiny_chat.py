"""A tiny Hugging Face GPT-2 directory with its own BPE tokenizer (trained here, offline) and
a ChatML chat template, saved by transformers: the chat tests' model."""

import json

import pytest
import torch

from conftest import byte_level_bpe

CHATML = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are helpful.<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "The capital of France is Paris. Hello, how are you today? I am fine, thank you.",
    "system user assistant: answer the question briefly. What is two plus two? Four.",
    'Ünïcödé & <html> "quotes" are text too; numbers 0123456789 and tabs\tand lines\n',
]


@pytest.fixture(scope="session")
def chat_dir(tmp_path_factory):
    """(directory, transformers model) of a tiny GPT-2 with a 300-token BPE vocabulary whose
    end-of-text token is <|endoftext|> and whose template is ChatML."""
    transformers = pytest.importorskip("transformers")
    bpe = byte_level_bpe(CORPUS, SPECIAL)
    directory = tmp_path_factory.mktemp("tiny-chat")
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|endoftext|>", bos_token="<|endoftext|>"
    )
    fast.chat_template = CHATML
    fast.save_pretrained(directory)
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=bpe.get_vocab_size(),
        n_positions=128,
        n_embd=32,
        n_layer=2,
        n_head=4,
        initializer_range=0.3,  # logits far from uniform: greedy replies that vary
        eos_token_id=0,
        bos_token_id=0,
    )
    model = transformers.GPT2LMHeadModel(config).eval()
    model.save_pretrained(directory)
    config_file = directory / "tokenizer_config.json"
    data = json.loads(config_file.read_text())
    data["chat_template"] = CHATML  # in the config, whichever file transformers wrote it to
    config_file.write_text(json.dumps(data))
    (directory / "chat_template.jinja").unlink(missing_ok=True)
    return directory, model


def hf_greedy_reply(hf_model, hf_tok, messages: list[dict], max_new_tokens: int):
    """(reply text, finish_reason, tokens generated) of transformers' greedy `generate` on the
    chat-formatted `messages` (string contents), stopping at <|im_end|> or end-of-text, which
    the text leaves out."""
    ids = hf_tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    end = [hf_tok.convert_tokens_to_ids("<|im_end|>"), hf_tok.eos_token_id]
    out = hf_model.generate(
        torch.tensor([ids]),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=end,
        pad_token_id=0,
    )[0, len(ids) :].tolist()
    finish = "stop" if out and out[-1] in end else "length"
    reply = out[:-1] if finish == "stop" else out
    return hf_tok.decode(reply), finish, len(out)
