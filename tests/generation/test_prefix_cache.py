"""Prefix caching in the server's scheduler: a prompt that starts with the tokens of a finished
sequence is prefilled from that sequence's kept keys and values, and its tokens are those of a
prefill from scratch."""

import pytest
import torch

from decoderlm.generation import generate as generate_module
from decoderlm.generation import scheduler as scheduler_module
from decoderlm.generation.generate import generate, stream_generate
from decoderlm.generation.params import SamplingParams
from decoderlm.generation.prefix_cache import PrefixCache
from decoderlm.generation.scheduler import Scheduler
from generation.test_scheduler import _run, _sequences

from conftest import halved_random_model

FIRST = [5, 9, 2, 7, 1, 3, 8, 4, 6, 10]


def _prefills(monkeypatch, module=scheduler_module) -> list[tuple[int, int, int]]:
    """(rows, new tokens, kept positions) of each prefill `module` runs from now on."""
    calls, prefill = [], module.prefill

    def recorded(model, ids, *args, past=None, **kwargs):
        calls.append((ids.size(0), ids.size(1), 0 if past is None else past.length))
        return prefill(model, ids, *args, past=past, **kwargs)

    monkeypatch.setattr(module, "prefill", recorded)
    return calls


def _alone(model, prompt, n):
    return generate(model, torch.tensor([prompt]), n, do_sample=False)[0, len(prompt) :].tolist()


def _greedy(scheduler, prompts, n=8):
    return [
        [t.id for t in tokens]
        for tokens in _run(scheduler, *_sequences(prompts, n, temperature=0.0))
    ]


