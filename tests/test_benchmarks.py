"""The benchmark scripts: each takes --help (argparse) and fails in one line when its data is
missing, and a benchmark that needs a peer or a corpus the repository does not hold says in
that line how to get it. They run in one child process (torch imported once), as
`python benchmarks/X.py`."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPTS = sorted(p for p in BENCHMARKS.glob("*.py") if p.name != "common.py")

DRIVER = r"""
import contextlib, io, json, runpy, sys
results = {}
for script, *args in json.loads(sys.argv[1]):
    sys.argv = [script, *args]
    sys.path.insert(0, script.rsplit("/", 1)[0])
    out, err = io.StringIO(), io.StringIO()
    code = None
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as e:
            code = e.code
    results[" ".join([script, *args])] = [code, out.getvalue(), err.getvalue()]
print(json.dumps(results))
"""


def _run(calls: list[list[str]]) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", DRIVER, json.dumps(calls)],
        capture_output=True,
        text=True,
        timeout=300,
        env={"OMP_NUM_THREADS": "1", "PATH": "", **_pythonpath()},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.splitlines()[-1])


def _pythonpath() -> dict:
    import decoderlm

    return {"PYTHONPATH": str(Path(decoderlm.__file__).parents[1])}


def test_every_benchmark_takes_help_and_fails_in_one_line_without_its_data(tmp_path):
    assert len(SCRIPTS) >= 10
    missing = str(tmp_path / "missing.txt")
    calls = [[str(p), "--help"] for p in SCRIPTS] + [
        [str(BENCHMARKS / "train_speed.py"), "--part", "recipe", "--data", missing],
        [str(BENCHMARKS / "recipe_spread.py"), "--data", missing],
        [str(BENCHMARKS / "versions.py"), missing, missing],
        [str(BENCHMARKS / "finetune_example.py"), "--data", missing],
        [str(BENCHMARKS / "chat_finetune_example.py"), "--init-from", missing],
        [str(BENCHMARKS / "chat_turns.py"), "--gguf", missing],
    ]
    results = _run(calls)
    for script in SCRIPTS:
        code, out, _ = results[f"{script} --help"]
        assert code == 0 and out.startswith("usage:"), (script.name, code, out[:200])
    for key, (code, out, err) in results.items():
        if key.endswith("--help"):
            continue
        assert code == 2 and out == "" and err.count("\n") == 1, (key, err)
        assert "error:" in err and "missing.txt not found" in err, err


# the scripts that need Tiny Shakespeare or a nanoGPT clone, run without them: nothing outside
# the repository is a default, so each names the flag and how to get what it needs
WITHOUT_PEERS = {
    ("train_speed.py", "--part", "recipe"): ("--data is required", "curl -L -o data/input.txt"),
    ("recipe_spread.py",): ("--data is required", "curl -L -o data/input.txt"),
    ("finetune_example.py",): ("--data is required", "curl -L -o data/input.txt"),
    ("vs_nanogpt.py",): ("--nanogpt is required", "git clone https://github.com/karpathy/nanoGPT"),
}


def test_a_benchmark_without_its_peer_or_corpus_says_how_to_get_it(tmp_path):
    calls = [[str(BENCHMARKS / script), *args] for script, *args in WITHOUT_PEERS]
    nanogpt = tmp_path / "nanoGPT"  # a directory that is not a nanoGPT clone
    nanogpt.mkdir()
    calls.append([str(BENCHMARKS / "vs_nanogpt.py"), "--nanogpt", str(nanogpt)])
    results = _run(calls)
    for (script, *args), (flag, how) in WITHOUT_PEERS.items():
        code, out, err = results[" ".join([str(BENCHMARKS / script), *args])]
        assert code == 2 and out == "" and err.count("\n") == 1, (script, err)
        assert f"{script}: error: {flag}" in err and how in err, err
    code, _, err = results[f"{BENCHMARKS / 'vs_nanogpt.py'} --nanogpt {nanogpt}"]
    assert code == 2 and "train.py not found" in err and "git clone" in err, err


def test_decode_profile_step_options_and_gemv_refuse_bad_flags_in_one_line(tmp_path):
    # before anything is compiled: kernel rows exist only in a compiled step, a table or a
    # product needs at least one row, a model is a GGUF file or a shape, not both, a missing
    # or unreadable GGUF file is named, an inductor option must exist, a timing needs a call
    # and a prompt a token, exit 2 each
    profile, gemv = str(BENCHMARKS / "decode_profile.py"), str(BENCHMARKS / "gemv.py")
    options = str(BENCHMARKS / "step_options.py")
    attention, llama = (
        str(BENCHMARKS / "attention_one_query.py"),
        str(BENCHMARKS / "vs_llamacpp.py"),
    )
    missing, text = str(tmp_path / "missing.gguf"), tmp_path / "text.gguf"
    text.write_text("not a GGUF file")
    cases = {
        (profile, "--kernels"): "decode_profile.py: error: --kernels needs --compile",
        (profile, "--rows", "0"): "decode_profile.py: error: --rows must be >= 1",
        (profile, "--gguf", missing): f"decode_profile.py: error: {missing} not found",
        (profile, "--gguf", str(text)): f"decode_profile.py: error: {text} is not a readable",
        (profile, "--gguf", missing, "--shape", "thin"): "decode_profile.py: error: give --gguf",
        (profile, "--compile", "--kernels", "--split"): "decode_profile.py: error: give --kernels",
        (profile, "--prompt", "--split"): "decode_profile.py: error: --prompt times the prompt",
        (profile, "--prompt", "--compile", "--kernels"): "decode_profile.py: error: --prompt ",
        (gemv, "--rows", "0"): "gemv.py: error: --rows must be >= 1",
        (options, "--rounds", "0"): "step_options.py: error: --rounds must be >= 1",
        (options, "--new-tokens", "1"): "step_options.py: error: --rounds must be >= 1",
        (options, "--a", "no_such=1"): "step_options.py: error: 'no_such' is not one of",
        (options, "--a-checkout", missing): "step_options.py: error: ",
        (str(BENCHMARKS / "chat_turns.py"), "--threads", "0"): "chat_turns.py: error: --turns,",
        (attention, "--calls", "0"): "attention_one_query.py: error: --calls must be 1 or more",
        (llama, "--prompt-tokens", "0"): "vs_llamacpp.py: error: --prompt-tokens and --new-",
        (llama, "--new-tokens", "128", "0"): "vs_llamacpp.py: error: --prompt-tokens and --new-",
    }
    results = _run([list(call) for call in cases])
    for call, said in cases.items():
        code, out, err = results[" ".join(call)]
        assert code == 2 and out == "" and err.count("\n") == 1, (call, err)
        assert err.startswith(said), (call, err)


def test_decode_profile_split_times_each_decoded_token_and_restores_the_loop(monkeypatch, capsys):
    # --split wraps the step and the sampler that stream_generate looks up: its rows must
    # account for each token after the first (parts within the whole), and the loop must
    # get its own functions back, or a later generate in the process would stay wrapped
    import importlib

    import torch

    from decoderlm import DecoderLM, ModelConfig
    from decoderlm.generation import generate as loop

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    bench = importlib.import_module("decode_profile")
    step_of, choose = loop.decode_step, loop.sample_next
    model = DecoderLM(ModelConfig(vocab_size=64, block_size=64, n_layers=2, n_heads=2,
                                  d_model=32)).eval()  # fmt: skip
    bench.split(model, torch.tensor([[1, 2, 3]]), rounds=3, new=12)
    assert loop.decode_step is step_of and loop.sample_next is choose
    rows = dict(line.split(": ") for line in capsys.readouterr().out.splitlines())
    names = ["a token", "the one-token step", "choosing the token", "the rest of the loop"]
    assert list(rows) == names, rows
    whole, step, chosen, rest = (float(rows[n].removesuffix(" ms")) for n in names)
    assert 0 < step < whole and 0 < chosen < whole and rest < whole, rows


def test_decode_profile_prompt_times_a_pass_that_fills_a_new_cache(monkeypatch, capsys):
    # --prompt times steps.prefill itself: each timed pass must fill a cache of its own
    # (a pass into a cache left full would fail or time a different pass), 3 + 15 + 5 of
    # them, and the tokens/s line must name the prompt's length
    import importlib

    import torch

    from decoderlm import DecoderLM, ModelConfig
    from decoderlm.generation import steps

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    bench = importlib.import_module("decode_profile")
    model = DecoderLM(ModelConfig(vocab_size=64, block_size=64, n_layers=2, n_heads=2,
                                  d_model=32)).eval()  # fmt: skip
    lengths, prefill = [], steps.prefill

    def counted(*args, **kwargs):
        cache, positions, logits = prefill(*args, **kwargs)
        lengths.append(cache.length)
        return cache, positions, logits

    monkeypatch.setattr(steps, "prefill", counted)
    bench.prompt_pass(model, torch.tensor([[1, 2, 3, 4, 5]]), rows=3)
    out = capsys.readouterr().out
    assert lengths == [5] * 23
    rate = float(out.splitlines()[0].removeprefix("prompt of 5 tokens: ").split()[0])
    assert rate > 0 and "Self CPU" in out
    # the second line times generate's first token (15 + 3 calls, each through its own
    # prefill, not the counted one: generate took steps.prefill at import)
    first = out.splitlines()[1].removeprefix("the first token of generate: ")
    assert float(first.split()[0]) > 0 and first.endswith(" tokens/s")


def test_the_serve_load_test_passes_a_short_run():
    script = str(BENCHMARKS / "serve_load.py")
    args = ["--duration", "3", "--clients", "4", "--max-tokens", "8"]
    code, out, err = _run([[script, *args]])[" ".join([script, *args])]
    assert code == 0 and "FAIL" not in out, (out, err)
    assert "ok    every answer as expected: 0 wrong" in out and "MiB" in out


def test_no_benchmark_defaults_to_a_path_outside_the_repository():
    for path in [*BENCHMARKS.glob("*.py"), *BENCHMARKS.glob("*.sh"), BENCHMARKS / "README.md"]:
        text = path.read_text(encoding="utf-8")
        assert "../shared" not in text and '"shared"' not in text, path.name


def test_vs_llamacpp_without_llama_cpp_says_how_to_install_it():
    # as if llama-cpp-python were not installed: one line naming the pip command, for this
    # CPU without AMX (the q8_0 path of a plain native build dies with SIGILL on some)
    code = (
        "import runpy, sys\n"
        "sys.modules['llama_cpp'] = None\n"
        f"sys.argv = ['vs_llamacpp.py']; sys.path.insert(0, {str(BENCHMARKS)!r})\n"
        f"runpy.run_path({str(BENCHMARKS / 'vs_llamacpp.py')!r}, run_name='__main__')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 2 and done.stdout == "" and done.stderr.count("\n") == 1
    assert (
        "llama_cpp is not installed" in done.stderr
        and 'pip install "llama-cpp-python[server]' in done.stderr
        and "-DGGML_NATIVE=ON" in done.stderr
        and "-DCMAKE_C_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" in done.stderr
    )


def test_vs_llamacpp_gguf_pairs_follow_precisions(tmp_path, monkeypatch):
    # --gguf FILE decodes and re-encodes only the precision pairs --precisions names, as the
    # shapes do (a run of one pair does not time the other two)
    import argparse
    import importlib

    pytest.importorskip("gguf")
    from decoderlm import CharTokenizer, DecoderLM, ModelConfig
    from decoderlm.io.gguf import save_gguf

    tokenizer = CharTokenizer.from_text("abcdefgh ")
    model = DecoderLM(ModelConfig(vocab_size=tokenizer.vocab_size, block_size=16, n_layers=1,
                                  n_heads=2, d_model=32, activation="gelu_tanh"))  # fmt: skip
    source = tmp_path / "tiny.gguf"
    save_gguf(model, tokenizer, source)
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    bench = importlib.import_module("vs_llamacpp")
    args = argparse.Namespace(gguf=str(source), precisions=["16bit", "8bit"], new_tokens=[8],
                              compile=False, prompt_tokens=5)  # fmt: skip
    files = bench.recoded_files(source, tmp_path, args.precisions)
    cases = bench.gguf_cases(args, files)
    assert sorted(files) == ["f16", "q8_0"]
    assert [c["precision"] for c in cases] == ["bf16/f16", "int8/q8_0"]
    assert [cases[0]["ours"].get("dtype"), cases[0]["ours"].get("quantize")] == ["bfloat16", None]
    assert cases[1]["ours"]["quantize"] == "int8" and cases[1]["gguf"] == files["q8_0"]
    # both contenders' workers get --prompt-tokens' length
    assert {c[kind]["prompt_tokens"] for c in cases for kind in ("ours", "llama")} == {5}


def test_vs_llamacpp_counts_the_end_of_text_token_for_both_servers(monkeypatch):
    # llama-cpp-python's usage leaves out the end-of-generation token it sampled, ours counts
    # it: a choice that stopped there gets it back for llama.cpp only; one cut at max_tokens
    # ("length") has nothing to add
    import importlib

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    bench = importlib.import_module("vs_llamacpp")
    answer = {"usage": {"completion_tokens": 15},
              "choices": [{"finish_reason": "stop"}, {"finish_reason": "length"}]}  # fmt: skip
    assert bench.generated_tokens(answer, "llama") == 16
    assert bench.generated_tokens(answer, "ours") == 15
