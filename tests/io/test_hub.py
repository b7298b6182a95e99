"""--hf OWNER/NAME: a Hub id read from the Hugging Face cache (its own layout, built here)
offline, downloaded with the files decoderlm reads online (snapshot_download mocked: no
network in tests), and one line when it is neither cached nor reachable."""

from __future__ import annotations

import shutil

import pytest
import torch
from hf_family import save_family

from decoderlm.cli import main
from decoderlm.errors import UserError
from decoderlm.io.hub import HUB_FILES, hub_directory, is_hub_id
from decoderlm.io.load import load_from_flags

huggingface_hub = pytest.importorskip("huggingface_hub")
constants = pytest.importorskip("huggingface_hub.constants")
errors = pytest.importorskip("huggingface_hub.errors")
REPO = "HuggingFaceTB/SmolLM2-135M"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty Hugging Face cache, offline."""
    root = tmp_path / "hub-cache"
    root.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(root))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return root


def _fill(cache, source) -> None:
    """Put the files of `source` in the cache as huggingface_hub stores a snapshot of REPO."""
    repo = cache / ("models--" + REPO.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    shutil.copytree(source, repo / "snapshots" / COMMIT)


def test_a_cached_model_loads_offline(tmp_path, cache):
    theirs = save_family(tmp_path / "model", "llama")
    _fill(cache, tmp_path / "model")
    model, tokenizer = load_from_flags(hf=REPO)
    assert model.config.n_kv_heads == 2 and tokenizer.vocab_size == model.config.vocab_size
    prompt = torch.tensor([[5, 17, 42, 100]])
    with torch.no_grad():
        assert (model(prompt)[0] - theirs(prompt).logits).abs().max() < 1e-4


def test_offline_without_the_model_cached_is_one_line_naming_a_folder(cache, capsys):
    with pytest.raises(UserError) as caught:
        hub_directory(REPO)
    message = str(caught.value)
    assert "HF_HUB_OFFLINE is set" in message and "not in the Hugging Face cache" in message
    assert "--hf DIR" in message and "\n" not in message
    assert main(["sample", "--hf", REPO, "--prompt", "Hi"]) == 2
    assert capsys.readouterr().err.strip().count("\n") == 0


def test_unreachable_without_the_model_cached_says_so(monkeypatch):
    def unreachable(*args, **kwargs):
        raise errors.LocalEntryNotFoundError("connection error")

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", unreachable)
    with pytest.raises(UserError, match="the Hub cannot be reached .* --hf DIR"):
        hub_directory(REPO)


def test_online_downloads_only_the_files_decoderlm_reads(tmp_path, monkeypatch):
    save_family(tmp_path / "model", "qwen2")
    calls = []

    def download(repo_id, **kwargs):
        calls.append((repo_id, kwargs))
        return str(tmp_path / "model")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", download)
    model, _ = load_from_flags(hf=REPO)
    assert model.config.qkv_bias
    assert calls == [(REPO, {"allow_patterns": HUB_FILES})]


def test_an_existing_folder_is_never_a_hub_id(tmp_path, monkeypatch):
    (tmp_path / "owner" / "name").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert not is_hub_id("owner/name") and is_hub_id("owner/other")
    assert not is_hub_id("/abs/path") and not is_hub_id("a/../b") and not is_hub_id("x")