def _teacher_forced(model, prompt, tokens):
    """The log-probabilities of tokens after prompt, from one forward pass over both."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + [t.id for t in tokens]]))[0][0]
    lp = logits[len(prompt) - 1 : -1].log_softmax(-1)
    return lp[torch.arange(len(tokens)), [t.id for t in tokens]].tolist()


@pytest.mark.parametrize("pos_encoding", ["learned", "rope"])
def test_a_prompt_starting_with_a_finished_sequences_tokens_prefills_only_the_rest(
    monkeypatch, pos_encoding
):
    """A conversation's next turn (the first prompt, its reply, three new ids), a prompt sharing
    the first's six ids, and the first prompt again: each is prefilled from the keys and values
    kept of what came before, over its other tokens only (the same prompt again: its last one,
    for its logits), at the right positions (rotary or learned): every greedy token is that of
    generate from scratch, and its log-probability that of one forward pass over the prompt
    and the tokens."""
    model = halved_random_model(3, pos_encoding=pos_encoding, block_size=64)
    calls = _prefills(monkeypatch)
    scheduler = Scheduler(model, 65, max_batch_size=2)
    try:
        (reply,) = _greedy(scheduler, [FIRST])
        # kept: FIRST and the reply but its last id (never fed to the model)
        prompts = [FIRST + reply + [11, 12, 13], FIRST[:6] + [20, 21], FIRST]
        got = [
            _run(scheduler, *_sequences([p], 8, temperature=0.0, logprobs=0))[0] for p in prompts
        ]
    finally:
        scheduler.close()
    assert calls == [(1, 10, 0), (1, 4, 17), (1, 2, 6), (1, 1, 9)]
    assert reply == _alone(model, FIRST, 8)
    assert [[t.id for t in tokens] for tokens in got] == [_alone(model, p, 8) for p in prompts]
    for prompt, tokens in zip(prompts, got, strict=True):
        expected = _teacher_forced(model, prompt, tokens)
        assert [t.logprob for t in tokens] == pytest.approx(expected, abs=1e-4)


def test_prompts_joining_together_after_one_kept_prefix_are_prefilled_in_one_pass(monkeypatch):
    model = halved_random_model(4, block_size=64)
    calls = _prefills(monkeypatch)
    scheduler = Scheduler(model, 65, max_batch_size=4)
    try:
        (reply,) = _greedy(scheduler, [FIRST])
        other = [i for i in range(30, 40) if i != reply[0]]  # a different next id in each
        prompts = [FIRST + [other[i], 40 + i] for i in range(3)]
        got = _greedy(scheduler, prompts)
    finally:
        scheduler.close()
    assert calls == [(1, 10, 0), (3, 2, 10)]
    assert got == [_alone(model, p, 8) for p in prompts]


def test_a_sequence_that_slid_past_the_context_is_not_kept(monkeypatch):
    """A sequence that slid past max_positions holds the keys and values of its last tokens at
    other positions: a prompt starting with its ids is prefilled from scratch, and decodes as
    generate does."""
    model = halved_random_model(5, block_size=16)
    calls = _prefills(monkeypatch)
    scheduler = Scheduler(model, 65, max_batch_size=2)
    try:
        slid = _greedy(scheduler, [FIRST], n=20)[0]  # 10 + 20 ids: past 16 positions
        prompt = FIRST + slid[:3]
        again = _greedy(scheduler, [prompt], n=3)[0]
    finally:
        scheduler.close()
    assert [past for _, _, past in calls if past] == []
    assert slid == _alone(model, FIRST, 20) and again == _alone(model, prompt, 3)


@pytest.mark.parametrize("pos_encoding", ["learned", "rope"])
def test_generate_with_prefixes_prefills_a_conversations_new_tokens_only(monkeypatch, pos_encoding):
    """stream_generate with a PrefixCache (`decoderlm chat`'s): a prompt that extends the
    previous prompt and its tokens is prefilled over its new ids only, its tokens are
    generate's from scratch, and the keys and values kept equal those of one prefill from
    scratch over the same ids."""
    model = halved_random_model(6, pos_encoding=pos_encoding, block_size=64)
    calls, prefixes = _prefills(monkeypatch, generate_module), PrefixCache(1)

    def greedy(prompt):
        tokens = stream_generate(
            model, torch.tensor([prompt]), SamplingParams(8, 0.0), prefixes=prefixes
        )
        return [int(t[0]) for t in tokens]

    reply = greedy(FIRST)
    prompt = FIRST + reply + [11, 12]
    second = greedy(prompt)
    assert calls == [(1, 10, 0), (1, 3, 17)]
    assert reply == _alone(model, FIRST, 8) and second == _alone(model, prompt, 8)
    ids = prompt + second[:-1]  # the last token is never fed to the model
    kept, p = prefixes.longest([*ids, 0])
    assert p == len(ids)
    fresh, _, _ = generate_module.prefill(model, torch.tensor([ids]))
    for a, b in zip(kept.k + kept.v, fresh.k + fresh.v, strict=True):
        torch.testing.assert_close(a[:, :, :p], b[:, :, :p], atol=1e-5, rtol=1e-5)


def test_prefixes_take_one_unpadded_row():
    model = halved_random_model(6)
    with pytest.raises(ValueError, match="one row"):
        two_rows = torch.tensor([[1], [2]])
        list(stream_generate(model, two_rows, SamplingParams(2), prefixes=PrefixCache(1)))


def test_the_longest_prefix_is_found_and_the_least_recently_used_dropped():
    prefixes = PrefixCache(max_entries=2)
    a, b, c = object(), object(), object()  # the caches: kept and handed back as they are
    prefixes.keep([1, 2, 3, 4], a)
    prefixes.keep([1, 2, 9], b)
    assert prefixes.longest([1, 2, 3, 4]) == (a, 3)  # at most all ids but the last
    assert prefixes.longest([1, 2, 9, 9]) == (b, 3)
    assert prefixes.longest([7, 1, 2]) == (None, 0)
    prefixes.longest([1, 2, 3, 5])  # a: the most recently used
    prefixes.keep([6, 6], c)  # b goes
    assert len(prefixes) == 2 and prefixes.longest([1, 2, 9, 9]) == (a, 2)
    prefixes.keep([1, 2, 3, 4, 5, 6], b)  # a's ids are its prefix: a goes
    assert len(prefixes) == 2 and prefixes.longest([1, 2, 3, 4, 0]) == (b, 4)
    none = PrefixCache(max_entries=0)
    none.keep([1, 2, 3], a)
    assert len(none) == 0 and none.longest([1, 2, 3, 4]) == (None, 0)
