"""The metrics of decoderlm.training.metrics: grad_norm, mfu and val_bpb against hand
computations, the CSV and TensorBoard sinks, and the seed-notebook run unchanged by them."""

import copy
import csv
import importlib.util
import json
import math

import pytest
import torch

from decoderlm import ByteTokenizer, CharTokenizer, DecoderLM, ModelConfig, TrainConfig
from decoderlm.presets import get_preset
from decoderlm.training import metrics
from decoderlm.training.loop import micro_batches, train, train_step
from decoderlm.training.metrics import CSV_COLUMNS, TAGS, RecordExtras, bytes_per_token
from decoderlm.training.optim import configure_optimizer
from decoderlm.training.parallel import DistInfo, Parallelized

from conftest import one_line_error, quiet, tiny_config

DATA = torch.randint(0, 65, (3000,), generator=torch.Generator().manual_seed(0))


def _step(model, cfg, grad_norms):
    par = Parallelized(model, model.device, model)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    batches = micro_batches(DATA, torch.Generator().manual_seed(0), cfg, DistInfo(), 32)
    return train_step(
        par, configure_optimizer(model, cfg), scaler, batches, cfg, grad_norms=grad_norms
    )


def _hand_norm(model, cfg):
    """sqrt of the sum of every squared gradient entry, from a separate backward pass."""
    copy_ = copy.deepcopy(model)
    x, y = next(micro_batches(DATA, torch.Generator().manual_seed(0), cfg, DistInfo(), 32))
    copy_(x, y)[1].backward()
    return math.sqrt(sum((p.grad.double() ** 2).sum().item() for p in copy_.parameters()))


@pytest.mark.parametrize("clip", [None, 0.01])
def test_grad_norm_is_the_norm_before_clipping_and_leaves_an_unclipped_step_unchanged(clip):
    cfg = TrainConfig.from_dict(dict(batch_size=4, lr=1e-3, grad_clip=clip))
    torch.manual_seed(0)
    model = DecoderLM(tiny_config()).train()
    expected = _hand_norm(model, cfg)
    twin = copy.deepcopy(model)
    norms = []
    _step(model, cfg, norms)
    assert norms[0].item() == pytest.approx(expected, rel=1e-5)
    _step(twin, cfg, None)  # the same step without asking for the norm
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(a, b)


def test_mfu_is_training_flops_times_tokens_per_s_over_the_peak():
    config = tiny_config()
    extras = RecordExtras(
        config, TrainConfig.from_dict({"peak_tflops": 2.0}), torch.device("cpu"), world_size=2
    )
    N = DecoderLM(config).num_parameters(non_embedding=True)  # tied: the matmul parameters
    per_token = 3 * (2 * N + 2 * config.n_layers * config.block_size * config.d_model)
    record = extras.add({"step": 1, "tokens_per_s": 1000.0}, grad_norm=0.5)
    assert record["mfu"] == pytest.approx(per_token * 1000.0 / (2 * 2.0e12))
    assert record["grad_norm"] == 0.5 and "val_bpb" not in record
    # the tiny model at 1,000 tokens/s on a 1e12 FLOP/s peak: 650,112 FLOPs per token (the
    # causal, Kaplan attention term) give an MFU of 6.50112e-4
    one = RecordExtras(config, TrainConfig.from_dict({"peak_tflops": 1.0}), torch.device("cpu"))
    assert one.add({"tokens_per_s": 1000.0})["mfu"] == pytest.approx(6.50112e-4)


