"""Our hook points against TransformerLens itself: the same weights in a DecoderLM and in
TransformerLens's bridge over transformers' GPT2LMHeadModel, and over a grouped-query
LlamaForCausalLM (raw weights: no LayerNorm folding, no centring). Every hook name both have
gives the same activation (shape and values), and patching experiments written once,
TransformerLens-style, give the same logits (and TransformerLens's own patching functions
the same results) in both."""

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
BLOCK_NAMES = (
    "hook_resid_pre",
    "ln1.hook_scale",
    "ln1.hook_normalized",
    "attn.hook_q",
    "attn.hook_k",
    "attn.hook_v",
    "attn.hook_attn_scores",
    "attn.hook_pattern",
    "attn.hook_z",
    "hook_attn_out",
    "hook_resid_mid",
    "ln2.hook_scale",
    "ln2.hook_normalized",
    "mlp.hook_pre",
    "mlp.hook_post",
    "hook_mlp_out",
    "hook_resid_post",
)
TOP_NAMES = {
    "hook_embed",
    "ln_final.hook_scale",
    "ln_final.hook_normalized",
    "unembed.hook_in",
    "unembed.hook_out",
}
# every hook point of ours is one of TransformerLens's, by name
EXPECTED_SHARED = (
    TOP_NAMES
    | {"hook_pos_embed"}
    | {f"blocks.{layer}.{name}" for layer in range(2) for name in BLOCK_NAMES}
)
ROPE_NAMES = ("attn.hook_rot_q", "attn.hook_rot_k")
LLAMA_SHARED = TOP_NAMES | {
    f"blocks.{layer}.{name}" for layer in range(2) for name in BLOCK_NAMES + ROPE_NAMES
}


def gpt2_tokenizer(directory):
    """GPT-2's tokenizer saved into `directory` and read back (the bridge reloads it by path:
    no download)."""
    tokenizer = transformers.GPT2TokenizerFast(
        vocab_file=str(GPT2_BPE_DIR / "encoder.json"), merges_file=str(GPT2_BPE_DIR / "vocab.bpe")
    )
    tokenizer.save_pretrained(directory)
    return transformers.GPT2TokenizerFast.from_pretrained(directory)


def assert_same_activations(cache, tl_cache, expected_shared):
    """Every shared name: the same shape and values (within 1e-4). Masked attention scores:
    ours are -inf, as TransformerLens's HookedTransformer (and the bridge's compatibility
    mode) fill them; the bridge's default mode shows transformers' eager fill, float32's
    minimum. Both are exactly 0 after the softmax."""
    shared = set(cache) & set(tl_cache.keys())
    assert shared == expected_shared
    assert set(cache) == shared  # no name of ours is missing from TransformerLens
    for name in sorted(shared):
        a, b = cache[name].float(), tl_cache[name].float()
        assert a.shape == b.shape, (name, tuple(a.shape), tuple(b.shape))
        masked = b <= torch.finfo(torch.float32).min
        assert torch.equal(a.isneginf(), masked), name
        assert (a[~masked] - b[~masked]).abs().max() < 1e-4, name


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
    tokenizer = gpt2_tokenizer(directory)
    hf = transformers.GPT2LMHeadModel.from_pretrained(directory, attn_implementation="eager")
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
    assert_same_activations(cache, tl_cache, EXPECTED_SHARED)
    # unembed.hook_in is what lm_head reads: ln_final's output, after its gain and bias
    assert (cache["unembed.hook_in"] - tl_cache["ln_final.hook_out"]).abs().max() < 1e-4
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


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """(our DecoderLM, TransformerLens's bridge) over one tiny grouped-query
    LlamaForCausalLM (4 query heads, 2 key/value heads, head_dim 12, Llama 3 rope scaling)
    saved by transformers; ours takes its weights by name."""
    from transformer_lens import TransformerBridge

    from model.test_architectures import from_hf, hf_model, llama_config

    directory = tmp_path_factory.mktemp("llama")
    config = llama_config()
    hf = hf_model("llama", config)
    ours = from_hf(hf, config)  # before the bridge wraps hf's modules
    hf.save_pretrained(directory)
    bridge = TransformerBridge.boot_transformers(
        str(directory), hf_model=hf, tokenizer=gpt2_tokenizer(directory)
    )
    return ours, bridge


def test_grouped_query_hooks_have_transformer_lens_shapes_and_values(llama):
    ours, bridge = llama
    c = ours.config
    idx = torch.randint(0, c.vocab_size, (2, 9), generator=torch.Generator().manual_seed(3))
    (logits, _), cache = run_with_cache(ours, idx)
    with torch.no_grad():
        tl_logits, tl_cache = bridge.run_with_cache(idx)
    assert_same_activations(cache, tl_cache, LLAMA_SHARED)
    # keys and values keep their grouped heads, as TransformerLens keeps them (not repeated)
    assert cache["blocks.0.attn.hook_k"].shape == (2, 9, c.n_kv_heads, c.head_dim)
    assert cache["blocks.0.attn.hook_v"].shape == (2, 9, c.n_kv_heads, c.head_dim)
    assert cache["blocks.0.attn.hook_q"].shape == (2, 9, c.n_heads, c.head_dim)
    assert (logits - tl_logits).abs().max() < 1e-4


def test_transformer_lens_patching_gives_our_patch_heads(llama):
    # TransformerLens's own sweeps on its bridge, against ours on the same weights: per query
    # head for outputs (z) and queries, per key/value head for keys and values
    from transformer_lens import patching

    from decoderlm.lens.lens import logit_difference, patch_heads

    ours, bridge = llama
    g = torch.Generator().manual_seed(4)
    clean = torch.randint(0, ours.config.vocab_size, (8,), generator=g)
    corrupted = clean.clone()
    corrupted[2] = (corrupted[2] + 7) % ours.config.vocab_size
    with torch.no_grad():
        answer = int(ours(clean[None])[0][0, -1].argmax())
        wrong = int(ours(corrupted[None])[0][0, -1].argmax())
        if wrong == answer:
            wrong = int(ours(clean[None])[0][0, -1].topk(2).indices[1])
        _, clean_cache = bridge.run_with_cache(clean[None])
        m_clean = float(logit_difference(bridge(clean[None]), answer, wrong)[0])
        m_corrupt = float(logit_difference(bridge(corrupted[None]), answer, wrong)[0])

    def metric(logits):
        return (logit_difference(logits, answer, wrong)[0] - m_corrupt) / (m_clean - m_corrupt)

    sweeps = {
        "z": patching.get_act_patch_attn_head_out_all_pos,
        "q": patching.get_act_patch_attn_head_q_all_pos,
        "k": patching.get_act_patch_attn_head_k_all_pos,
        "v": patching.get_act_patch_attn_head_v_all_pos,
    }
    for activation, sweep in sweeps.items():
        with torch.no_grad():
            theirs = sweep(bridge, corrupted[None], clean_cache, metric)
        mine = patch_heads(ours, clean, corrupted, answer, wrong, activation)
        heads = ours.config.n_kv_heads if activation in "kv" else ours.config.n_heads
        assert mine.shape == theirs.shape == (ours.config.n_layers, heads), activation
        assert (mine - theirs.float()).abs().max() < 1e-3, activation
        assert mine.abs().max() > 1e-3, activation  # a patch that did something
