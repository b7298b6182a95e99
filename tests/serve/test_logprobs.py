"""The completions' logprobs: text offsets in characters, a token that starts inside a
multi-byte UTF-8 character at that character (tiktoken's `decode_with_offsets` the oracle),
against a real uvicorn server on 127.0.0.1 and on `LogprobsBuilder` alone."""

import pytest
import torch

from decoderlm.tokenizers import ByteTokenizer, GPT2Tokenizer

from conftest import running, tiny_model

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")


def _post(url: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60)


@pytest.fixture(scope="module")
def bpe_server():
    from decoderlm.serve.app import create_app

    tok = GPT2Tokenizer()
    model = tiny_model(seed=4, vocab_size=tok.vocab_size)
    with running(create_app(model, tok, "bpe")) as url:
        yield url, tok


@pytest.mark.parametrize("prompt", ["a😀b", " 你好 naïve café"])
def test_text_offset_is_tiktokens_for_pieces_that_split_a_character(bpe_server, prompt):
    url, tok = bpe_server
    ids = tok.encode(prompt)
    text, offsets = tok.encoding.decode_with_offsets(ids)
    assert len(set(offsets)) < len(ids)  # some pieces hold part of a character
    body = {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 0}
    logprobs = _post(url, body).json()["choices"][0]["logprobs"]
    assert logprobs["text_offset"] == offsets
    if prompt == "a😀b":  # the emoji's two pieces both start at it
        assert offsets == [0, 1, 1, 2] and text[1] == "😀"
    generated = _post(url, {**body, "max_tokens": 8, "seed": 1, "ignore_eos": True}).json()
    got = generated["choices"][0]["logprobs"]["text_offset"]
    # the prompt's offsets stay, and the generated tokens' offsets go on from its text
    assert got[: len(ids)] == offsets and len(got) == len(ids) + 8
    assert got[len(ids)] == len(prompt) and got == sorted(got)


def test_generated_offsets_follow_the_characters_the_tokens_begin_in():
    from decoderlm.serve.logprobs import LogprobsBuilder

    tok = GPT2Tokenizer()
    ids = tok.encode("x 你好😀 é")
    builder = LogprobsBuilder(tok, offset=3)  # after an echoed prompt of 3 characters
    for i in ids:
        builder.add(i, -1.0, [(i, -1.0)])
    text, offsets = tok.encoding.decode_with_offsets(ids)
    assert builder.take().text_offset == [3 + o for o in offsets]
    assert torch.tensor(offsets).diff().min() == 0  # a split character was in there


def test_a_byte_vocabularys_offsets_are_the_characters_its_bytes_belong_to():
    from decoderlm.serve.logprobs import LogprobsBuilder

    tok = ByteTokenizer()
    text = "aé😀b"
    ids = tok.encode(text)
    builder = LogprobsBuilder(tok)
    for i in ids:
        builder.add(i, -1.0, None)
    # the character each UTF-8 byte belongs to, counted by hand
    belongs = [i for i, ch in enumerate(text) for _ in ch.encode("utf-8")]
    assert belongs == [0, 1, 1, 2, 2, 2, 2, 3]
    assert builder.take().text_offset == belongs
    assert builder.offset == len(text)


def test_joined_logprobs_concatenate_the_parts_in_order():
    from decoderlm.serve.logprobs import LogprobsBuilder, joined_logprobs

    tok = ByteTokenizer()
    builder = LogprobsBuilder(tok)
    builder.add(ord("a"), None, None)
    first = builder.take()
    builder.add(ord("b"), -0.5, [(ord("b"), -0.5), (ord("c"), -1.5)])
    second = builder.take()
    joined = joined_logprobs([first, second])
    assert joined.tokens == ["a", "b"] and joined.text_offset == [0, 1]
    assert joined.token_logprobs == [None, -0.5]
    assert joined.top_logprobs == [None, {"b": -0.5, "c": -1.5}]
    assert joined_logprobs([]).tokens == []
