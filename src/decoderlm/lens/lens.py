"""Looking inside a model: logit lens, per-token surprisal, head scores, activation patching and
embedding maps. Plain functions over a model and token ids, each returning tensors; the
activations come from the hook points (`decoderlm.model.hooks`), so the model is never changed.

    lens = logit_lens(model, ids)            # what each layer "thinks" comes next
    s = surprisal(model, ids, token_bytes=token_byte_counts(tokenizer, ids))
    scores = head_scores(model, repeated_probe(vocab_size, 32))   # {"induction": [L, H], ...}

Token ids `ids` are one sequence [T] int64 unless a function says [B, T]. Probabilities are
softmax probabilities in float32; surprisal is in bits (log base 2).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from ..errors import UserError
from ..model.hooks import hooks, run_with_cache
from ..model.model import DecoderLM, eval_mode
from ..tokenizers import ByteTokenizer, GPT2Tokenizer, Tokenizer

__all__ = [
    "unembed",
    "logit_lens",
    "surprisal",
    "token_byte_counts",
    "attention_patterns",
    "detection_patterns",
    "pattern_score",
    "head_scores",
    "repeated_probe",
    "default_probe",
    "PROBE_HALF",
    "probe_metrics",
    "logit_difference",
    "patch_resid_pre",
    "HEAD_ACTIVATIONS",
    "patch_heads",
    "pca_2d",
    "embedding_map",
]

_LN2 = math.log(2.0)
_PATCH_TOKENS = 2**14  # tokens per batched forward pass of activation patching


def unembed(model: DecoderLM, resid: Tensor) -> Tensor:
    """Logits [..., vocab_size] of a residual-stream state [..., d_model]: the final norm (its
    statistics recomputed for this state; pre-norm models) then lm_head, as the model does to
    its last block's output. Post-norm models have no final norm: lm_head alone. As
    `DecoderLM.to_logits`: a padded vocabulary's extra rows dropped, the softcap applied."""
    x = model.ln_f(resid) if model.ln_f is not None else resid
    return model.to_logits(x)


def _as_batch(ids: Tensor, model: DecoderLM) -> Tensor:
    """ids [T] -> [1, T] int64 on the model's device."""
    if ids.dim() != 1:
        raise UserError(f"ids must be one sequence [T], got shape {tuple(ids.shape)}")
    return ids.to(model.device, torch.int64)[None]


