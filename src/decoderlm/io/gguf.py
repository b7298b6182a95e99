"""GGUF files (llama.cpp's format) in and out, with the `gguf` package (llama.cpp's gguf-py).

`save_gguf` writes a GPT-2- or Llama-shaped `DecoderLM` and its tokenizer as one GGUF file in
the layout llama.cpp's convert_hf_to_gguf.py writes; `load_gguf` reads such a file back (ours,
or one that converter wrote for a GPT-2 or Llama model with GPT-2's BPE). Tensor names:

    tok_emb, pos_emb, ln_f, lm_head     -> token_embd, position_embd, output_norm, output
    blocks.i.ln_1, ln_2                 -> blk.i.attn_norm, blk.i.ffn_norm
    blocks.i.attn.qkv                   -> blk.i.attn_qkv (gpt2: fused q, k, v rows)
                                           blk.i.attn_q, attn_k, attn_v (llama: split; q and
                                           k rows permuted to llama.cpp's interleaved rotary
                                           layout, `rope_half_to_interleaved`)
    blocks.i.attn.proj                  -> blk.i.attn_output
    blocks.i.mlp.fc, proj (, gate)      -> blk.i.ffn_up, ffn_down (, ffn_gate)

A tied unembedding is stored once (token_embd; llama.cpp falls back to it when output is
absent). Weights are [out, in] as in PyTorch (GGUF lists the dimensions the other way round).
dtypes: f32; f16 and bf16 (the matrices; norms, biases and the position table stay f32, as
llama.cpp's converter keeps them); q8_0 (blocks of 32 int8 values with one f16 scale, the
matrices only: every row length must be a multiple of 32).

The tokenizer is llama.cpp's "gpt2" byte-level BPE (tokenizer.ggml.model "gpt2", pre-tokenizer
"gpt-2"): GPT-2's own vocabulary and merges; a byte vocabulary as the 256 byte symbols in id
order; a char vocabulary as each character's byte symbols, with the merges that join the
bytes of a multi-byte character (they never join two characters), so llama.cpp encodes
covered text to decoderlm's ids. The file also carries decoderlm's tokenizer description
(key "decoderlm.tokenizer", JSON), which `load_gguf` reads, and the sha256 of its tensor data
(key "decoderlm.tensor_data_sha256": every tensor's stored bytes, in the file's order), which
`load_gguf` checks, so a damaged or incompletely copied file is refused instead of sampling.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import torch

from ..config import ModelConfig
from ..errors import MissingFileError, UserError
from ..files import atomic_write
from ..model.model import DecoderLM
from ..model.positions import rope_half_to_interleaved, rope_interleaved_to_half
from ..model.weights import VERIFY_HINT, load_state, unwrap_model
from ..tokenizers import ByteTokenizer, CharTokenizer, GPT2Tokenizer, Tokenizer
from ..tokenizers.gguf_vocab import gguf_tokenizer
from ..tokenizers.gpt2 import GPT2_BPE_DIR
from ..tokenizers.hf_json import byte_to_unicode
from ..tokenizers.load import tokenizer_from_dict
from .targets import DTYPES, export_target

__all__ = ["check_gguf_dtype", "gguf_vocab", "load_gguf", "load_gguf_tokenizer", "save_gguf"]

TOKENIZER_KEY = "decoderlm.tokenizer"
DIGEST_KEY = "decoderlm.tensor_data_sha256"
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


def _gguf_tensors(model: DecoderLM, arch: str) -> dict[str, torch.Tensor]:
    """The model's tensors under GGUF's names, float32 on the CPU, [out, in]."""
    c, out = model.config, {}
    for key, tensor in model.state_dict().items():
        tensor = tensor.detach().float().cpu()
        parts = key.split(".")
        if parts[0] == "blocks":
            name = f"blk.{parts[1]}.{_BLOCK['.'.join(parts[2:-1])]}"
            if name.endswith("attn_qkv") and arch == "llama":
                q, k, v = tensor.split(c.d_model, dim=0)
                out[f"blk.{parts[1]}.attn_q.{parts[-1]}"] = rope_half_to_interleaved(q, c.n_heads)
                out[f"blk.{parts[1]}.attn_k.{parts[-1]}"] = rope_half_to_interleaved(k, c.n_heads)
                out[f"blk.{parts[1]}.attn_v.{parts[-1]}"] = v
                continue
            out[f"{name}.{parts[-1]}"] = tensor
        elif key == "lm_head.weight":
            if not c.tie_embeddings:
                out["output.weight"] = tensor[: c.vocab_size]
        else:
            rows = tensor[: c.vocab_size] if parts[0] == "tok_emb" else tensor
            out[f"{_TOP[parts[0]]}.{parts[-1]}"] = rows
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
        model: a GPT-2- or Llama-shaped DecoderLM (see `decoderlm.io.targets`).
        tokenizer: its tokenizer (char, byte or gpt2; vocab_size equal to the model's).
        path: the file to write (replaced if it exists).
        dtype: "f32" | "f16" | "bf16" | "q8_0" (see the module docstring).

    Returns:
        the architecture written ("gpt2" | "llama").

    Raises:
        UserError: the gguf package is missing, the model does not export to GGUF (the
            blocking options named), an unknown
            dtype or one the model's row lengths cannot take, or a tokenizer that does not fit.
    """
    gguf = _gguf_package()

    model = unwrap_model(model)
    c = model.config
    arch = export_target(c, "gguf")
    check_gguf_dtype(c, dtype)
    if tokenizer.vocab_size != c.vocab_size:
        raise UserError(
            f"the tokenizer has {tokenizer.vocab_size} tokens but the model expects "
            f"vocab_size={c.vocab_size}"
        )
    tokens, types, merges = gguf_vocab(tokenizer)
    encoded = {name: _encoded(name, t, dtype) for name, t in _gguf_tensors(model, arch).items()}
    digest = _tensor_digest(np.ascontiguousarray(array) for array, _ in encoded.values())

    def write(tmp: str) -> None:
        w = gguf.GGUFWriter(tmp, arch)
        w.add_name("decoderlm")
        w.add_file_type(_FILE_TYPES[dtype])
        w.add_context_length(c.max_positions)
        w.add_embedding_length(c.d_model)
        w.add_feed_forward_length(c.d_ff)
        w.add_block_count(c.n_layers)
        w.add_head_count(c.n_heads)
        if arch == "llama":
            w.add_head_count_kv(c.n_heads)
            w.add_layer_norm_rms_eps(c.norm_eps)
            w.add_rope_dimension_count(c.head_dim)
            w.add_rope_freq_base(c.rope_base)
        else:
            w.add_layer_norm_eps(c.norm_eps)
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


