"""SamplingParams: each bad setting is refused when built, with its one line; the CLI says the
same line before loading anything; importing it imports no torch."""

import subprocess
import sys

import pytest
import torch

from decoderlm.errors import UserError
from decoderlm.generation.params import SamplingParams

from conftest import one_line_error


@pytest.mark.parametrize(
    "settings,line",
    [
        (dict(max_new_tokens=-1), "max_new_tokens must be >= 0, got -1"),
        (dict(max_new_tokens=2.5), "max_new_tokens must be >= 0, got 2.5"),
        (
            dict(temperature=-0.5),
            "temperature must be a finite number >= 0 (0 means greedy), got -0.5",
        ),
        (
            dict(temperature=float("nan")),
            "temperature must be a finite number >= 0 (0 means greedy), got nan",
        ),
        (
            dict(temperature=float("inf")),
            "temperature must be a finite number >= 0 (0 means greedy), got inf",
        ),
        (
            dict(temperature="hot"),
            "temperature must be a finite number >= 0 (0 means greedy), got hot",
        ),
        (dict(top_k=0), "top_k must be a positive integer or None, got 0"),
        (dict(top_k=2.0), "top_k must be a positive integer or None, got 2.0"),
        (dict(top_k=True), "top_k must be a positive integer or None, got True"),
        (dict(top_p=1.5), "top_p must be in [0, 1] or None, got 1.5"),
        (dict(top_p=-0.1), "top_p must be in [0, 1] or None, got -0.1"),
        (dict(seed=1.5), "seed must be an integer or None, got 1.5"),
        (dict(stop=[1]), "stop texts must be strings, got [1]"),
        (
            dict(stop_token_ids=[[]]),
            "stop must hold token ids or non-empty lists of token ids, got []",
        ),
        (
            dict(stop_token_ids=["a"]),
            "stop must hold token ids or non-empty lists of token ids, got 'a'",
        ),
        (dict(eos_token_id="50256"), "eos_token_id must be a token id (an integer), got '50256'"),
        (dict(ignore_eos=1), "ignore_eos must be True or False, got 1"),
        (dict(logprobs=-1), "logprobs must be an integer >= 0 or None, got -1"),
    ],
)
def test_each_bad_setting_is_refused_with_its_line(settings, line):
    with pytest.raises(UserError) as e:
        SamplingParams(**settings)
    assert str(e.value) == line


def test_settings_are_normalised_and_frozen():
    p = SamplingParams(
        5, stop="END", stop_token_ids=[torch.tensor(3), [4, 5], torch.tensor([6, 7])]
    )
    assert p.stop == ("END",) and p.stop_token_ids == ((3,), (4, 5), (6, 7))
    assert SamplingParams(stop_token_ids=9).stop_token_ids == ((9,),)
    assert SamplingParams(stop=None).stop == () and SamplingParams().stop_token_ids == ()
    assert p == SamplingParams(5, stop=("END",), stop_token_ids=((3,), (4, 5), (6, 7)))
    hash(p)  # frozen and hashable: one object shared by every step
    with pytest.raises(AttributeError):
        p.temperature = 0.5


def test_the_sample_command_refuses_a_bad_setting_before_loading(capsys):
    # the run does not exist: the setting's line comes first
    for flag, value, line in [
        ("--temperature", "-1", "--temperature must be a finite number >= 0"),
        ("--top-p", "2", "--top-p must be in [0, 1] or none, got 2.0"),
    ]:
        argv = ["sample", "--run", "no/such/run", flag, value]
        one_line_error(capsys, argv, line)


def test_importing_it_imports_no_torch():
    code = "import sys, decoderlm.generation.params; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
