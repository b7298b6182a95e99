"""The lens report's data and file: quantised attention, sizes, nothing fetched, JSON beside."""

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from decoderlm import CharTokenizer, DecoderLM, ModelConfig
from decoderlm.cli import main
from decoderlm.lens.lens import attention_patterns
from decoderlm.lens.report import (
    build_report,
    quantize_attention,
    unquantize_attention,
    write_report,
)

from conftest import halved_random_model, one_line_error

TEXT = "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n"


def report_of(model, tok, text=TEXT, **kwargs):
    return build_report(model, tok, tok.encode(text), **kwargs)


def test_quantised_attention_is_the_lower_triangle_to_one_255th():
    model = halved_random_model(0)
    idx = torch.randint(0, 65, (1, 9))
    att = attention_patterns(model, idx)[:, 0]  # [L, H, T, T]
    data = quantize_attention(att)
    assert len(data) == 2 * 4 * 9 * 10 // 2
    import base64

    back = unquantize_attention(base64.b64encode(data).decode(), 2, 4, 9)
    np.testing.assert_allclose(back, att.numpy(), atol=0.5 / 255 + 1e-7)


def test_the_seed_model_report_on_128_characters_is_small_and_self_contained(tmp_path):
    # the default preset's shape (3 x 128, 4 heads) with a 128-token context
    tok = CharTokenizer.from_text(TEXT + "abcdefghijklmnopqrstuvwxyz")
    torch.manual_seed(0)
    model = DecoderLM(
        ModelConfig(vocab_size=tok.vocab_size, block_size=128, n_layers=3, n_heads=4, d_model=128)
    )
    text = (TEXT * 2)[:128]
    ids = tok.encode(text)
    corrupted = ids[:-3] + tok.encode("xyz")
    report = build_report(model, tok, ids, corrupted=corrupted)
    html, js = write_report(report, tmp_path / "report.html")
    assert html.stat().st_size < 1_000_000 and js == tmp_path / "report.json"
    page = html.read_text(encoding="utf-8")
    assert not re.search(r"(src|href)\s*=\s*[\"']?(https?:)?//", page)  # nothing fetched
    assert "@import" not in page and "fetch(" not in page and "<link" not in page
    data = json.loads(js.read_text(encoding="utf-8"))
    assert data["tokens"] == [tok.decode([i]) for i in ids]
    assert len(data["surprisal"]["bits"]) == 127
    assert data["patching"]["answer"] and len(data["patching"]["resid_pre"]) == 3
    assert len(data["scores"]["probe"]["induction"]) == 3
    assert len(data["lens"]["top"]) == 4 and len(data["lens"]["top"][0]) == 128
    # the page holds exactly that data
    inline = re.search(r"const R = (.*?);\n", page).group(1).replace("<\\/", "</")
    assert json.loads(inline) == data


def test_a_text_with_a_script_end_tag_cannot_break_the_page(tmp_path):
    text = "a</script><!--"
    tok = CharTokenizer.from_text(text)
    model = halved_random_model(1, vocab_size=tok.vocab_size)
    title = "<script>alert(1)</script>"  # in one string of the data
    html, _ = write_report(report_of(model, tok, text, title=title), tmp_path / "r.html")
    assert html.read_text(encoding="utf-8").count("</script>") == 1


def test_bad_requests_are_refused_in_one_line():
    tok = CharTokenizer.from_text(TEXT)
    model = halved_random_model(2, vocab_size=tok.vocab_size)
    with pytest.raises(ValueError, match="2 to 32 tokens"):
        report_of(model, tok, TEXT)  # 80 characters > block_size 32
    with pytest.raises(ValueError, match="layers must be in 0..1"):
        report_of(model, tok, TEXT[:20], layers=[2])
    with pytest.raises(ValueError, match="as many tokens"):
        report_of(model, tok, TEXT[:20], corrupted=tok.encode(TEXT[:19]))
    only = report_of(model, tok, TEXT[:20], layers=[1])
    assert only["attention"]["layers"] == [1]


RUN = Path(__file__).parents[1] / "fixtures" / "run_v0" / "gpt2-style"  # char model, block 16


def test_decoderlm_inspect_writes_the_report_and_its_json(tmp_path, capsys):
    out = tmp_path / "look" / "r.html"  # its directory is made
    argv = ["inspect", "--run", str(RUN), "--text", "The cat sat on the mat today", "--out"]
    assert (
        main([*argv, str(out), "--layers", "1", "--corrupt", "The dog sat on the mat today"]) == 0
    )
    assert "wrote" in capsys.readouterr().out
    data = json.loads(out.with_suffix(".json").read_text(encoding="utf-8"))
    assert "".join(data["tokens"]) == "The cat sat on t"  # cut to the 16-token context
    assert data["attention"]["layers"] == [1] and data["patching"] is not None
    text_file = tmp_path / "t.txt"
    text_file.write_text("hello there", encoding="utf-8")
    assert (
        main(["inspect", "--run", str(RUN), "--text-file", str(text_file), "--out", str(out)]) == 0
    )
    assert json.loads(out.with_suffix(".json").read_text())["patching"] is None