def _tensor_digest(arrays) -> str:
    """The sha256 hex digest of the arrays' bytes, one after the other."""
    digest = hashlib.sha256()
    for array in arrays:
        digest.update(array)
    return digest.hexdigest()


def _verify(path: Path, recorded: str | None, reader) -> None:
    """Check the tensor data of a file read by gguf.GGUFReader against the digest its
    decoderlm key records (None: a file without one, e.g. llama.cpp's converter's: no check).

    Raises:
        UserError: the digests differ (both named, with the skip flag).
    """
    if recorded is None:
        return
    actual = _tensor_digest(np.ascontiguousarray(t.data) for t in reader.tensors)
    if actual != recorded:
        raise UserError(
            f"{path}: its tensor data has sha256 {actual} but the file records {recorded} "
            f"({DIGEST_KEY}; damaged or replaced); {VERIFY_HINT}"
        )


def _reader(path: Path):
    """(gguf.GGUFReader, metadata {key: value}) of an existing GGUF file `path`.

    Raises:
        MissingFileError: no such file. UserError: the gguf package is missing, a
            directory, or not a readable GGUF file.
    """
    if path.is_dir():
        raise UserError(f"{path} is a directory; --gguf takes one GGUF file (a run: --run)")
    if not path.is_file():
        raise MissingFileError(f"GGUF file {path} not found")
    gguf = _gguf_package()
    try:
        reader = gguf.GGUFReader(path)
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
    verify, its tensor data is checked first against the digest the file records."""
    reader, metadata = _reader(path)
    gguf = _gguf_package()
    if verify:
        _verify(path, metadata.get(DIGEST_KEY), reader)
    tensors = {}
    for t in reader.tensors:
        values = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
        shape = [int(n) for n in reversed(t.shape)]
        tensors[t.name] = torch.from_numpy(np.array(values, dtype=np.float32).reshape(shape))
    return metadata, tensors


def _config(meta: dict, tensors: dict, arch: str, source: Path) -> ModelConfig:
    """The ModelConfig a file's metadata and tensor shapes describe."""
    get = lambda key, default=None: meta.get(f"{arch}.{key}", default)  # noqa: E731

    def need(name: str, kind: str = "tensor"):
        found = tensors.get(name) if kind == "tensor" else get(name)
        if found is None:
            raise UserError(
                f"{source} has no {kind} {name if kind == 'tensor' else f'{arch}.{name}'}, "
                f"which every {arch} GGUF file has (damaged, or written by another tool?)"
            )
        return found

    tied = "output.weight" not in tensors or torch.equal(
        tensors["output.weight"], need("token_embd.weight")
    )
    fields = dict(
        vocab_size=need("token_embd.weight").size(0),
        n_layers=need("block_count", "key"),
        n_heads=need("attention.head_count", "key"),
        d_model=need("embedding_length", "key"),
        d_ff=need("blk.0.ffn_up.weight").size(0),
        tie_embeddings=tied,
    )
    if arch == "gpt2":
        block_size = need("position_embd.weight").size(0)
        shape = dict(activation="gelu_tanh", norm_eps=get("attention.layer_norm_epsilon", 1e-5))
    else:
        heads_kv = get("attention.head_count_kv", fields["n_heads"])
        if heads_kv != fields["n_heads"]:
            raise UserError(
                f"{source} uses grouped-query attention ({heads_kv} key/value heads for "
                f"{fields['n_heads']} query heads), which decoderlm's attention does not have"
            )
        block_size = need("context_length", "key")
        shape = dict(
            pos_encoding="rope",
            norm="rmsnorm",
            mlp="swiglu",
            bias=False,
            rope_base=float(get("rope.freq_base", 10000.0)),
            norm_eps=get("attention.layer_norm_rms_epsilon", 1e-5),
        )
    return ModelConfig(block_size=block_size, **fields, **shape)


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
    """A GGUF file (architecture "gpt2" or "llama") as a DecoderLM (eval mode, float32) and
    its tokenizer. Quantised tensors (f16, bf16, q8_0, ...) are dequantised to float32.
    verify: check the tensor data against the sha256 a decoderlm export records in the file
    (key "decoderlm.tensor_data_sha256"; files without it load unchecked).

    Raises:
        MissingFileError: no such file.
        UserError: the gguf package is missing, a directory, not a readable GGUF file,
            tensor data that does not match
            its recorded sha256 (verify), another architecture,
            grouped-query attention, tensors that do not match the metadata, or a tokenizer
            decoderlm cannot rebuild.
    """
    path = Path(path)
    meta, tensors = _read(path, verify)
    arch = meta.get("general.architecture")
    if arch not in ("gpt2", "llama"):
        raise UserError(f"{path} holds a {arch!r} model; decoderlm reads 'gpt2' and 'llama'")
    config = _config(meta, tensors, arch, path)
    back = {v: k for k, v in {**_BLOCK, **_TOP, "lm_head": "output"}.items()}
    state, file_keys, qkv = {}, {}, {}
    for name, tensor in tensors.items():
        parts = name.split(".")
        if parts[0] == "blk" and parts[2] in ("attn_q", "attn_k", "attn_v"):
            if parts[2] != "attn_v":
                tensor = rope_interleaved_to_half(tensor, config.n_heads)
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
    model = load_state(DecoderLM(config), state, path, file_keys, "its metadata")
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
