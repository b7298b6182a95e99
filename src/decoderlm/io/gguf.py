"""GGUF files (llama.cpp's format) in and out, with the `gguf` package (llama.cpp's gguf-py).

`save_gguf` writes a GPT-2-, Llama- or Qwen2-shaped `DecoderLM` and its tokenizer as one GGUF
file in the layout llama.cpp's convert_hf_to_gguf.py writes; `load_gguf` reads such a file
back (ours, or one that converter wrote: architectures "gpt2", "llama", "qwen2"). Tensor names:

    tok_emb, pos_emb, ln_f, lm_head     -> token_embd, position_embd, output_norm, output
    blocks.i.ln_1, ln_2                 -> blk.i.attn_norm, blk.i.ffn_norm
    blocks.i.attn.qkv                   -> blk.i.attn_qkv (gpt2: fused q, k, v rows)
                                           blk.i.attn_q, attn_k, attn_v (llama, qwen2:
                                           split; for llama q rows permuted by n_heads and
                                           k rows by n_kv_heads to llama.cpp's interleaved
                                           rotary layout, `rope_half_to_interleaved`;
                                           qwen2's q/k/v biases, unpermuted)
    blocks.i.attn.proj                  -> blk.i.attn_output
    blocks.i.mlp.fc, proj (, gate)      -> blk.i.ffn_up, ffn_down (, ffn_gate)
    config.rope_scaling (Llama 3)       -> rope_freqs (per-frequency divisors of theta_i)

A tied unembedding is stored once (token_embd; llama.cpp falls back to it when output is
absent). Weights are [out, in] as in PyTorch (GGUF lists the dimensions the other way round).
dtypes: f32; f16 and bf16 (the matrices; norms, biases and the position table stay f32, as
llama.cpp's converter keeps them); q8_0 (blocks of 32 int8 values with one f16 scale, the
matrices only: every row length must be a multiple of 32). Reading dequantises every type
gguf-py has (Q4_0 ... Q8_0, Q2_K ... Q6_K, F16, BF16) to float32.

The tokenizer is llama.cpp's "gpt2" byte-level BPE (tokenizer.ggml.model "gpt2", pre-tokenizer
"gpt-2"): GPT-2's own vocabulary and merges; a byte vocabulary as the 256 byte symbols in id
order; a char vocabulary as each character's byte symbols, with the merges that join the
bytes of a multi-byte character (they never join two characters), so llama.cpp encodes
covered text to decoderlm's ids. The file also carries decoderlm's tokenizer description
(key "decoderlm.tokenizer", JSON), which `load_gguf` reads, and a sha256 (key
"decoderlm.sha256") of the architecture, its `{arch}.*` hyperparameters (`_canonical`) and
every tensor's stored bytes in the file's order, which `load_gguf` checks, so a damaged,
edited or incompletely copied file is refused instead of sampling. Files from elsewhere are
checked against their own tensor shapes (`_config`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from pathlib import Path

import numpy as np
import torch

from ..config import ModelConfig
from ..errors import MissingFileError, UserError
from ..files import atomic_write
from ..model.model import DecoderLM
from ..model.positions import rope_half_to_interleaved, rope_interleaved_to_half, rope_inv_freq
from ..model.weights import VERIFY_HINT, load_state, unwrap_model
from ..tokenizers import ByteTokenizer, CharTokenizer, GPT2Tokenizer, Tokenizer
from ..tokenizers.gguf_vocab import gguf_tokenizer
from ..tokenizers.gpt2 import GPT2_BPE_DIR
from ..tokenizers.hf_json import byte_to_unicode
from ..tokenizers.load import tokenizer_from_dict
from .targets import DTYPES, export_target

__all__ = ["check_gguf_dtype", "gguf_vocab", "load_gguf", "load_gguf_tokenizer", "save_gguf"]

TOKENIZER_KEY = "decoderlm.tokenizer"
DIGEST_KEY = "decoderlm.sha256"  # of the hyperparameters and tensor data
ARCHS = ("gpt2", "llama", "qwen2")  # llama.cpp's architecture names read and written
_FILE_TYPES = {"f32": 0, "f16": 1, "q8_0": 7, "bf16": 32}  # gguf.LlamaFileType
_NORMAL, _CONTROL = 1, 3  # gguf.TokenType
_UNUSED_MERGE = "ĀĀ Ā"  # a merge no text reaches: no symbol "ĀĀ" is ever formed
_BLOCK = {  # our module -> GGUF's, per block
    "ln_1": "attn_norm",
    "ln_2": "ffn_norm",
    "attn.qkv": "attn_qkv",
    "attn.proj": "attn_output",
    "mlp.fc": "ffn_up",
    "mlp.gate": "ffn_gate",
    "mlp.proj": "ffn_down",
}
_TOP = {"tok_emb": "token_embd", "pos_emb": "position_embd", "ln_f": "output_norm"}


def _split_qkv(c: ModelConfig, tensor: torch.Tensor, permute: bool) -> dict[str, torch.Tensor]:
    """A fused qkv weight or bias (rows q n_heads head_dim, k n_kv_heads head_dim, v) as
    GGUF's attn_q, attn_k, attn_v; with permute, q and k rows in llama.cpp's interleaved
    rotary layout (its converter's `permute`: q by n_heads, k by n_kv_heads)."""
    q_rows, kv_rows = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    q, k, v = tensor.split([q_rows, kv_rows, kv_rows], dim=0)
    if permute:
        q, k = rope_half_to_interleaved(q, c.n_heads), rope_half_to_interleaved(k, c.n_kv_heads)
    return {"attn_q": q, "attn_k": k, "attn_v": v}


def _gguf_tensors(model: DecoderLM, arch: str) -> dict[str, torch.Tensor]:
    """The model's tensors under GGUF's names, float32 on the CPU, [out, in]; with Llama 3's
    rope scaling, its per-frequency divisors as `rope_freqs.weight` (llama.cpp's form)."""
    c, out = model.config, {}
    for key, tensor in model.state_dict().items():
        tensor = tensor.detach().float().cpu()
        parts = key.split(".")
        if parts[0] == "blocks":
            name = f"blk.{parts[1]}.{_BLOCK['.'.join(parts[2:-1])]}"
            if name.endswith("attn_qkv") and arch in ("llama", "qwen2"):
                for part, rows in _split_qkv(c, tensor, arch == "llama").items():
                    out[f"blk.{parts[1]}.{part}.{parts[-1]}"] = rows
                continue
            out[f"{name}.{parts[-1]}"] = tensor
        elif key == "lm_head.weight":
            if not c.tie_embeddings:
                out["output.weight"] = tensor[: c.vocab_size]
        else:
            rows = tensor[: c.vocab_size] if parts[0] == "tok_emb" else tensor
            out[f"{_TOP[parts[0]]}.{parts[-1]}"] = rows
    if c.rope_scaling is not None:
        plain = rope_inv_freq(dataclasses.replace(c, rope_scaling=None))
        out["rope_freqs.weight"] = (plain / rope_inv_freq(c)).float()
    return out


def check_gguf_dtype(config: ModelConfig, dtype: str) -> None:
    """UserError unless `dtype` is one of DTYPES and fits the model's row lengths."""
    if dtype not in DTYPES:
        raise UserError(f"unknown dtype {dtype!r}; use one of {list(DTYPES)}")
    if dtype == "q8_0":
        odd = {k: v for k, v in (("d_model", config.d_model), ("d_ff", config.d_ff)) if v % 32}
        if odd:
            raise UserError(
                f"q8_0 quantises rows in blocks of 32 values, and this model has "
                f"{', '.join(f'{k}={v}' for k, v in odd.items())} (not a multiple of 32); "
                f"export it as f16, bf16 or f32"
            )


def _gguf_package():
    """The `gguf` package (llama.cpp's gguf-py, the [export] extra).

    Raises:
        UserError: it is not installed (one line saying how to install it).
    """
    try:
        import gguf
    except ImportError as e:
        raise UserError(
            f"GGUF files need the gguf package (llama.cpp's gguf-py): "
            f"pip install 'decoderlm[export]' ({e})"
        ) from None
    return gguf


def _encoded(name: str, tensor: torch.Tensor, dtype: str):
    """(array, GGMLQuantizationType) of one tensor in `dtype` (1-D tensors, norms and the
    position table stay float32)."""
    gguf = _gguf_package()

    array = tensor.numpy()
    if dtype == "f32" or array.ndim == 1 or name == "position_embd.weight":
        return array, gguf.GGMLQuantizationType.F32
    if dtype == "f16":
        return array.astype(np.float16), gguf.GGMLQuantizationType.F16
    qtype = gguf.GGMLQuantizationType.BF16 if dtype == "bf16" else gguf.GGMLQuantizationType.Q8_0
    return gguf.quants.quantize(array, qtype), qtype


def gguf_vocab(tokenizer: Tokenizer) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) of llama.cpp's byte-level BPE vocabulary that encodes
    text as `tokenizer` does (see the module docstring); token i is decoderlm's id i.

    Raises:
        UserError: a tokenizer kind with no such vocabulary.
    """
    symbols = byte_to_unicode()
    merges: list[str] = []
    if isinstance(tokenizer, GPT2Tokenizer):
        vocab = json.loads((tokenizer.bpe_dir / "encoder.json").read_text(encoding="utf-8"))
        tokens = sorted(vocab, key=vocab.get)
        lines = (tokenizer.bpe_dir / "vocab.bpe").read_text(encoding="utf-8").splitlines()
        merges = [line for line in lines[1:] if line]
    elif isinstance(tokenizer, ByteTokenizer):
        tokens = [symbols[b] for b in range(256)] + list(tokenizer.special_tokens)
    elif isinstance(tokenizer, CharTokenizer):
        tokens = []
        for char in tokenizer.chars:
            spelled = [symbols[b] for b in char.encode("utf-8")]
            for i in range(1, len(spelled)):  # join a character's bytes, left to right
                merge = f"{''.join(spelled[:i])} {spelled[i]}"
                if merge not in merges:
                    merges.append(merge)
            tokens.append("".join(spelled))
        tokens += list(tokenizer.special_tokens)
    else:
        raise UserError(f"no GGUF vocabulary for a {tokenizer.kind!r} tokenizer")
    special = set(tokenizer.special_tokens.values())
    types = [_CONTROL if i in special else _NORMAL for i in range(len(tokens))]
    return tokens, types, merges or [_UNUSED_MERGE]


def save_gguf(model: DecoderLM, tokenizer: Tokenizer, path: str | Path, dtype: str = "f32") -> str:
    """Write `model` (possibly wrapped) and `tokenizer` as one GGUF file, atomically.

    Args:
        model: a GPT-2-, Llama- or Qwen2-shaped DecoderLM (see `decoderlm.io.targets`).
        tokenizer: its tokenizer (char, byte or gpt2; vocab_size equal to the model's).
        path: the file to write (replaced if it exists).
        dtype: "f32" | "f16" | "bf16" | "q8_0" (see the module docstring).

    Returns:
        the architecture written ("gpt2" | "llama" | "qwen2").

    Raises:
        UserError: the gguf package is missing, the model does not export to GGUF (the
            blocking options named), an unknown
            dtype or one the model's row lengths cannot take, or a tokenizer that does not fit.
    """
    gguf = _gguf_package()

    model = unwrap_model(model)
    c = model.config
    arch = export_target(c, "gguf")
    if arch == "llama" and c.qkv_bias:
        arch = "qwen2"  # llama.cpp's Llama with q/k/v biases, rotary unpermuted
    check_gguf_dtype(c, dtype)
    if tokenizer.vocab_size != c.vocab_size:
        raise UserError(
            f"the tokenizer has {tokenizer.vocab_size} tokens but the model expects "
            f"vocab_size={c.vocab_size}"
        )
    tokens, types, merges = gguf_vocab(tokenizer)
    encoded = {name: _encoded(name, t, dtype) for name, t in _gguf_tensors(model, arch).items()}
    hparams = _hparams(c, arch)
    digest = _digest(
        _canonical(arch, {k: v for k, (v, _) in hparams.items()}),
        (np.ascontiguousarray(array) for array, _ in encoded.values()),
    )

    def write(tmp: str) -> None:
        w = gguf.GGUFWriter(tmp, arch)
        w.add_name("decoderlm")
        w.add_file_type(_FILE_TYPES[dtype])
        for key, (value, kind) in hparams.items():
            w.add_key_value(key, value, kind)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("gpt-2")
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        if tokenizer.eot_token is not None:
            w.add_bos_token_id(tokenizer.eot_token)
            w.add_eos_token_id(tokenizer.eot_token)
        w.add_add_bos_token(False)
        w.add_string(TOKENIZER_KEY, json.dumps(tokenizer.to_dict(), ensure_ascii=False))
        w.add_string(DIGEST_KEY, digest)
        for name, (array, qtype) in encoded.items():
            w.add_tensor(name, np.ascontiguousarray(array), raw_dtype=qtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()

    atomic_write(path, write)
    return arch


def _hparams(c: ModelConfig, arch: str) -> dict:
    """{GGUF key: (value, GGUFValueType)} of the hyperparameters that decide the computation,
    under llama.cpp's names for `arch`."""
    gguf = _gguf_package()
    u32, f32 = gguf.GGUFValueType.UINT32, gguf.GGUFValueType.FLOAT32
    keys = dict(
        context_length=(c.max_positions, u32),
        embedding_length=(c.d_model, u32),
        feed_forward_length=(c.d_ff, u32),
        block_count=(c.n_layers, u32),
        **{"attention.head_count": (c.n_heads, u32)},
    )
    if arch == "gpt2":
        keys["attention.layer_norm_epsilon"] = (c.norm_eps, f32)
    else:
        keys.update({
            "attention.head_count_kv": (c.n_kv_heads, u32),
            "attention.key_length": (c.head_dim, u32),
            "attention.value_length": (c.head_dim, u32),
            "attention.layer_norm_rms_epsilon": (c.norm_eps, f32),
            "rope.dimension_count": (c.head_dim, u32),
            "rope.freq_base": (c.rope_base, f32),
        })  # fmt: skip
    return {f"{arch}.{key}": value for key, value in keys.items()}


def _canonical(arch: str, values: dict) -> bytes:
    """The architecture and its `{arch}.*` keys as sorted JSON, floats rounded to float32 (as
    the file stores them), so writer and reader hash the same bytes."""
    shown = {"general.architecture": arch}
    for key, value in values.items():
        if key.startswith(f"{arch}."):
            is_float = isinstance(value, float)
            shown[key] = float(np.float32(value)) if is_float else value
    return json.dumps(shown, sort_keys=True).encode()


def _digest(header: bytes, arrays) -> str:
    """The sha256 hex digest of `header` and then the arrays' bytes, one after the other."""
    digest = hashlib.sha256(header)
    for array in arrays:
        digest.update(array)
    return digest.hexdigest()


def _verify(path: Path, meta: dict, reader) -> None:
    """Check a file read by gguf.GGUFReader against the digest its decoderlm key records (a
    file without one, e.g. llama.cpp's converter's, is not checked): the sha256 of its
    architecture and `{arch}.*` hyperparameters (`_canonical`) and then its tensor data.

    Raises:
        UserError: the digests differ (both named, with the skip flag).
    """
    recorded = meta.get(DIGEST_KEY)
    if recorded is None:
        return
    header = _canonical(meta.get("general.architecture"), meta)
    actual = _digest(header, (np.ascontiguousarray(t.data) for t in reader.tensors))
    if actual != recorded:
        raise UserError(
            f"{path}: its hyperparameters and tensor data have sha256 {actual} but the file "
            f"records {recorded} ({DIGEST_KEY}; damaged, edited or replaced); {VERIFY_HINT}"
        )


class _Truncated(Exception):
    """A read past the end of a GGUF file."""


def _gguf_reader(gguf, path: Path):
    """gguf.GGUFReader of `path` that reads through a plain NumPy view of its memory map (a
    memmap slice per field is what makes reading a 49k-token vocabulary slow) and whose reads
    past the end of the file raise _Truncated (the reader itself would fail later, reshaping
    a short array)."""

    class Reader(gguf.GGUFReader):
        def _get(self, offset, dtype, count=1, override_order=None):
            if "_flat" not in self.__dict__:
                self._flat = self.data.view(np.ndarray)
            dtype, count = np.dtype(dtype), int(count)
            end = int(offset) + dtype.itemsize * count
            if end > self._flat.size:
                raise _Truncated(f"it is {self._flat.size} bytes but its contents reach byte {end}")
            array = self._flat[offset:end].view(dtype)
            order = self.byte_order if override_order is None else override_order
            return array.view(array.dtype.newbyteorder(order))

    return Reader(path)


def _reader(path: Path):
    """(gguf.GGUFReader, metadata {key: value}) of an existing GGUF file `path`.

    Raises:
        MissingFileError: no such file. UserError: the gguf package is missing, a
            directory, a truncated file, or not a readable GGUF file.
    """
    if path.is_dir():
        raise UserError(f"{path} is a directory; --gguf takes one GGUF file (a run: --run)")
    if not path.is_file():
        raise MissingFileError(f"GGUF file {path} not found")
    gguf = _gguf_package()
    try:
        reader = _gguf_reader(gguf, path)
    except _Truncated as e:
        raise UserError(
            f"{path} is truncated ({e}): an incomplete download or copy; fetch it again"
        ) from None
    except Exception as e:  # gguf raises ValueError / struct errors for a damaged file
        raise UserError(f"{path} is not a readable GGUF file ({e})") from None
    metadata = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        metadata[key] = field.contents()
    return reader, metadata


def _read(path: Path, verify: bool = True):
    """(metadata {key: value}, tensors {name: float32 torch tensor [out, in]}) of a file; with
    verify, it is checked first against the digest the file records (`_verify`). Quantised
    tensors are dequantised by gguf-py (`gguf.quants.dequantize`, vectorised over blocks)."""
    reader, metadata = _reader(path)
    gguf = _gguf_package()
    if verify:
        _verify(path, metadata, reader)
    tensors = {}
    for t in reader.tensors:
        data = np.asarray(t.data)
        if data.dtype == np.uint8:  # blocks: one row, dequantised in one vectorised call
            data = data.reshape(1, -1)
        values = gguf.quants.dequantize(data, t.tensor_type)
        # a new float32 array (dequantised) as it is; the file's own memory (float32 data,
        # read-only) copied
        values = np.require(values, np.float32, ["C_CONTIGUOUS", "WRITEABLE"])
        shape = [int(n) for n in reversed(t.shape)]
        tensors[t.name] = torch.from_numpy(values.reshape(shape))
    return metadata, tensors


def _scaling_from_factors(factors: torch.Tensor, head_dim: int, base: float, source: Path):
    """Llama 3's rope_scaling (ModelConfig) whose inverse frequencies are llama.cpp's
    `rope_freqs` divisors: theta_i / factors[i], theta_i = base^(-2i / head_dim).

    Llama 3 divides by `factor` (low frequencies), 1 (high) and, between, by 1 / ((1 - s) /
    factor + s) with s = (L / w_i - low) / (high - low) linear in 1 / w_i (w_i = 2 pi /
    theta_i); s at two in-between frequencies gives L / (high - low) and low / (high - low),
    and with low_freq_factor 1 (Llama 3's) the three numbers. None: all divisors 1.

    Raises:
        UserError: divisors that are not Llama 3's scaling (checked by recomputing them).
    """
    f = factors.double()
    if torch.allclose(f, torch.ones_like(f)):
        return None
    factor = float(f.max())
    theta = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    mid = ((f > 1 + 1e-6) & (f < factor * (1 - 1e-6))).nonzero().flatten()
    scaling = None
    if factor > 1 and len(mid) >= 2:
        s = (1 / f[mid] - 1 / factor) / (1 - 1 / factor)
        inv_w = theta[mid] / (2 * math.pi)
        i, j = 0, len(mid) - 1
        a = float((s[j] - s[i]) / (inv_w[j] - inv_w[i]))  # L / (high - low)
        b = float(s[i] - a * inv_w[i])  # -low / (high - low)
        if a > 0 and b < 0:
            scaling = dict(
                rope_type="llama3",
                factor=factor,
                low_freq_factor=1.0,
                high_freq_factor=1.0 - 1.0 / b,
                original_max_position_embeddings=round(-a / b),
            )
    if scaling is not None:
        config = ModelConfig(
            vocab_size=1, d_model=head_dim, n_heads=1, pos_encoding="rope",
            rope_base=base, rope_scaling=scaling,
        )  # fmt: skip
        if torch.allclose(rope_inv_freq(config), theta / f, rtol=1e-4, atol=0):
            return scaling
    raise UserError(
        f"{source}: its rope_freqs tensor does not describe Llama 3's rope scaling, the one "
        f"decoderlm computes; this file cannot be run"
    )


def _config(meta: dict, tensors: dict, arch: str, source: Path) -> ModelConfig:
    """The ModelConfig a file's metadata describes, checked against its tensor shapes.

    Raises:
        UserError: a key or tensor every such file has is missing, or the metadata and the
            tensors disagree (e.g. a head count that does not fit the q/k/v widths).
    """
    get = lambda key, default=None: meta.get(f"{arch}.{key}", default)  # noqa: E731

    def need(name: str, kind: str = "tensor"):
        found = tensors.get(name) if kind == "tensor" else get(name)
        if found is None:
            raise UserError(
                f"{source} has no {kind} {name if kind == 'tensor' else f'{arch}.{name}'}, "
                f"which every {arch} GGUF file has (damaged, or written by another tool?)"
            )
        return found

    def disagree(what: str) -> UserError:
        return UserError(
            f"{source}: its metadata disagrees with its tensors ({what}); the file was "
            f"edited or damaged, and would compute something else"
        )

    for name in ("token_embd.weight", "blk.0.ffn_up.weight"):
        need(name)
    tied = "output.weight" not in tensors or torch.equal(
        tensors["output.weight"], tensors["token_embd.weight"]
    )
    n_heads, d_model = (
        int(need("attention.head_count", "key")),
        int(need("embedding_length", "key")),
    )
    n_kv_heads = int(get("attention.head_count_kv", n_heads))
    if not n_heads or (d_model % n_heads and get("attention.key_length") is None):
        raise disagree(f"embedding_length {d_model} is not a multiple of head_count {n_heads}")
    head_dim = int(get("attention.key_length", d_model // n_heads))
    fields = dict(
        vocab_size=tensors["token_embd.weight"].size(0),
        n_layers=int(need("block_count", "key")),
        n_heads=n_heads,
        d_model=d_model,
        d_ff=int(get("feed_forward_length", tensors["blk.0.ffn_up.weight"].size(0))),
        tie_embeddings=tied,
    )
    if arch == "gpt2":
        block_size = need("position_embd.weight").size(0)
        shape = dict(activation="gelu_tanh", norm_eps=get("attention.layer_norm_epsilon", 1e-5))
        return ModelConfig(block_size=block_size, **fields, **shape)
    q, k = need("blk.0.attn_q.weight").size(0), need("blk.0.attn_k.weight").size(0)
    if (q, k) != (n_heads * head_dim, n_kv_heads * head_dim) or n_kv_heads < 1:
        raise disagree(
            f"head_count {n_heads}, head_count_kv {n_kv_heads} and head width {head_dim} give "
            f"q/k widths {n_heads * head_dim}/{n_kv_heads * head_dim}, the tensors have {q}/{k}"
        )
    if get("attention.value_length", head_dim) != head_dim:
        raise UserError(f"{source}: key and value heads of different widths are not supported")
    if get("rope.dimension_count", head_dim) != head_dim:
        raise UserError(
            f"{source}: rotary positions on {get('rope.dimension_count')} of each head's "
            f"{head_dim} features (partial rotary) are not supported"
        )
    rope_base = float(get("rope.freq_base", 10000.0))
    factors = tensors.get("rope_freqs.weight")
    scaling = (
        None if factors is None else _scaling_from_factors(factors, head_dim, rope_base, source)
    )
    shape = dict(
        pos_encoding="rope",
        norm="rmsnorm",
        mlp="swiglu",
        bias=False,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        qkv_bias="blk.0.attn_q.bias" in tensors,
        rope_base=rope_base,
        rope_scaling=scaling,
        norm_eps=get("attention.layer_norm_rms_epsilon", 1e-5),
    )
    try:
        return ModelConfig(block_size=int(need("context_length", "key")), **fields, **shape)
    except UserError as e:
        raise disagree(str(e)) from None


def _tokenizer(meta: dict, source: Path) -> Tokenizer:
    """decoderlm's description in the file, else GPT-2's BPE when the vocabulary is GPT-2's,
    else the file's vocabulary as llama.cpp tokenizes it (`gguf_tokenizer`)."""
    if TOKENIZER_KEY in meta:
        return tokenizer_from_dict(json.loads(meta[TOKENIZER_KEY]), str(source))
    tokens = meta.get("tokenizer.ggml.tokens")
    gpt2 = json.loads((GPT2_BPE_DIR / "encoder.json").read_text(encoding="utf-8"))
    if tokens is not None and list(tokens) == sorted(gpt2, key=gpt2.get):
        return GPT2Tokenizer()
    return gguf_tokenizer(meta, str(source))


def load_gguf(
    path: str | Path, map_location: str = "cpu", verify: bool = True
) -> tuple[DecoderLM, Tokenizer]:
    """A GGUF file (architecture "gpt2", "llama" or "qwen2") as a DecoderLM (eval mode,
    float32) and its tokenizer (with the file's chat template and end-of-text ids). Quantised
    tensors are dequantised to float32; llama's permuted q/k rows are put back in decoderlm's
    half-split rotary layout; a `rope_freqs` tensor becomes Llama 3's rope_scaling.
    verify: check the hyperparameters and tensor data against the sha256 a decoderlm export
    records in the file (key "decoderlm.sha256"; files without it load unchecked).

    Raises:
        MissingFileError: no such file.
        UserError: the gguf package is missing, a directory, a truncated or unreadable GGUF
            file, hyperparameters and tensor data that do not match its recorded sha256
            (verify), another architecture, metadata that disagrees with the tensors, a
            rope_freqs tensor that is not Llama 3's scaling, or a tokenizer decoderlm cannot
            rebuild.
    """
    path = Path(path)
    meta, tensors = _read(path, verify)
    arch = meta.get("general.architecture")
    if arch not in ARCHS:
        raise UserError(f"{path} holds a {arch!r} model; decoderlm reads {', '.join(ARCHS)}")
    config = _config(meta, tensors, arch, path)
    tensors.pop("rope_freqs.weight", None)  # in config.rope_scaling
    heads = {"attn_q": config.n_heads, "attn_k": config.n_kv_heads}
    back = {v: k for k, v in {**_BLOCK, **_TOP, "lm_head": "output"}.items()}
    state, file_keys, qkv = {}, {}, {}
    for name, tensor in tensors.items():
        parts = name.split(".")
        if parts[0] == "blk" and parts[2] in ("attn_q", "attn_k", "attn_v"):
            n = heads.get(parts[2]) if arch == "llama" else None
            if n and tensor.size(0) == n * config.head_dim:  # undo the converter's permutation
                tensor = rope_interleaved_to_half(tensor, n)
            qkv.setdefault((parts[1], parts[-1]), {})[parts[2]] = tensor
            continue
        if parts[0] == "blk":
            key = f"blocks.{parts[1]}.{back.get(parts[2], parts[2])}.{parts[-1]}"
        else:
            key = f"{back.get(parts[0], parts[0])}.{parts[-1]}"
        state[key], file_keys[key] = tensor, name
    for (layer, kind), parts in qkv.items():
        key = f"blocks.{layer}.attn.qkv.{kind}"
        state[key] = torch.cat(
            [parts.get(n, torch.empty(0)) for n in ("attn_q", "attn_k", "attn_v")]
        )
    # the tensors read are arrays of their own (dequantised, or copied from the file)
    model = load_state(
        DecoderLM.unfilled(config), state, path, file_keys, "its metadata", owned=True
    )
    tokenizer = _tokenizer(meta, path)
    if tokenizer.vocab_size != config.vocab_size:
        raise UserError(
            f"{path}: its tokenizer has {tokenizer.vocab_size} tokens and its model "
            f"{config.vocab_size}"
        )
    return model.to(map_location).eval(), tokenizer


def load_gguf_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer of a GGUF file (see `load_gguf`), read from its metadata alone.

    Raises:
        MissingFileError: no such file.
        UserError: the gguf package is missing, a directory, not a readable GGUF file, or a
            tokenizer decoderlm cannot rebuild.
    """
    path = Path(path)
    return _tokenizer(_reader(path)[1], path)