@pytest.mark.parametrize("flags", [["--dtype", "bf16"], ["--quantize", "int8"]])
def test_decoderlm_inspect_looks_at_the_model_as_it_decodes_at_a_precision(tmp_path, capsys, flags):
    argv = ["inspect", "--run", str(RUN), "--text", "The cat sat on the mat today", "--out"]
    data = {}
    for name, extra in (("float32", []), ("low", flags)):
        assert main([*argv, str(tmp_path / f"{name}.html"), *extra]) == 0
        data[name] = json.loads((tmp_path / f"{name}.json").read_text(encoding="utf-8"))
    assert data["low"]["tokens"] == data["float32"]["tokens"]
    bits = [np.array(data[n]["surprisal"]["bits"], dtype=float) for n in ("low", "float32")]
    assert 0 < np.abs(bits[0] - bits[1]).max() < 0.1  # rounded weights: near, not equal


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--text", "Quixotic"], "Q"),  # not in the run's characters
        (["--text", "abc", "--corrupt", "ab"], "as many tokens"),
        ([], "give one of --text or --text-file"),
        (
            ["--text", "abc", "--text-file", "t.txt"],
            "give only one of --text or --text-file, not both",
        ),
        (["--text", "abc", "--layers", "5"], "--layers must be in 0..1"),
    ],
)
def test_decoderlm_inspect_refuses_bad_input_in_one_line(tmp_path, capsys, extra, message):
    argv = ["inspect", "--run", str(RUN), "--out", str(tmp_path / "r.html"), *extra]
    one_line_error(capsys, argv, message)
    assert not (tmp_path / "r.html").exists()


def test_decoderlm_inspect_refuses_an_out_or_text_file_it_cannot_write_or_read(tmp_path, capsys):
    cases = [
        (["--text", "abc", "--out", str(tmp_path)], "must name the HTML file"),
        (["--text", "abc", "--out", f"{tmp_path / 'r'}/"], "must name the HTML file"),
        (["--text", "abc", "--out", str(tmp_path / "r.json")], "must name the HTML file"),
        (["--text-file", str(tmp_path), "--out", str(tmp_path / "r.html")], "is a directory"),
    ]
    for extra, message in cases:
        one_line_error(capsys, ["inspect", "--run", str(RUN), *extra], message)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "combo",
    [
        dict(pos_encoding="sinusoidal", tie_embeddings=False),
        dict(pos_encoding="rope", norm_position="post", norm="rmsnorm", mlp="swiglu"),
        dict(dtype="bfloat16"),
    ],
)
def test_every_model_option_gets_a_report(combo):
    combo = dict(combo)
    dtype = combo.pop("dtype", None)
    tok = CharTokenizer.from_text(TEXT)
    model = halved_random_model(3, vocab_size=tok.vocab_size, **combo)
    if dtype:
        model = model.to(torch.bfloat16)
    ids = tok.encode(TEXT[:24])
    report = build_report(model, tok, ids, corrupted=tok.encode("A" + TEXT[1:24]))
    assert len(report["lens"]["top"]) == 3 and len(report["surprisal"]["bits"]) == 23
    with torch.no_grad():
        logits = model(torch.tensor([ids]))[0][0].float()
    assert report["lens"]["top"][-1] == [tok.decode([int(i)]) for i in logits.argmax(-1)]
    positions = report["embedding"]["positions"]
    assert (positions is None) == (model.pos_emb is None)
    json.dumps(report, allow_nan=False)


def test_decoderlm_inspect_reads_a_gpt2_checkpoint(tmp_path, capsys):
    from decoderlm.io.hf_gpt2 import save_gpt2

    torch.manual_seed(0)
    model = DecoderLM(
        ModelConfig(vocab_size=50257, block_size=32, n_layers=2, n_heads=2, d_model=16)
    )
    save_gpt2(model, tmp_path / "gpt2")
    out = tmp_path / "r.html"
    text = "When Mary and John went to the store, John gave a drink to"
    assert main(["inspect", "--hf", str(tmp_path / "gpt2"), "--text", text, "--out", str(out)]) == 0
    data = json.loads(out.with_suffix(".json").read_text(encoding="utf-8"))
    assert "".join(data["tokens"]) == text and len(data["embedding"]["labels"]) == 512
    # bits per byte: the same bits over the UTF-8 bytes of tokens 1.. (not over tokens)
    bits = sum(data["surprisal"]["bits"])
    assert data["surprisal"]["bits_per_byte"] == pytest.approx(bits / len(text[4:]), rel=1e-3)


def test_decoderlm_inspect_on_a_grouped_query_run_writes_a_report(tmp_path, capsys):
    # a Llama-shaped run directory with 4 query heads over 2 key/value heads: attention maps
    # and head scores per query head, patching of every query head's output
    tok = CharTokenizer.from_text(TEXT)
    config = dict(pos_encoding="rope", norm="rmsnorm", mlp="swiglu", bias=False, n_kv_heads=2)
    model = halved_random_model(6, vocab_size=tok.vocab_size, **config)
    run = tmp_path / "run"
    model.save_pretrained(run)
    tok.save_pretrained(run)
    out = tmp_path / "r.html"
    argv = ["inspect", "--run", str(run), "--text", TEXT[:20], "--corrupt", "A" + TEXT[1:20]]
    assert main([*argv, "--out", str(out)]) == 0
    data = json.loads(out.with_suffix(".json").read_text(encoding="utf-8"))
    assert data["model"]["n_heads"] == 4 and data["model"]["n_kv_heads"] == 2
    att = unquantize_attention(data["attention"]["data"], 2, 4, 20)
    np.testing.assert_allclose(att.sum(-1), 1.0, atol=20 / 255)
    assert np.array(data["scores"]["probe"]["induction"]).shape == (2, 4)
    assert np.array(data["patching"]["heads"]).shape == (2, 4)
    with torch.no_grad():  # the logit lens's last row is the model's own prediction
        logits = model(torch.tensor([tok.encode(TEXT[:20])]))[0][0]
    assert data["lens"]["top"][-1] == [tok.decode([int(i)]) for i in logits.argmax(-1)]
