"""Fine-tuning a Llama-family model (`decoderlm train --init-from` a transformers Llama
directory): LoRA on q and v with grouped-query attention, its first loss against transformers',
merging, and the source's own tokenizer kept."""

import json

import pytest
import torch
import torch.nn.functional as F

from decoderlm.cli import main
from decoderlm.data.corpus import split_ids, windows
from decoderlm.io.load import load_model, load_model_and_tokenizer, load_run, load_source
from decoderlm.tokenizers.hf_json import byte_to_unicode

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

WORDS = "the quick brown fox jumps over the lazy dog and then runs far away. "
KV_HEADS = 2  # grouped-query attention: two query heads per key/value head
QUICK = ["--batch-size", "4", "--log-interval", "1", "--eval-interval", "3", "--eval-batches", "1"]
QUICK += ["--no-progress", "--sample-chars", "5", "--dtype", "float32", "--dropout", "0"]


def _tokenizer_library():
    """A byte-level BPE (the 256 byte symbols, a few merges, <s> and </s>): 264 ids."""
    symbols = byte_to_unicode()
    vocab = {symbols[b]: b for b in range(256)}
    merges = [("t", "h"), ("th", "e"), ("Ġ", "the"), ("o", "w"), ("e", "r"), ("Ġ", "f")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    vocab["<s>"], vocab["</s>"] = len(vocab), len(vocab) + 1
    library = tokenizers.Tokenizer(tokenizers.models.BPE(vocab, merges))
    library.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    library.decoder = tokenizers.decoders.ByteLevel()
    library.add_special_tokens(
        [tokenizers.AddedToken(s, normalized=False) for s in ("<s>", "</s>")]
    )
    return library


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """A random tiny LlamaForCausalLM (2 layers, d_model 32, 4 query heads, 2 key/value heads,
    rope base 1e5, untied) with its tokenizer, as transformers saves it, and the text."""
    directory = tmp_path_factory.mktemp("llama")
    library = _tokenizer_library()
    library.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    config = transformers.LlamaConfig(
        vocab_size=library.get_vocab_size(), hidden_size=32, intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=KV_HEADS, rope_theta=1e5,
        max_position_embeddings=64, tie_word_embeddings=False, eos_token_id=263, bos_token_id=262,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    (directory.parent / "text.txt").write_text(WORDS * 60, encoding="utf-8")
    return directory


def test_lora_on_q_and_v_trains_from_transformers_loss_and_merges(llama_dir, tmp_path, capsys):
    text = llama_dir.parent / "text.txt"
    run, merged = tmp_path / "lora", tmp_path / "merged"
    argv = ["train", "--init-from", str(llama_dir), "--data", str(text), "--out", str(run)]
    argv += [*QUICK, "--block-size", "32", "--max-steps", "3", "--seed", "3"]
    assert main([*argv, "--lora-rank", "2", "--lora-targets", "q,v", "--lr", "1e-2"]) == 0
    config = json.loads((run / "config.json").read_text())
    assert config["init_from"]["kind"] == "hf" and config["model"]["n_kv_heads"] == KV_HEADS
    assert config["lora"]["modules"] == [f"blocks.{i}.attn.qkv.{p}" for i in (0, 1) for p in "qv"]
    # the first step's loss is transformers' loss on the same batch, the text encoded with the
    # directory's own tokenizer (the `tokenizers` library's ids)
    first = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])["train_loss"]
    ids = torch.tensor(_tokenizer_library().encode(WORDS * 60).ids)
    train_ids, _ = split_ids(ids, 0.1)
    starts = torch.randint(len(train_ids) - 32, (4,), generator=torch.Generator().manual_seed(3))
    x, y = windows(train_ids, starts, 32)
    hf = transformers.LlamaForCausalLM.from_pretrained(llama_dir).eval()
    with torch.no_grad():
        logits = hf(x).logits
    expected = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1)).item()
    assert first == pytest.approx(expected, rel=1e-4)
    # the adapters moved, k's rows stayed; the merged model computes the adapted one
    adapted = load_run(run, merge=False)
    layer = adapted.blocks[0].attn.qkv
    assert layer.lora_B.abs().max() > 0 and layer.rows == {
        "q": (0, 32),
        "v": (32 + 8 * KV_HEADS, 32 + 16 * KV_HEADS),
    }
    assert main(["merge", "--run", str(run), "--out", str(merged)]) == 0
    model, tokenizer = load_model_and_tokenizer(merged)
    assert tokenizer.encode(WORDS) == _tokenizer_library().encode(WORDS).ids
    probe = x[:2]
    with torch.no_grad():
        want = adapted(probe)[0]
        assert (model(probe)[0] - want).abs().max() < 1e-5
        assert (load_model(run)(probe)[0] - want).abs().max() < 1e-5
        base = load_source(llama_dir).model
        assert (base(probe)[0] - want).abs().max() > 1e-4  # the fine-tune changed something


@pytest.mark.parametrize("how", [["--freeze", "embeddings,blocks:0"], []])
def test_full_and_frozen_fine_tunes_of_a_llama_directory(llama_dir, tmp_path, how):
    text = llama_dir.parent / "text.txt"
    run = tmp_path / "run"
    argv = ["train", "--init-from", str(llama_dir), "--data", str(text), "--out", str(run)]
    assert main([*argv, *QUICK, "--block-size", "32", "--max-steps", "2", *how]) == 0
    before, after = load_source(llama_dir).model.state_dict(), load_model(run).state_dict()
    frozen = {k for k in before if k.startswith(("tok_emb", "blocks.0."))} if how else set()
    assert all(torch.equal(before[k], after[k]) for k in frozen)
    assert not torch.equal(before["blocks.1.mlp.gate.weight"], after["blocks.1.mlp.gate.weight"])
