"""Our hook points against TransformerLens itself: the same GPT-2 weights in a DecoderLM and
in TransformerLens's bridge over transformers' GPT2LMHeadModel (raw weights: no LayerNorm
folding, no centring), every hook name both have gives the same activation (shape and
values), and a patching experiment written once, TransformerLens-style, gives the same
logits in both."""

import pytest
import torch

pytest.importorskip("transformer_lens", reason="transformer-lens is not installed (oracles extra)")
transformers = pytest.importorskip("transformers", reason="transformers is not installed")

from decoderlm import DecoderLM, ModelConfig  # noqa: E402
from decoderlm.io.hf_gpt2 import save_gpt2  # noqa: E402
from decoderlm.model.hooks import hooks, run_with_cache  # noqa: E402
from decoderlm.tokenizers.gpt2 import GPT2_BPE_DIR  # noqa: E402

from conftest import randomize  # noqa: E402

# the names TransformerLens gives the activations we hook, in a GPT-2
EXPECTED_SHARED = {"hook_embed", "hook_pos_embed"} | {
    f"blocks.{layer}.{name}"
    for layer in range(2)
    for name in (
        "hook_resid_pre",
        "attn.hook_q",
        "attn.hook_k",
        "attn.hook_v",
        "attn.hook_pattern",
        "attn.hook_z",
        "hook_attn_out",
        "hook_resid_mid",
        "mlp.hook_pre",
        "mlp.hook_post",
        "hook_mlp_out",
        "hook_resid_post",
    )
}


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    """(our DecoderLM, TransformerLens's bridge) holding the same random GPT-2 weights."""
    from transformer_lens import TransformerBridge

    directory = tmp_path_factory.mktemp("gpt2")
    torch.manual_seed(0)
    config = ModelConfig(
        vocab_size=50257, block_size=16, n_layers=2, n_heads=4, d_model=32, dropout=0.0
    )
    ours = randomize(DecoderLM(config)).eval()
    with torch.no_grad():
        for p in ours.parameters():
            p.mul_(0.5)  # logits of a sane size
    save_gpt2(ours, directory)
    tokenizer = transformers.GPT2TokenizerFast(
        vocab_file=str(GPT2_BPE_DIR / "encoder.json"), merges_file=str(GPT2_BPE_DIR / "vocab.bpe")
    )
    tokenizer.save_pretrained(directory)  # the bridge reloads it by path: no download
    hf = transformers.GPT2LMHeadModel.from_pretrained(directory, attn_implementation="eager")
    tokenizer = transformers.GPT2TokenizerFast.from_pretrained(directory)
    bridge = TransformerBridge.boot_transformers(
        str(directory), hf_model=hf.eval(), tokenizer=tokenizer
    )
    return ours, bridge


def test_every_shared_hook_has_transformer_lens_shape_and_value(both):
    ours, bridge = both
    idx = torch.randint(0, 50257, (2, 12), generator=torch.Generator().manual_seed(1))
    (logits, _), cache = run_with_cache(ours, idx)
    with torch.no_grad():
        tl_logits, tl_cache = bridge.run_with_cache(idx)
    shared = set(cache) & set(tl_cache.keys())
    assert shared == EXPECTED_SHARED
    # a name of ours that TransformerLens lacks is not one of its names at all
    assert set(cache) - shared == {"hook_normalized"}
    for name in sorted(shared):
        a, b = cache[name], tl_cache[name]
        assert a.shape == b.shape, (name, tuple(a.shape), tuple(b.shape))
        assert (a.float() - b.float()).abs().max() < 1e-4, name
    # ours is what lm_head reads: after ln_f's gain and bias, TransformerLens's ln_final output
    # (its ln_final.hook_normalized is before them)
    assert (cache["hook_normalized"] - tl_cache["ln_final.hook_out"]).abs().max() < 1e-4
    assert (logits - tl_logits).abs().max() < 1e-4


def test_a_patching_experiment_written_for_transformer_lens_gives_the_same_logits(both):
    ours, bridge = both
    g = torch.Generator().manual_seed(2)
    clean = torch.randint(0, 50257, (1, 10), generator=g)
    corrupted = clean.clone()
    corrupted[0, 3] = (corrupted[0, 3] + 1) % 50257
    _, cache = run_with_cache(ours, clean, ["hook_z", "hook_resid_pre"])
    z_name, resid_name = "blocks.1.attn.hook_z", "blocks.1.hook_resid_pre"

    # TransformerLens calls fn(activation, hook=its HookPoint), we call fn(activation, name)
    def patch_head(z, hook=None):  # head 2 at every position: TransformerLens's axes
        z = z.clone()
        z[:, :, 2, :] = cache[z_name][:, :, 2, :]
        return z

    def patch_position(resid, hook=None):
        resid = resid.clone()
        resid[:, 3, :] = cache[resid_name][:, 3, :]
        return resid

    for name, fn in ((z_name, patch_head), (resid_name, patch_position)):
        with hooks(ours, [(name, fn)]):
            mine, _ = ours(corrupted)
        with torch.no_grad():
            theirs = bridge.run_with_hooks(corrupted, fwd_hooks=[(name, fn)])
        assert (mine - theirs).abs().max() < 1e-4, name
        with torch.no_grad():
            unpatched = bridge(corrupted)
        assert (theirs - unpatched).abs().max() > 1e-3, name  # the patch did something
