"""A model is made decode-ready in one place: prepare_for_decoding changes it and records what
it did; generate() and the Scheduler decode it as it is and change nothing."""

import copy
import queue

import pytest
import torch

from decoderlm.errors import UserError
from decoderlm.generation import steps
from decoderlm.generation.cpu_decode import DecodeLinear
from decoderlm.generation.generate import generate
from decoderlm.generation.params import SamplingParams
from decoderlm.generation.precision import DecodingSetup, decoding_setup, prepare_for_decoding
from decoderlm.generation.scheduler import Scheduler, Sequence

from conftest import tiny_model


def _snapshot(model):
    """Every module's class, every parameter and buffer (name, dtype, values), the mode and
    the instance attributes: what a decoding call must leave as it found it."""
    return (
        [(name, type(m)) for name, m in model.named_modules()],
        {k: v.detach().clone() for k, v in model.state_dict().items()},
        model.training,
        sorted(vars(model)),
    )


def _same(a, b) -> bool:
    return (
        a[0] == b[0]
        and a[2:] == b[2:]
        and a[1].keys() == b[1].keys()
        and all(a[1][k].dtype == b[1][k].dtype and torch.equal(a[1][k], b[1][k]) for k in a[1])
    )


@pytest.mark.parametrize("training", [False, True])
def test_generate_leaves_the_model_unchanged(training):
    model = tiny_model(block_size=16, dropout=0.1).train(training)
    before = _snapshot(model)
    generate(model, torch.tensor([[1, 2, 3]]), 30, seed=0, top_k=5)  # 33 > 16: it slides
    assert _same(before, _snapshot(model))
    assert decoding_setup(model) is None
    assert not any(isinstance(m, DecodeLinear) for m in model.modules())


def test_the_scheduler_leaves_the_model_unchanged():
    model = tiny_model(block_size=16).eval()
    before = _snapshot(model)
    scheduler = Scheduler(model, 65)
    try:
        q = queue.Queue()
        scheduler.submit(Sequence([1, 2, 3], SamplingParams(20, temperature=0.0), q.put))
        while q.get(timeout=60) is not None:
            pass
    finally:
        scheduler.close()
    assert _same(before, _snapshot(model))


def test_prepare_records_what_it_did_and_installs_the_cpu_kernels():
    model = tiny_model().eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert prepare_for_decoding(model) is model
    assert model.decoding_setup == DecodingSetup(torch.float32, None, False, True)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(type(m) is DecodeLinear for m in linears)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    low = prepare_for_decoding(tiny_model().eval(), dtype="bfloat16", compile=True)
    assert low.decoding_setup == DecodingSetup(torch.bfloat16, None, True, True)
    # float32 prompts read a packed copy only where the step is compiled (memory elsewhere)
    assert not any(m.packs_float32 for m in linears)
    compiled = prepare_for_decoding(tiny_model().eval(), compile=True)
    compiled_linears = [m for m in compiled.modules() if isinstance(m, DecodeLinear)]
    assert compiled_linears and all(m.packs_float32 for m in compiled_linears)


def test_preparing_twice_is_a_no_op_with_the_same_settings_and_refused_otherwise():
    model = prepare_for_decoding(tiny_model().eval(), dtype="bfloat16")
    before = _snapshot(model)
    assert prepare_for_decoding(model, dtype="bfloat16") is model
    assert _same(before, _snapshot(model))
    for other in (dict(dtype="bfloat16", compile=True), dict(quantize="int8")):
        with pytest.raises(UserError, match="already prepared for decoding"):
            prepare_for_decoding(model, **other)
    assert _same(before, _snapshot(model))
    plain = prepare_for_decoding(tiny_model().eval(), dtype="float32")
    assert prepare_for_decoding(plain) is plain  # None and "float32" ask for the same


def test_the_decoding_paths_read_compile_from_the_record(monkeypatch):
    asked = []
    real = steps.decode_step
    monkeypatch.setattr(
        "decoderlm.generation.generate.decode_step", lambda c: asked.append(c) or real(False)
    )
    monkeypatch.setattr(
        "decoderlm.generation.scheduler.decode_step", lambda c: asked.append(c) or real(False)
    )
    model = tiny_model().eval()
    compiled = prepare_for_decoding(copy.deepcopy(model), compile=True)
    generate(model, torch.tensor([[1]]), 2)
    generate(compiled, torch.tensor([[1]]), 2)
    Scheduler(model, 65).close()
    Scheduler(compiled, 65).close()
    assert asked == [False, True, False, True]
    with pytest.raises(TypeError, match="prepare_for_decoding"):
        generate(model, torch.tensor([[1]]), 2, compile=True)


def test_params_or_keywords_give_the_same_tokens():
    model, prompt = tiny_model(), torch.tensor([[4, 5, 6]])
    by_keywords = generate(model, prompt, 12, seed=3, top_p=0.9, stop=[7])
    params = SamplingParams(12, seed=3, top_p=0.9, stop_token_ids=[7])
    assert torch.equal(generate(model, prompt, params=params), by_keywords)
    with pytest.raises(TypeError, match="not both"):
        generate(model, prompt, 12, params=params)


def test_without_a_cpp_compiler_compile_decodes_eagerly_and_says_so(monkeypatch, capsys):
    monkeypatch.setenv("CXX", "/nonexistent/c++")  # the compiler torch.compile would call
    model = prepare_for_decoding(tiny_model().eval(), compile=True)
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "decoderlm: no C++ compiler found (g++, or $CXX), so the decoding step runs eagerly, "
        "not compiled"
    ]
    assert model.decoding_setup.compile is False
    expected = generate(tiny_model().eval(), torch.tensor([[1, 2]]), 5, do_sample=False)
    assert torch.equal(generate(model, torch.tensor([[1, 2]]), 5, do_sample=False), expected)
