"""Fine-tuning (decoderlm.finetune, `decoderlm train --init-from`, `decoderlm merge`): starting
from a run or a transformers GPT-2 directory, freezing, LoRA runs saved as adapters, merging,
exact resume, and bad input refused in one line with nothing written."""

import hashlib
import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from decoderlm.cli import main
from decoderlm.data.corpus import split_ids, windows
from decoderlm.evaluate import evaluate_run
from decoderlm.finetune.trainable import freeze
from decoderlm.io.load import load_model, load_source
from decoderlm.model.lora import is_lora_key
from decoderlm.model.model import DecoderLM
from decoderlm.tokenizers import GPT2Tokenizer
from decoderlm.training.checkpoints import load_trainer_state

from conftest import one_line_error, tiny_model

SYMBOLS = "abcdefghijklmnopqrstuvwxyz .,;!?\n"
SMALL = ["--n-layers", "2", "--d-model", "32", "--n-heads", "2", "--block-size", "16"]
# the 'classic' preset has GPT-2's architecture: the base and its fine-tunings export to the
# GPT-2 format and have a position table to crop
SMALL += ["--preset", "classic"]
QUICK = [
    "--batch-size",
    "4",
    "--log-interval",
    "1",
    "--eval-interval",
    "3",
    "--eval-batches",
    "2",
    "--no-progress",
    "--sample-chars",
    "5",
    "--dtype",
    "float32",
]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Exact-resume comparisons need one thread (float sums depend on the thread count)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def text_file(path, seed, n=3000, symbols=SYMBOLS):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, len(symbols), (n,), generator=g).tolist()
    path.write_text("".join(symbols[i] for i in ids), encoding="utf-8")
    return path


def tree_hashes(directory):
    """sha256 of every file under `directory`, by relative path."""
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A small character model trained 3 steps; its files' hashes are checked at the end."""
    root = tmp_path_factory.mktemp("base")
    data = text_file(root / "pretrain.txt", 0)
    out = root / "run"
    argv = ["train", "--data", data, "--out", out, *SMALL, *QUICK, "--max-steps", "3"]
    assert main(list(map(str, argv))) == 0
    before = tree_hashes(out)
    yield out
    assert tree_hashes(out) == before  # no fine-tuning run modified its source


@pytest.fixture(scope="module")
def new_text(tmp_path_factory):
    """Fine-tuning text with two characters the base vocabulary lacks ('X', 'Y')."""
    return text_file(tmp_path_factory.mktemp("ft") / "new.txt", 1, symbols=SYMBOLS + "XY")


def finetune(base, data, out, *flags):
    argv = ["train", "--init-from", base, "--data", data, "--out", out, *QUICK, *flags]
    return main(list(map(str, argv)))