def test_gpu_peaks_come_from_the_table_and_the_cpu_peak_is_measured_once(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    assert metrics.peak_flops(torch.device("cuda"), "bfloat16") == 989e12
    assert metrics.peak_flops(torch.device("cuda"), "bfloat16", given_tflops=100.0) == 100e12
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some New GPU")
    assert metrics.peak_flops(torch.device("cuda"), "bfloat16") is None
    peak = metrics.peak_flops(torch.device("cpu"), "float32")
    assert math.isfinite(peak) and peak > 0
    measured = metrics.measured_matmul_peak.cache_info().misses
    assert metrics.peak_flops(torch.device("cpu"), "float32") == peak
    assert metrics.measured_matmul_peak.cache_info().misses == measured  # not measured again


def test_val_bpb_is_bits_per_token_over_utf8_bytes_per_token():
    text = "héllo wörld"  # 11 characters, 13 UTF-8 bytes
    char = CharTokenizer(sorted(set(text)))
    assert bytes_per_token(char, char.encode(text)) == pytest.approx(13 / 11)
    byte = ByteTokenizer()
    assert bytes_per_token(byte, byte.encode(text)) == 1.0
    extras = RecordExtras(tiny_config(), TrainConfig(), torch.device("meta"), 1, 13 / 11)
    record = extras.add({"step": 1, "val_loss": 2.0, "val_bpc": 2.0 / math.log(2)})
    assert record["val_bpb"] == pytest.approx(2.0 / math.log(2) * 11 / 13)
    assert "mfu" not in record  # no known peak on this device


def test_csv_and_tensorboard_sinks_hold_the_records(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = TrainConfig.from_dict(dict(
        batch_size=4, max_steps=6, log_interval=2, eval_interval=3, eval_batches=2,
        log=["csv", "tensorboard"], checkpoint_interval=0, sample_chars=0,
    ))  # fmt: skip
    torch.manual_seed(0)
    model = DecoderLM(tiny_config())
    train(model, cfg, DATA[:2500], DATA[2500:], tmp_path, False, log=quiet, val_bytes_per_token=1.5)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["step"] for r in records] == [2, 3, 4, 6]
    assert all("grad_norm" in r and "mfu" in r for r in records)
    with open(tmp_path / "metrics.csv", newline="") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
    assert tuple(reader.fieldnames) == CSV_COLUMNS
    for row, record in zip(rows, records, strict=True):
        for key in CSV_COLUMNS:
            assert (row[key] == "") == (key not in record), key
            if key in record:
                assert float(row[key]) == record[key]
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert set(events.Tags()["scalars"]) == set(TAGS.values())
    for key, tag in TAGS.items():
        logged = [(r["step"], r[key]) for r in records if key in r]
        read = [(e.step, e.value) for e in events.Scalars(tag)]
        assert [s for s, _ in read] == [s for s, _ in logged], tag
        assert [v for _, v in read] == pytest.approx([v for _, v in logged], rel=1e-6), tag
    bpb = [r for r in records if "val_loss" in r][0]
    assert bpb["val_bpb"] == pytest.approx(bpb["val_bpc"] / 1.5)


def test_a_sink_without_its_package_is_one_line(capsys, tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "tensorboard" else real(name, *a),
    )
    text = tmp_path / "corpus.txt"
    text.write_text("abcdefgh" * 1000, encoding="utf-8")
    argv = ["train", "--data", str(text), "--out", str(tmp_path / "run"), "--log", "tensorboard"]
    one_line_error(capsys, argv, "pip install 'decoderlm[tensorboard]'")
    assert not (tmp_path / "run").exists()


def test_seed_notebook_run_is_unchanged():
    """The preset's settings leave every recipe option off, and train() computes exactly what
    the seed notebook's loop does: plain AdamW at a constant lr, no clipping."""
    preset = get_preset("seed-notebook")
    config = ModelConfig.from_dict(preset.model)
    cfg = TrainConfig.from_dict({**preset.train, "max_steps": 3, "eval_interval": 3})
    assert (config.mlp, config.qk_norm, config.zero_init_proj, config.logit_softcap) == (
        "gelu", False, False, None,
    )  # fmt: skip
    recipe = (cfg.optim.optimizer, cfg.steps.schedule, cfg.optim.grad_clip, cfg.logging.log)
    assert recipe == ("adamw", "constant", None, [])
    assert (cfg.compute.dtype, cfg.optim.lr, cfg.optim.weight_decay) == ("float32", 2e-4, 1e-2)
    data = torch.randint(0, 139, (3000,), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(cfg.data.seed)
    notebook = DecoderLM(config).train()
    torch.manual_seed(cfg.data.seed)
    trained = DecoderLM(config)
    decay = [p for p in notebook.parameters() if p.dim() >= 2]
    flat = [p for p in notebook.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 1e-2}, {"params": flat, "weight_decay": 0.0}],
        lr=2e-4,
        fused=True,
    )
    g, losses = torch.Generator().manual_seed(cfg.data.seed), []
    for _ in range(3):
        starts = torch.randint(len(data[:2700]) - 96, (32,), generator=g)
        x = torch.stack([data[s : s + 96] for s in starts])
        y = torch.stack([data[s + 1 : s + 97] for s in starts])
        loss = notebook(x, y)[1]
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    result = train(trained, cfg, data[:2700], data[2700:], None, False, log=quiet)
    assert [r["train_loss"] for r in result.metrics] == [sum(losses) / 3]
    for a, b in zip(notebook.parameters(), trained.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_bfloat16_training_records_grad_norm_and_mfu():
    cfg = TrainConfig.from_dict(
        dict(batch_size=4, max_steps=4, log_interval=2, eval_interval=4, dtype="bfloat16")
    )
    torch.manual_seed(0)
    model = DecoderLM(tiny_config()).cuda()
    result = train(model, cfg, DATA[:2500].cuda(), DATA[2500:].cuda(), None, False, log=quiet)
    for record in result.metrics:
        assert math.isfinite(record["grad_norm"]) and record["grad_norm"] > 0
        known = metrics.peak_flops(torch.device("cuda"), "bfloat16") is not None
        assert ("mfu" in record) == known
