"""The server's limits: `ServeLimits` is where `decoderlm serve`'s limit flags come from (their
names, help and defaults), what it refuses, and the admission of choices against the batch and
the queue (503)."""

import dataclasses
import json
import math
import re
import time

import pytest

from decoderlm import CharTokenizer
from decoderlm.errors import UserError
from decoderlm.serve.limits import ServeLimits

from conftest import tiny_model

# the limit flags of `decoderlm serve`, with the defaults its --help shows (written by hand)
FLAGS = {
    "--max-tokens-limit": "1024",
    "--max-prompt-tokens": "4096",
    "--max-logprobs": "5",
    "--max-stop": "16",
    "--max-batch-size": "8",
    "--max-queue": "64",
    "--request-timeout": "600.0",
    "--max-body-bytes": "4194304",
    "--enable-prefix-caching": "true",
}


def _serve_command():
    from decoderlm.cli import command

    return command("serve")


def test_the_limit_flags_are_the_fields_of_servelimits_with_their_defaults():
    names = [f"--{f.name.replace('_', '-')}" for f in dataclasses.fields(ServeLimits)]
    assert names == list(FLAGS)  # max_choices is no field: no flag
    help_text = _serve_command().parser.format_help()
    entries = re.split(r"\n  (?=--)", " ".join(help_text.split("\n  -h")[1:]))
    shown = {e.split()[0]: " ".join(e.split()) for e in entries}
    for flag, default in FLAGS.items():
        assert shown[flag].endswith(f"(default: {default})"), shown[flag]
    assert "--max-choices" not in help_text
    assert "limits settings (ServeLimits)" in help_text


def test_the_limit_flags_reach_servelimits():
    argv = ["--max-tokens-limit", "5", "--max-queue", "0", "--request-timeout", "0"]
    argv += ["--enable-prefix-caching", "false"]
    kwargs = _serve_command().parse(argv)
    given = {"max_tokens_limit": 5, "max_queue": 0, "request_timeout": 0.0}
    assert kwargs == {"limits": given | {"enable_prefix_caching": False}}
    limits = ServeLimits(**kwargs["limits"])
    assert (limits.max_tokens_limit, limits.max_queue, limits.request_timeout) == (5, 0, 0.0)
    assert limits.enable_prefix_caching is False
    assert limits.max_batch_size == 8  # the rest: the defaults


def test_a_settings_file_gives_the_limits_under_limits(tmp_path):
    from decoderlm.cli.flags import FlagError

    path = tmp_path / "serve.json"
    path.write_text(json.dumps({"port": 9000, "limits": {"max_stop": 2}}))
    assert _serve_command().parse(["--config", str(path)]) == {
        "port": 9000,
        "limits": {"max_stop": 2},
    }
    path.write_text(json.dumps({"max_stop": 2}))
    with pytest.raises(UserError, match="write it under `limits:`"):
        _serve_command().parse(["--config", str(path)])
    path.write_text(json.dumps({"limits": {"max_stop": "two"}}))
    with pytest.raises(FlagError, match="--max-stop: expected an integer"):
        _serve_command().parse(["--config", str(path)])


@pytest.mark.parametrize(
    "fields,message",
    [
        ({"max_tokens_limit": 0}, "--max-tokens-limit must be an integer >= 1, got 0"),
        ({"max_batch_size": 0}, "--max-batch-size must be an integer >= 1, got 0"),
        ({"max_queue": -1}, "--max-queue must be an integer >= 0, got -1"),
        ({"max_logprobs": -1}, "--max-logprobs must be in [0, 20], got -1"),
        ({"request_timeout": -0.5}, "--request-timeout must be >= 0 seconds, got -0.5"),
        ({"request_timeout": math.nan}, "--request-timeout must be >= 0 seconds, got nan"),
    ],
)
def test_servelimits_refuses_values_naming_the_flag(fields, message):
    with pytest.raises(UserError) as e:
        ServeLimits(**fields)
    assert str(e.value) == message
    ServeLimits(max_queue=0, max_stop=0, max_logprobs=20, request_timeout=0)  # the least


def test_admission_refuses_beyond_its_capacity_unless_nothing_is_in_progress():
    pytest.importorskip("pydantic")
    from decoderlm.serve.admission import Admission
    from decoderlm.serve.errors import ApiError

    admission = Admission(3)
    release = admission.admit(5)  # larger than the capacity: alone, it runs
    assert admission.in_progress == 5
    release()
    release()  # once, however often it is called
    assert admission.in_progress == 0
    first = admission.admit(2)
    admission.admit(1)
    with pytest.raises(ApiError) as e:
        admission.admit(1)
    assert e.value.status == 503 and e.value.headers == {"Retry-After": "1"}
    assert e.value.code == "server_busy" and "3 choices are in progress" in e.value.message
    first()
    admission.admit(2)
    assert admission.in_progress == 3


@pytest.mark.parametrize("timeout", [0.0, 5.0])
def test_a_request_timeout_of_0_sets_no_deadline(timeout):
    pytest.importorskip("pydantic")
    from decoderlm.serve.protocol import CompletionRequest
    from decoderlm.serve.serving_completion import ServingCompletion
    from decoderlm.serve.serving_models import ServingModels

    models = ServingModels(tiny_model(), CharTokenizer([chr(65 + i) for i in range(65)]), "t")
    completion = ServingCompletion(models, ServeLimits(request_timeout=timeout))
    try:
        before = time.monotonic()
        job = completion.check_completion(CompletionRequest(prompt="AB", max_tokens=2))
        if timeout:
            assert before + timeout <= job.deadline <= time.monotonic() + timeout
        else:
            assert job.deadline == math.inf
        assert completion.admission.in_progress == 1
        job.release()
        assert completion.admission.in_progress == 0
    finally:
        completion.close()