def records(run):
    lines = (run / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    return [
        {k: v for k, v in json.loads(x).items() if k not in ("elapsed_s", "tokens_per_s", "mfu")}
        for x in lines
    ]


@pytest.fixture(scope="module")
def lora_run(base, new_text, tmp_path_factory):
    out = tmp_path_factory.mktemp("lora") / "run"
    flags = ["--lora-rank", "4", "--lora-alpha", "8", "--lora-targets", "qkv,proj,fc"]
    assert finetune(base, new_text, out, *flags, "--max-steps", "6", "--lr", "1e-2", "--merge") == 0
    return out


def test_a_lora_run_saves_its_adapters_alone_and_records_its_source(base, lora_run, new_text):
    assert (lora_run / "adapter.safetensors").is_file()
    assert not (lora_run / "model.safetensors").exists()
    adapters = load_file(str(lora_run / "adapter.safetensors"))
    assert adapters and all(is_lora_key(k) for k in adapters)
    config = json.loads((lora_run / "config.json").read_text())
    digest = hashlib.sha256((base / "model.safetensors").read_bytes()).hexdigest()
    assert config["init_from"] == {
        "path": str(base.resolve()),
        "kind": "decoderlm",
        "sha256": digest,
    }
    assert config["preset"] == "finetune" and config["lora"]["rank"] == 4
    # the data were encoded with the source's tokenizer, unknown characters counted
    assert config["data_spec"]["unknown"] == "unk"
    assert (lora_run / "tokenizer.json").read_text() == (base / "tokenizer.json").read_text()
    text = new_text.read_text(encoding="utf-8")
    unknown = text.count("X") + text.count("Y")
    assert f"{unknown:,} of them outside the vocabulary" in config["data"]
    report = evaluate_run(lora_run, split="train")
    report_val = evaluate_run(lora_run)
    assert report["unknown_characters"] + report_val["unknown_characters"] == unknown


def test_the_trained_adapters_change_the_model_and_merging_keeps_its_logits(
    base, lora_run, tmp_path
):
    adapted = load_model(lora_run, merge=False)
    base_model = DecoderLM.from_pretrained(base)
    idx = torch.randint(0, base_model.config.vocab_size, (2, 16))
    assert not torch.allclose(adapted(idx)[0], base_model(idx)[0], atol=1e-4)  # it trained
    merged_dir = tmp_path / "merged"
    assert main(["merge", "--run", str(lora_run), "--out", str(merged_dir)]) == 0
    merged = DecoderLM.from_pretrained(merged_dir)  # an ordinary model directory
    assert (merged(idx)[0] - adapted(idx)[0]).abs().max() < 1e-5
    assert (load_model(lora_run)(idx)[0] - adapted(idx)[0]).abs().max() < 1e-5
    with pytest.raises(ValueError, match="holds LoRA adapters over a base model"):
        DecoderLM.from_pretrained(lora_run)  # points to load_model and `decoderlm merge`
    at_the_end = DecoderLM.from_pretrained(lora_run / "merged")  # written by train --merge
    assert (at_the_end(idx)[0] - adapted(idx)[0]).abs().max() < 1e-5
    config = json.loads((merged_dir / "config.json").read_text())
    assert "lora" not in config and config["merged_from"]["run"] == str(lora_run.resolve())


def test_block_size_crops_the_source_context_for_full_and_lora_runs(base, new_text, tmp_path):
    """--block-size below the source's crops it (nanoGPT's crop_block_size): the fine-tuned
    model has 8 positions, and a LoRA run over the uncropped base loads cropped too."""
    base_model = DecoderLM.from_pretrained(base)
    idx = torch.randint(0, base_model.config.vocab_size, (2, 8))
    for flags in ([], ["--lora-rank", "2"]):
        out = tmp_path / f"crop{len(flags)}"
        assert finetune(base, new_text, out, "--block-size", "8", "--max-steps", "1", *flags) == 0
        assert json.loads((out / "config.json").read_text())["model"]["block_size"] == 8
        model = load_model(out, merge=False)
        assert model.config.block_size == 8 and model.pos_emb.weight.shape[0] == 8
        if flags:  # LoRA's B starts at zero: one step of lr 3e-4 moves little
            assert (model(idx)[0] - base_model(idx)[0]).abs().max() < 1e-2


@pytest.mark.parametrize("which", ["adapters", "merged"])
def test_sample_eval_and_the_gpt2_export_work_on_adapters_and_merged(
    lora_run, tmp_path, capsys, which
):
    transformers = pytest.importorskip("transformers")
    from decoderlm.io.hf_gpt2 import save_gpt2

    run = lora_run
    if which == "merged":
        run = tmp_path / "merged"
        assert main(["merge", "--run", str(lora_run), "--out", str(run)]) == 0
    assert main(["sample", "--run", str(run), "--max-new-tokens", "5", "--seed", "0"]) == 0
    capsys.readouterr()
    assert main(["eval", "--run", str(run), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["tokens_scored"] > 0
    model = load_model(run)
    save_gpt2(model, tmp_path / "hf")
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    idx = torch.randint(0, model.config.vocab_size, (1, 16))
    assert (hf(idx).logits - model(idx)[0]).abs().max() < 1e-5


@pytest.mark.parametrize(
    "how, weights",
    [
        (["--lora-rank", "2", "--lora-dropout", "0.2"], "adapter.safetensors"),
        (["--freeze", "embeddings,blocks:1"], "model.safetensors"),
    ],
)
def test_resume_with_lora_or_frozen_parameters_is_bitwise_exact(
    base, new_text, tmp_path, how, weights
):
    flags = [*how, "--dropout", "0.1", "--lr", "1e-2", "--decay-steps", "6"]
    flags += ["--checkpoint-interval", "3"]
    a, b = tmp_path / "a", tmp_path / "b"
    assert finetune(base, new_text, a, *flags, "--max-steps", "6") == 0
    assert finetune(base, new_text, b, *flags, "--max-steps", "3") == 0
    assert main(["train", "--resume", str(b), "--max-steps", "6", "--no-progress"]) == 0
    assert records(a) == records(b)
    wa, wb = (load_file(str(r / weights)) for r in (a, b))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    start = load_file(str(base / "model.safetensors"))
    assert any(k in start and not torch.equal(v, start[k]) for k, v in wa.items()) or any(
        v.abs().sum() > 0 for k, v in wa.items() if k.endswith("lora_B")
    )


def test_frozen_parameters_stay_bitwise_and_are_not_in_the_optimizer(base, new_text, tmp_path):
    out = tmp_path / "frozen"
    assert finetune(base, new_text, out, "--freeze", "embeddings,blocks:0", "--max-steps", "3") == 0
    before, after = (load_file(str(d / "model.safetensors")) for d in (base, out))
    frozen = [k for k in before if k.startswith(("tok_emb", "pos_emb", "blocks.0."))]
    trained = [k for k in before if k not in frozen]
    assert frozen and all(torch.equal(before[k], after[k]) for k in frozen)
    assert trained and all(not torch.equal(before[k], after[k]) for k in trained)
    state = load_trainer_state(sorted((out / "checkpoints").iterdir())[-1])
    in_optimizer = set(state["optimizer"]["state"])
    assert in_optimizer == set(trained)


def test_params_and_the_start_line_show_trainable_against_total(base, lora_run, capsys):
    assert main(["params", "--run", str(lora_run), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    d, L, r = 32, 2, 4  # SMALL: d_model 32, d_ff 128; qkv, attn.proj, mlp.fc, mlp.proj
    closed_form = L * r * ((d + 3 * d) + (d + d) + (d + 4 * d) + (4 * d + d))
    assert report["trainable"]["trainable"] == report["trainable"]["adapters"] == closed_form
    assert report["trainable"]["total"] == report["parameters"]["total"] + closed_form
    assert main(["params", "--run", str(base), "--freeze", "blocks:1"]) == 0
    assert "trainable:" in capsys.readouterr().out


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_init_from_a_transformers_gpt2_trains_from_its_loss(tmp_path, fmt, capsys):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_embd=32, n_layer=2, n_head=2, n_positions=64, resid_pdrop=0.1
    )
    hf = transformers.GPT2LMHeadModel(config).eval()
    src = tmp_path / "gpt2"
    hf.save_pretrained(src, safe_serialization=fmt == "safetensors")
    words = "the quick brown fox jumps over the lazy dog and then runs far away. "
    (tmp_path / "text.txt").write_text(words * 100, encoding="utf-8")
    out = tmp_path / "run"
    argv = ["train", "--init-from", str(src), "--data", str(tmp_path / "text.txt")]
    argv += ["--out", str(out), *QUICK, "--max-steps", "1", "--dropout", "0", "--seed", "3"]
    assert main(argv) == 0
    first_loss = records(out)[0]["train_loss"]
    # the same batch through transformers: the data encoded with GPT-2's BPE, split 90/10,
    # the window starts drawn by the trainer's generator seeded with --seed
    ids = torch.tensor(GPT2Tokenizer().encode(words * 100))
    train_ids, _ = split_ids(ids, 0.1)
    starts = torch.randint(len(train_ids) - 64, (4,), generator=torch.Generator().manual_seed(3))
    x, y = windows(train_ids, starts, 64)
    with torch.no_grad():
        logits = hf(x).logits
    expected = F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1)).item()
    assert first_loss == pytest.approx(expected, rel=1e-5)
    assert json.loads((out / "config.json").read_text())["init_from"]["kind"] == "hf"
    assert (
        load_source(src).info["sha256"]
        == json.loads((out / "config.json").read_text())["init_from"]["sha256"]
    )


class MakesMarker:
    """An object whose unpickling creates a file."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_bad_input_is_one_line_and_writes_nothing(base, lora_run, new_text, tmp_path, capsys):
    out = tmp_path / "never"
    not_a_model = tmp_path / "notes"
    not_a_model.mkdir()
    (not_a_model / "notes.txt").write_text("hello")
    llama = tmp_path / "llama"
    llama.mkdir()
    (llama / "config.json").write_text(json.dumps({"model_type": "llama"}))
    cases = [
        (["--init-from", str(not_a_model)], "is not a model"),
        (["--init-from", str(new_text)], "is not a model"),
        (["--init-from", str(llama)], "is not a model"),  # config.json without weights
        (["--init-from", str(base), "--n-layers", "3"], "--n-layers 3 (the source has n_layers 2)"),
        (["--init-from", str(base), "--block-size", "32"], "cannot crop the context to 32"),
        (["--init-from", str(base), "--lora-rank", "2", "--lora-targets", "nope"], "'nope'"),
        (["--init-from", str(base), "--lora-rank", "0"], "lora_rank must be a positive"),
        (["--init-from", str(base), "--freeze", "blocks:1-5"], "has 2 blocks"),
        (["--init-from", str(base), "--freeze", "everything"], "is not a group"),
        (["--lora-rank", "2"], "give --init-from"),
        (["--init-from", str(base), "--lora-alpha", "4"], "--lora-alpha set LoRA adapters"),
        (["--init-from", str(base), "--lora-dropout", "0.1"], "give --lora-rank R"),
        (["--init-from", str(base), "--resume", str(lora_run)], "drop --init-from"),
    ]
    for flags, fragment in cases:
        argv = ["train", "--data", str(new_text), "--out", str(out), *QUICK, *flags]
        one_line_error(capsys, argv, fragment)
        assert not out.exists()
    one_line_error(capsys, ["merge", "--run", str(base), "--out", str(out)], "no LoRA adapters")
    missing = ["merge", "--run", str(tmp_path / "nope"), "--out", str(out)]
    one_line_error(capsys, missing, "is not a run directory")
    assert not out.exists()
    # a pytorch_model.bin whose unpickling would run code is refused, never executed
    unsafe, marker = tmp_path / "unsafe", tmp_path / "marker"
    unsafe.mkdir()
    shape = dict(vocab_size=11, n_positions=8, n_layer=1, n_head=1, n_embd=4)
    (unsafe / "config.json").write_text(json.dumps({"model_type": "gpt2", **shape}))
    torch.save({"x": MakesMarker(marker)}, unsafe / "pytorch_model.bin")
    argv = ["train", "--init-from", str(unsafe), "--data", str(new_text), "--out", str(out)]
    one_line_error(capsys, argv, "could not be read as plain tensors")
    assert not marker.exists() and not out.exists()
    assert not out.exists()
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "x").write_text("x")
    one_line_error(capsys, ["merge", "--run", str(lora_run), "--out", str(occupied)], "not empty")
    assert sorted(p.name for p in occupied.iterdir()) == ["x"]


def both(*modules):
    """The weight and bias names of each module."""
    return {f"{m}.{w}" for m in modules for w in ("weight", "bias")}


@pytest.mark.parametrize(
    "spec, frozen",
    [
        ("embeddings", {"tok_emb.weight", "pos_emb.weight", "lm_head.weight"}),  # tied head
        ("norms", both(*(f"blocks.{i}.{n}" for i in (0, 1) for n in ("ln_1", "ln_2")), "ln_f")),
        ("blocks:1", {k for k in tiny_model().state_dict() if k.startswith("blocks.1.")}),
        ("blocks.*.attn.qkv.*", both("blocks.0.attn.qkv", "blocks.1.attn.qkv")),
    ],
)
def test_the_freeze_grammar(spec, frozen):
    model = tiny_model()
    freeze(model, spec)
    names = {n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    assert names == frozen


def test_presets_lists_the_finetune_defaults(capsys):
    assert main(["presets"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("finetune"))
    assert "--init-from" in line and "3e-4" in line


def test_a_lora_merge_run_stopped_and_resumed_with_its_printed_line_writes_merged(
    base, new_text, tmp_path, monkeypatch, capsys
):
    """A LoRA run started with --merge and stopped like Ctrl-C after 2 of 4 steps records
    merge; its printed `resume with:` line alone finishes it with merged/, the model of the
    adapters folded in."""
    import decoderlm.training.loop as loop

    out = tmp_path / "lora"
    steps = []
    monkeypatch.setattr(loop, "agree_across_ranks", lambda *a: steps.append(1) or len(steps) >= 2)
    assert finetune(base, new_text, out, "--lora-rank", "2", "--max-steps", "4", "--merge") == 0
    monkeypatch.undo()
    printed = capsys.readouterr().out
    line = next(x for x in printed.splitlines() if x.startswith("resume with: "))
    assert line == f"resume with: decoderlm train --resume {out}" and not (out / "merged").exists()
    assert main(line.removeprefix("resume with: decoderlm ").split()) == 0
    assert "--merge" in capsys.readouterr().err.splitlines()[0]
    merged = DecoderLM.from_pretrained(out / "merged")
    idx = torch.randint(0, merged.config.vocab_size, (2, 16))
    assert (merged(idx)[0] - load_model(out)(idx)[0]).abs().max() < 1e-5


def test_a_moved_project_with_a_lora_run_and_its_base_inside_still_loads(
    base, new_text, tmp_path, capsys, monkeypatch
):
    """A LoRA run trained in a project folder (the working directory) over a base inside it
    records the base relative to the run (and absolutely); moved, the project's run loads,
    resumes and samples over the moved base. A base moved elsewhere is named in one line
    with --base, which then finds it; a checkpoint is never set aside for a missing base."""
    import shutil

    project = tmp_path / "project"
    shutil.copytree(base, project / "base")
    monkeypatch.chdir(project)
    run = project / "runs" / "lora"
    assert finetune("base", new_text, "runs/lora", "--lora-rank", "2", "--max-steps", "2") == 0
    monkeypatch.chdir(tmp_path)
    record = json.loads((run / "config.json").read_text())["init_from"]
    assert record["path"] == str((project / "base").resolve())
    assert record["relative_path"] == "../../base"
    idx = torch.randint(0, 20, (1, 8))
    want = load_model(run)(idx)[0]
    moved = tmp_path / "moved"
    project.rename(moved)
    run = moved / "runs" / "lora"
    assert torch.equal(load_model(run)(idx)[0], want)
    assert main(["sample", "--run", str(run), "--max-new-tokens", "3", "--no-verify"]) == 0
    assert main(["train", "--resume", str(run), "--max-steps", "3", "--no-progress"]) == 0
    record = json.loads((run / "config.json").read_text())["init_from"]
    assert record["path"] == str((moved / "base").resolve())  # recorded anew where found

    elsewhere = tmp_path / "models" / "base"
    (moved / "base").rename(elsewhere.parent.mkdir() or elsewhere)
    capsys.readouterr()
    one_line_error(
        capsys,
        ["sample", "--run", str(run), "--max-new-tokens", "3"],
        f"the base model of {run}, {moved / 'base'}",
        "--base PATH",
    )
    one_line_error(capsys, ["train", "--resume", str(run), "--max-steps", "4"], "--base PATH")
    assert list_checkpoints_names(run) == ["step-00000002", "step-00000003"]  # none set aside
    argv = ["sample", "--run", str(run), "--base", str(elsewhere), "--max-new-tokens", "3"]
    assert main(argv) == 0
    merged = tmp_path / "merged"
    assert main(["merge", "--run", str(run), "--out", str(merged), "--base", str(elsewhere)]) == 0
    flags = ["--max-steps", "4", "--no-progress", "--base", str(elsewhere)]
    assert main(["train", "--resume", str(run), *flags]) == 0
    record = json.loads((run / "config.json").read_text())["init_from"]
    assert record["path"] == str(elsewhere.resolve())  # tmp_path, the working directory:
    assert record["relative_path"] == "../../../models/base"
    load_model(run)  # from the place now recorded, without --base
    capsys.readouterr()
    one_line_error(capsys, ["sample", "--run", str(base), "--base", str(elsewhere)], "drop --base")
    resume = ["train", "--resume", str(base), "--base", str(elsewhere)]
    one_line_error(capsys, resume, "has no adapters (drop --base)")  # nothing set aside


def list_checkpoints_names(run):
    return sorted(p.name for p in (run / "checkpoints").iterdir())
