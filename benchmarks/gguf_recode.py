"""Re-encode a GGUF file's weights at f32, f16 or q8_0, keeping its metadata: llama.cpp's side of
vs_llamacpp.py's --gguf precision pairs (decoderlm dequantizes the original file itself).

    python benchmarks/gguf_recode.py SRC.gguf OUT.gguf --outtype f32|f16|q8_0
"""

from __future__ import annotations

import os
from pathlib import Path

from common import arguments

OUTTYPES = ("f32", "f16", "q8_0")


def recode(src: Path, out: Path, outtype: str) -> Path:
    """Write `out`: `src`'s metadata and tensors, every tensor dequantized to float32 and then
    encoded as `outtype`.

    Metadata: every key/value of src in its order, with the same value types (arrays with
    their element type), but the reader's own GGUF.* header fields, general.architecture (the
    writer's first key, from src) and general.file_type, which is set to llama.cpp's file
    type for outtype (ALL_F32, MOSTLY_F16, MOSTLY_Q8_0); general.alignment is kept and used.
    Tensors: in src's order and shapes; outtype f32: all float32; f16: tensors of 2 or more
    dimensions float16, 1-D ones (norms, biases) float32; q8_0: tensors of 2 or more dimensions
    Q8_0 when their rows are a multiple of 32 values, else float16, 1-D ones float32 (as
    llama.cpp's convert_hf_to_gguf.py does). Written to out + ".tmp", then renamed to out.

    Returns out. Raises ValueError for an outtype not in OUTTYPES, a big-endian src, or a
    metadata array gguf cannot write (empty, or of arrays); NotImplementedError (gguf's) for
    a tensor type gguf cannot dequantize; OSError for unreadable src or unwritable out.
    """
    import gguf
    import numpy as np
    from gguf.quants import dequantize, quantize

    types = {
        "f32": (gguf.LlamaFileType.ALL_F32, gguf.GGMLQuantizationType.F32),
        "f16": (gguf.LlamaFileType.MOSTLY_F16, gguf.GGMLQuantizationType.F16),
        "q8_0": (gguf.LlamaFileType.MOSTLY_Q8_0, gguf.GGMLQuantizationType.Q8_0),
    }
    if outtype not in types:
        raise ValueError(f"gguf_recode: outtype {outtype!r} is not one of {', '.join(OUTTYPES)}")
    file_type, matrix_type = types[outtype]
    src, out = Path(src), Path(out)
    reader = gguf.GGUFReader(src)
    if reader.endianess != gguf.GGUFEndian.LITTLE:
        raise ValueError(f"gguf_recode: {src} is big-endian; only little-endian files are read")
    arch = reader.get_field("general.architecture")
    tmp = out.with_name(out.name + ".tmp")
    writer = gguf.GGUFWriter(tmp, arch.contents() if arch else "llama")
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        if key == "general.file_type":
            writer.add_file_type(int(file_type))
        elif key == "general.alignment":
            writer.add_custom_alignment(int(field.contents()))
        elif field.types[0] == gguf.GGUFValueType.ARRAY:
            if len(field.types) != 2 or field.types[1] == gguf.GGUFValueType.ARRAY:
                what = "empty" if len(field.types) == 1 else "an array of arrays"
                raise ValueError(f"gguf_recode: {src}'s {key} is {what}; gguf cannot write it")
            writer.add_key_value(key, field.contents(), gguf.GGUFValueType.ARRAY, field.types[1])
        else:
            writer.add_key_value(key, field.contents(), field.types[0])
    if "general.file_type" not in reader.fields:
        writer.add_file_type(int(file_type))
    for tensor in reader.tensors:
        # numpy's shape (rows last): tensor.data's for unquantized types; tensor.shape reversed
        values = dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
        values = values.reshape(tuple(int(n) for n in reversed(tensor.shape.tolist())))
        qtype = gguf.GGMLQuantizationType.F32 if values.ndim < 2 else matrix_type
        if qtype == gguf.GGMLQuantizationType.Q8_0 and values.shape[-1] % 32:
            qtype = gguf.GGMLQuantizationType.F16
        encoded = quantize(values, qtype)
        q8 = qtype == gguf.GGMLQuantizationType.Q8_0  # uint8 blocks: the writer needs the type
        writer.add_tensor(tensor.name, encoded, raw_dtype=qtype if q8 else None)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("src", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--outtype", required=True, choices=OUTTYPES)
    args = parser.parse_args()
    print(recode(args.src, args.out, args.outtype))


if __name__ == "__main__":
    main()