def _top(logp: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """(ids, probabilities) [..., k] of the k likeliest tokens of log-probabilities [..., V]."""
    values, top_ids = logp.topk(min(k, logp.size(-1)), dim=-1)
    return top_ids, values.exp()


@torch.no_grad()
def logit_lens(model: DecoderLM, ids: Tensor, k: int = 5) -> dict[str, Tensor]:
    """The logit lens (nostalgebraist 2020): every layer's residual stream read out as if it
    were the last, by `unembed` (the final norm recomputed per state).

    Rows: 0 = the embedding output (blocks.0.hook_resid_pre: tokens and positions), l + 1 =
    blocks.l.hook_resid_post; the last row is the model's own output. Post-norm convention:
    each block's output is already normalised by its ln_2 and there is no final norm, so
    every row is lm_head(state); the embedding row is not normalised.

    Args:
        model: the DecoderLM (eval mode for no dropout).
        ids: [T] int64 token ids.
        k: how many top tokens to keep per position.

    Returns:
        top_ids [n_layers + 1, T, k] int64, top_probs [n_layers + 1, T, k] float32 (the k
        likeliest next tokens at each position), next_prob [n_layers + 1, T - 1] float32
        (probability of the token that actually follows position t).
    """
    idx = _as_batch(ids, model)
    _, cache = run_with_cache(model, idx, ["blocks.0.hook_resid_pre", "hook_resid_post"])
    top_ids, top_probs, next_prob = [], [], []
    for state in cache.accumulated_resid()[:, 0]:  # [T, d_model] per row
        logp = unembed(model, state).float().log_softmax(-1)  # [T, V]
        i, p = _top(logp, k)
        top_ids.append(i)
        top_probs.append(p)
        next_prob.append(logp[:-1].gather(-1, idx[0, 1:, None])[:, 0].exp())
    return {
        "top_ids": torch.stack(top_ids).cpu(),
        "top_probs": torch.stack(top_probs).cpu(),
        "next_prob": torch.stack(next_prob).cpu(),
    }


def token_byte_counts(tokenizer: Tokenizer, ids) -> list[int]:
    """UTF-8 bytes each token stands for: 1 per byte id, a GPT-2 token's byte string, a
    character's UTF-8 length. Their sum over a text is its UTF-8 size."""
    ids = [int(i) for i in ids]
    if isinstance(tokenizer, ByteTokenizer):
        return [1] * len(ids)
    if isinstance(tokenizer, GPT2Tokenizer):
        return [len(tokenizer.encoding.decode_single_token_bytes(i)) for i in ids]
    return [len(tokenizer.decode([i]).encode("utf-8")) for i in ids]


@torch.no_grad()
def surprisal(
    model: DecoderLM, ids: Tensor, k: int = 5, token_bytes: list[int] | None = None
) -> dict[str, Tensor]:
    """Per-token surprisal: how many bits the model pays for each actual next token.

    bits[t] = -log2 p(ids[t + 1] | ids[: t + 1]) for t = 0 .. T - 2 (the first token is not
    predicted). bits_per_token is their mean (the cross-entropy in nats / ln 2);
    bits_per_byte divides their sum by the UTF-8 bytes of tokens 1 .. T - 1, which makes
    character, byte and BPE models comparable.

    Args:
        model: the DecoderLM.
        ids: [T] int64 token ids, T >= 2.
        k: top guesses kept per position.
        token_bytes: [T] UTF-8 bytes of each token (`token_byte_counts`); None leaves out
            bits_per_byte.

    Returns:
        bits [T - 1] float32, rank [T - 1] int64 (0: the true token was the top guess),
        top_ids / top_probs [T - 1, k], bits_per_token (scalar), and bits_per_byte (scalar)
        when token_bytes is given.

    Raises:
        UserError: fewer than 2 tokens, or token_bytes of another length.
    """
    if ids.numel() < 2:
        raise UserError("surprisal needs at least 2 tokens (the first is not predicted)")
    idx = _as_batch(ids, model)
    logits, _ = model(idx)
    logp = logits[0, :-1].float().log_softmax(-1)  # [T - 1, V]
    true = logp.gather(-1, idx[0, 1:, None])  # [T - 1, 1]
    top_ids, top_probs = _top(logp, k)
    out = {
        "bits": (-true[:, 0] / _LN2).cpu(),
        "rank": (logp > true).sum(-1).cpu(),
        "top_ids": top_ids.cpu(),
        "top_probs": top_probs.cpu(),
    }
    out["bits_per_token"] = out["bits"].mean()
    if token_bytes is not None:
        if len(token_bytes) != ids.numel():
            raise UserError(f"token_bytes has {len(token_bytes)} entries for {ids.numel()} ids")
        out["bits_per_byte"] = out["bits"].sum() / sum(token_bytes[1:])
    return out


@torch.no_grad()
def attention_patterns(model: DecoderLM, idx: Tensor) -> Tensor:
    """Every layer's attention probabilities for idx [B, T]: [n_layers, B, n_heads, T, T]
    float32 (hook_pattern; rows sum to 1, zero above the diagonal)."""
    _, cache = run_with_cache(model, idx.to(model.device), ["hook_pattern"])
    return cache.stack("hook_pattern")


def detection_patterns(idx: Tensor) -> dict[str, Tensor]:
    """Where each kind of head is expected to attend, as bool [B, T, T] (query t, key s):

    previous_token: s = t - 1. duplicate_token: s < t and idx[s] == idx[t] (an earlier copy
    of the current token). induction: 1 <= s <= t and idx[s - 1] == idx[t] (the token after
    an earlier copy of the current one; Olsson et al. 2022). As TransformerLens's
    head_detector patterns.
    """
    B, T = idx.shape
    ones = torch.ones(T, T, dtype=torch.bool, device=idx.device)
    same = idx[:, :, None] == idx[:, None, :]  # [B, T (query), T (key)]
    induction = torch.zeros_like(same)
    induction[:, :, 1:] = same[:, :, :-1] & ones.tril()[:, 1:]  # key s = s' + 1 <= t
    return {
        "previous_token": ones.tril(-1).triu(-1).expand(B, T, T),
        "duplicate_token": same & ones.tril(-1),
        "induction": induction,
    }


def pattern_score(att: Tensor, target: Tensor) -> Tensor:
    """Fraction of attention on the expected cells ("mul" measure): for each head, the mean over
    the query rows that have at least one expected cell of sum_s att[t, s] * target[t, s].

    Args:
        att: [n_layers, B, n_heads, T, T] probabilities.
        target: [B, T, T] bool, from `detection_patterns`.

    Returns:
        [n_layers, n_heads] float32 in [0, 1]; NaN when no row has an expected cell.
    """
    rows = target.any(-1)  # [B, T]
    mass = (att * target[None, :, None]).sum(-1)  # [L, B, H, T]
    mask = rows[None, :, None].to(mass.dtype)
    return (mass * mask).sum((1, 3)) / mask.sum((1, 3))


def head_scores(model: DecoderLM, idx: Tensor) -> dict[str, Tensor]:
    """Previous-token, duplicate-token and induction scores of every head on idx [B, T]
    (e.g. a `repeated_probe`, or a text as [1, T]): {kind: [n_layers, n_heads] float32}, see
    `detection_patterns` and `pattern_score`."""
    att = attention_patterns(model, idx)
    targets = detection_patterns(idx.to(att.device))
    return {kind: pattern_score(att, t).cpu() for kind, t in targets.items()}


PROBE_HALF = 32  # tokens in each half of the default repeated probe


def default_probe(vocab_size: int, block_size: int) -> Tensor:
    """The probe of reports and training logs: `repeated_probe` of batch 4 with halves of
    min(PROBE_HALF, block_size // 2) ids from [0, vocab_size), seed 0: [4, 2 * half]."""
    return repeated_probe(vocab_size, max(1, min(PROBE_HALF, block_size // 2)), batch=4)


def repeated_probe(vocab_size: int, seq_len: int, batch: int = 4, seed: int = 0) -> Tensor:
    """[batch, 2 * seq_len] int64: seq_len ids drawn uniformly from [0, vocab_size) (a fixed
    seed), then the same seq_len ids again. An induction head predicts the second half."""
    g = torch.Generator().manual_seed(seed)
    half = torch.randint(vocab_size, (batch, seq_len), generator=g)
    return torch.cat([half, half], dim=1)


@torch.no_grad()
def probe_metrics(model: DecoderLM, probe: Tensor) -> dict[str, list[float] | float]:
    """What training logs at each evaluation, from one forward pass over a repeated probe
    [B, 2S] in eval mode (the model's mode is restored):

    induction_score: [n_layers] the best head's induction score in each layer;
    probe_second_half_loss: mean loss (nats) of predicting tokens S + 1 .. 2S - 1 of the
    probe, each of which followed the same token in the first half (token S cannot be
    predicted from the context and is left out).
    """
    with eval_mode(model):
        idx = probe.to(model.device)
        S = idx.size(1) // 2
        (logits, _), cache = run_with_cache(model, idx, ["hook_pattern"])
        att = cache.stack("hook_pattern")
        score = pattern_score(att, detection_patterns(idx)["induction"]).amax(-1)
        loss = F.cross_entropy(logits[:, S:-1].float().flatten(0, 1), idx[:, S + 1 :].flatten())
    return {
        "induction_score": [round(float(v), 4) for v in score],
        "probe_second_half_loss": float(loss),
    }


def logit_difference(logits: Tensor, answer: int, wrong: int) -> Tensor:
    """[B] logits[:, -1, answer] - logits[:, -1, wrong] of logits [B, T, vocab_size]."""
    return (logits[:, -1, answer] - logits[:, -1, wrong]).float()


def _patched_metric(model, corrupted, name, patch, n, answer, wrong) -> Tensor:
    """[n] logit differences of n corrupted runs, run i with patch(activation, i) applied to
    row i at hook point `name`. Batched; only the last position is unembedded."""
    T = corrupted.numel()
    chunk = max(1, _PATCH_TOKENS // T)
    out = []
    for start in range(0, n, chunk):
        rows = range(start, min(n, start + chunk))

        def replace(x, _name, rows=rows):
            x = x.clone()
            for b, i in enumerate(rows):
                patch(x[b], i)
            return x

        last = [(name, replace), ("unembed.hook_in", lambda x, _name: x[:, -1:])]
        with hooks(model, last):
            logits, _ = model(corrupted[None].expand(len(rows), T))  # [rows, 1, vocab_size]
        out.append(logit_difference(logits, answer, wrong))
    return torch.cat(out).cpu()


def _normalised(model, clean, corrupted, answer, wrong):
    """(clean metric, corrupted metric) after checking the prompts; raises UserError."""
    if clean.shape != corrupted.shape or clean.dim() != 1:
        raise UserError(
            f"clean and corrupted prompts must be [T] of equal length, got "
            f"{tuple(clean.shape)} and {tuple(corrupted.shape)}"
        )
    m_clean = float(logit_difference(model(clean[None])[0], answer, wrong)[0])
    m_corrupt = float(logit_difference(model(corrupted[None])[0], answer, wrong)[0])
    if math.isclose(m_clean, m_corrupt, abs_tol=1e-6):
        raise UserError(
            "the clean and corrupted prompts give the same logit difference; choose prompts "
            "(or answer tokens) that the model tells apart"
        )
    return m_clean, m_corrupt


@torch.no_grad()
def patch_resid_pre(
    model: DecoderLM, clean: Tensor, corrupted: Tensor, answer: int, wrong: int
) -> Tensor:
    """Activation patching of the residual stream: for each (layer l, position t), run the
    corrupted prompt with blocks.l.hook_resid_pre at t taken from the clean run.

    Metric: logit difference answer - wrong at the last position, normalised so that the
    clean run scores 1 and the corrupted run 0: (m - m_corrupted) / (m_clean - m_corrupted).

    Args:
        clean, corrupted: [T] int64 token ids of equal length.
        answer, wrong: token ids.

    Returns:
        [n_layers, T] float32.

    Raises:
        UserError: lengths differ, or both prompts give the same logit difference.
    """
    clean, corrupted = _as_batch(clean, model)[0], _as_batch(corrupted, model)[0]
    m_clean, m_corrupt = _normalised(model, clean, corrupted, answer, wrong)
    _, cache = run_with_cache(model, clean[None], "hook_resid_pre")
    rows = []
    for layer in range(model.config.n_layers):
        saved = cache["hook_resid_pre", layer][0]  # [T, d_model]

        def patch(x, t, saved=saved):
            x[t] = saved[t]

        name = f"blocks.{layer}.hook_resid_pre"
        n = clean.numel()
        rows.append(_patched_metric(model, corrupted, name, patch, n, answer, wrong))
    return (torch.stack(rows) - m_corrupt) / (m_clean - m_corrupt)


HEAD_ACTIVATIONS = ("z", "q", "k", "v")  # the per-head hook points `patch_heads` patches


@torch.no_grad()
def patch_heads(
    model: DecoderLM,
    clean: Tensor,
    corrupted: Tensor,
    answer: int,
    wrong: int,
    activation: str = "z",
) -> Tensor:
    """Activation patching per head: for each (layer l, head h), run the corrupted prompt with
    head h of blocks.l.attn.hook_<activation> (all positions) taken from the clean run.
    Metric as in `patch_resid_pre`.

    activation "z" (each head's output), "q", "k" or "v", as TransformerLens's
    get_act_patch_attn_head_{out,q,k,v}_all_pos. With grouped-query attention (n_kv_heads <
    n_heads) "z" and "q" patch one query head; "k" and "v" patch one key/value head, which
    all n_heads / n_kv_heads query heads of its group read (TransformerLens's layout too).

    Returns:
        [n_layers, n_heads] float32 ([n_layers, n_kv_heads] for "k" and "v"; 1: this head
        alone restores the clean answer).

    Raises:
        UserError: as `patch_resid_pre`, or an activation not in HEAD_ACTIVATIONS.
    """
    if activation not in HEAD_ACTIVATIONS:
        raise UserError(f"activation must be one of {HEAD_ACTIVATIONS}, got {activation!r}")
    clean, corrupted = _as_batch(clean, model)[0], _as_batch(corrupted, model)[0]
    m_clean, m_corrupt = _normalised(model, clean, corrupted, answer, wrong)
    part = f"hook_{activation}"
    _, cache = run_with_cache(model, clean[None], part)
    rows = []
    for layer in range(model.config.n_layers):
        saved = cache[f"attn.{part}", layer][0]  # [T, heads, head_dim]

        def patch(x, h, saved=saved):
            x[:, h] = saved[:, h]

        name = f"blocks.{layer}.attn.{part}"
        n = saved.size(1)  # n_heads, or n_kv_heads for keys and values
        rows.append(_patched_metric(model, corrupted, name, patch, n, answer, wrong))
    return (torch.stack(rows) - m_corrupt) / (m_clean - m_corrupt)


def pca_2d(x: Tensor) -> Tensor:
    """Rows of x [N, d] projected on their first two principal components: [N, 2] float32.

    The rows are centred and projected on the two leading right singular vectors (computed
    in float64); each axis's sign is chosen so that its largest-magnitude loading is
    positive, so the map does not flip between runs.
    """
    centred = x.detach().double().cpu()
    centred = centred - centred.mean(0)
    _, _, vh = torch.linalg.svd(centred, full_matrices=False)
    axes = vh[:2]  # [2, d]
    signs = axes.gather(1, axes.abs().argmax(1, keepdim=True)).sign()
    axes = axes * torch.where(signs == 0, 1.0, signs)
    out = centred @ axes.T
    if out.size(1) < 2:  # d_model 1
        out = F.pad(out, (0, 2 - out.size(1)))
    return out.float()


def embedding_map(model: DecoderLM, max_tokens: int = 512) -> dict[str, Tensor | None]:
    """2-D PCA maps of the token embedding (ids 0 .. min(vocab_size, max_tokens) - 1: all of a
    character or byte vocabulary, the first ids of a BPE one) and of the learned position
    table (None for sinusoidal or rotary positions).

    Returns:
        tokens [N, 2] float32, positions [block_size, 2] float32 or None.
    """
    n = min(model.config.vocab_size, max_tokens)
    positions = model.pos_emb.weight if model.pos_emb is not None else None
    return {
        "tokens": pca_2d(model.tok_emb.weight[:n]),
        "positions": None if positions is None else pca_2d(positions),
    }
