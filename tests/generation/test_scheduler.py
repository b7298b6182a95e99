"""Continuous batching: tokens equal those of decoding each request alone."""

import queue
import threading

import pytest
import torch

from decoderlm.generation import scheduler as scheduler_module
from decoderlm.generation.generate import generate, stream_generate
from decoderlm.generation.params import SamplingParams
from decoderlm.generation.precision import prepare_for_decoding
from decoderlm.generation.scheduler import Scheduler, Sequence

from conftest import tiny_model

PROMPTS = [[1, 2, 3], [4], [5, 6, 7, 8, 9, 10], [11] * 30, [12, 13], [3] * 40, [7, 1], [2] * 9]


def _run(scheduler: Scheduler, sequences: list[Sequence], queues: list[queue.Queue]):
    """Submit every sequence at once; each one's tokens (or the exception that ended it)."""
    for seq in sequences:
        scheduler.submit(seq)
    out = []
    for q in queues:
        tokens = []
        while (item := q.get(timeout=60)) is not None:
            if isinstance(item, Exception):
                tokens = item
                break
            tokens.append(item)
        out.append(tokens)
    return out


def _sequences(prompts, max_new_tokens, **settings):
    queues = [queue.Queue() for _ in prompts]
    seqs = [
        Sequence(p, SamplingParams(max_new_tokens, **settings), q.put)
        for p, q in zip(prompts, queues, strict=True)
    ]
    return seqs, queues


# of one length: they are prefilled together, and slide past the context at the same steps
SAME_LENGTH = [[i, 2 * i, 3 * i] for i in range(1, 9)]


@pytest.mark.parametrize(
    "pos_encoding,prompts,max_batch_size",
    [("learned", PROMPTS, 3), ("rope", PROMPTS, 3), ("learned", SAME_LENGTH, 8)],
)
def test_batched_greedy_tokens_equal_generate_alone_even_past_the_context(
    pos_encoding, prompts, max_batch_size
):
    model = tiny_model(seed=1, pos_encoding=pos_encoding)
    scheduler = Scheduler(model, 65, max_batch_size=max_batch_size)  # 3: most prompts queue
    try:
        seqs, queues = _sequences(prompts, 40, temperature=0.0)
        got = _run(scheduler, seqs, queues)
    finally:
        scheduler.close()
    for prompt, tokens in zip(prompts, got, strict=True):
        alone = generate(model, torch.tensor([prompt]), 40, do_sample=False)[0, len(prompt) :]
        assert [t.id for t in tokens] == alone.tolist()


def test_each_sequence_samples_with_its_own_seed_and_settings():
    model = tiny_model(seed=2)
    settings = [dict(seed=s, temperature=t, top_k=k) for s, t, k in [(1, 1.0, None), (2, 0.7, 5)]]
    scheduler = Scheduler(model, 65, max_batch_size=8)
    try:
        queues = [queue.Queue() for _ in range(4)]
        seqs = [
            Sequence(PROMPTS[i], SamplingParams(20, **settings[i % 2]), queues[i].put)
            for i in range(4)
        ]
        got = _run(scheduler, seqs, queues)
    finally:
        scheduler.close()
    for i, tokens in enumerate(got):
        s = settings[i % 2]
        alone = stream_generate(model, torch.tensor([PROMPTS[i]]), SamplingParams(20, **s))
        assert [t.id for t in tokens] == [int(t[0]) for t in alone]


def test_logprobs_are_the_log_softmax_of_the_logits_and_the_true_top_k():
    model = tiny_model(seed=3)
    scheduler = Scheduler(model, 65)
    try:
        seqs, queues = _sequences([PROMPTS[2]], 5, temperature=0.0, logprobs=3)
        (tokens,) = _run(scheduler, seqs, queues)
    finally:
        scheduler.close()
    ids = PROMPTS[2] + [t.id for t in tokens]
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([ids]))[0][0].double(), -1)
    for j, token in enumerate(tokens):
        row = lp[len(PROMPTS[2]) - 1 + j]
        assert token.logprob == pytest.approx(float(row[token.id]), abs=1e-5)
        top = row.topk(3)
        assert [i for i, _ in token.top] == top.indices.tolist()
        assert [v for _, v in token.top] == pytest.approx(top.values.tolist(), abs=1e-5)


def test_a_cancelled_or_failing_sequence_leaves_and_the_others_go_on(monkeypatch):
    model = tiny_model(seed=4)
    sample_next = scheduler_module.sample_next

    def refuse_seed_99(logits, params, generator):
        if params.seed == 99:
            raise ValueError("temperature refused")
        return sample_next(logits, params, generator)

    monkeypatch.setattr(scheduler_module, "sample_next", refuse_seed_99)
    scheduler = Scheduler(model, 65, max_batch_size=4)
    try:
        seqs, queues = _sequences(PROMPTS[:3], 30, temperature=0.0)
        seqs[1].params = SamplingParams(30, temperature=0.0, seed=99)  # fails alone
        seqs[2].cancel()  # cancelled before it starts: it never gets a token
        scheduler.submit(seqs[2])
        got = _run(scheduler, seqs[:2], queues[:2])
        assert queues[2].empty()
        assert isinstance(got[1], ValueError) and "temperature" in str(got[1])
        alone = generate(model, torch.tensor([PROMPTS[0]]), 30, do_sample=False)
        assert [t.id for t in got[0]] == alone[0, 3:].tolist()
        assert scheduler.load == (0, 0)
    finally:
        scheduler.close()


def test_ids_past_the_tokenizers_are_never_sampled_or_scored():
    model = tiny_model(seed=5, vocab_size=80, tie_embeddings=False)  # a tokenizer of 65 ids
    with torch.no_grad():
        best = int(model(torch.tensor([[1, 2, 3]]))[0][0, -1, :65].argmax())
        model.lm_head.weight[65:] = model.lm_head.weight[best] * 3  # those ids would win
        assert int(model(torch.tensor([[1, 2, 3]]))[0][0, -1].argmax()) >= 65
    scheduler = Scheduler(model, 65)
    try:
        seqs, queues = _sequences([[1, 2, 3]], 5, temperature=0.0, logprobs=0)
        (tokens,) = _run(scheduler, seqs, queues)
    finally:
        scheduler.close()
    assert tokens[0].id == best and all(t.id < 65 for t in tokens)
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([[1, 2, 3]]))[0][0, -1, :65], -1)
    assert tokens[0].logprob == pytest.approx(float(lp[best]), abs=1e-5)


def test_a_failing_step_fails_the_batch_and_the_scheduler_goes_on():
    model = tiny_model(seed=6)
    calls = []

    def step(m, idx, cache, pos):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("boom")
        return m.forward_cached(idx, cache, pos)

    scheduler = Scheduler(model, 65, step=step)
    try:
        seqs, queues = _sequences(PROMPTS[:2], 10, temperature=0.0)
        got = _run(scheduler, seqs, queues)
        assert all(isinstance(g, RuntimeError) for g in got)
        seqs, queues = _sequences(PROMPTS[:2], 10, temperature=0.0)
        got = _run(scheduler, seqs, queues)
    finally:
        scheduler.close()
    alone = generate(model, torch.tensor([PROMPTS[0]]), 10, do_sample=False)
    assert [t.id for t in got[0]] == alone[0, 3:].tolist()


def test_a_sequence_ends_after_its_end_of_text_id_and_the_others_go_on():
    model = tiny_model(seed=1)
    prompts = [[1, 2, 3], [4, 5]]
    alone = [generate(model, torch.tensor([p]), 30, do_sample=False)[0, len(p) :] for p in prompts]
    stop_id = int(alone[0][5])  # the 6th greedy token of the first prompt
    cut = alone[0].tolist().index(stop_id) + 1
    scheduler = Scheduler(model, 65, max_batch_size=2)
    try:
        queues = [queue.Queue() for _ in prompts]
        seqs = [
            Sequence(prompts[0], SamplingParams(30, 0.0, eos_token_id=stop_id), queues[0].put),
            Sequence(prompts[1], SamplingParams(30, 0.0), queues[1].put),
        ]
        first, second = _run(scheduler, seqs, queues)
    finally:
        scheduler.close()
    assert [t.id for t in first] == alone[0][:cut].tolist()  # the stop id is emitted, then None
    assert [t.id for t in second] == alone[1].tolist()


def test_a_compiled_scheduler_compiles_nothing_more_after_one_row_and_two():
    """The compiled step of a slot cache is one graph with fixed shapes: a batch of one row and
    one of two (a server's warm-up) trace without a graph break (error_on_graph_break would
    fail them: reading a length as a Python number inside the step did), and afterwards rows
    joining and leaving, windows growing past 64 positions and contexts sliding past
    max_positions (72) compile nothing more (torch's fail_on_recompile stance would fail the
    sequences); each greedy token is generate's."""
    torch._dynamo.reset()
    model = tiny_model(seed=1, pos_encoding="rope", block_size=72)
    expected = [
        generate(model, torch.tensor([p]), 40, do_sample=False)[0, len(p) :].tolist()
        for p in PROMPTS
    ]
    prepare_for_decoding(model, compile=True)
    scheduler = Scheduler(model, 65, max_batch_size=3)
    try:
        with torch._dynamo.error_on_graph_break(True):  # one graph for each kind of batch
            for prompts in ([[1]], [[1], [2, 3]]):  # the warm-up
                warm = _run(scheduler, *_sequences(prompts, 3, temperature=0.0))
                assert all(isinstance(tokens, list) for tokens in warm), warm
        with torch.compiler.set_stance("fail_on_recompile"):
            got = _run(scheduler, *_sequences(PROMPTS, 40, temperature=0.0))
    finally:
        scheduler.close()
    assert [[t.id for t in tokens] for tokens in got] == expected


def test_calls_run_on_the_scheduler_thread_and_hand_back_results_and_errors():
    scheduler = Scheduler(tiny_model(seed=1), 65)
    try:
        name = scheduler.call(lambda: threading.current_thread().name).result(timeout=60)
        grad = scheduler.call(torch.is_grad_enabled).result(timeout=60)
        failed = scheduler.call(int, "not a number")
        with pytest.raises(ValueError, match="not a number"):
            failed.result(timeout=60)
    finally:
        scheduler.close()
    assert name == "decoderlm-scheduler" and name != threading.current_thread().name
    assert grad is False  # under torch.no_grad, as the decoding
