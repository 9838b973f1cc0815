"""GGUF files at real models' shapes with random weights, converted by llama-quantize: speed tests at real sizes.

A decode step's speed depends on the shapes and the formats of the weights, not on
their values, so a file of random weights at Llama 3.2 1B's shape times what the
real file would. Each file is first written as float16 (norms float32) with the
default model's tokenizer (its vocabulary, so the embedding and LM head are
49,152 rows rather than the real model's), then converted by llama.cpp's own
``llama-quantize`` (``bench/peers/setup_llamacpp.sh`` builds it) into each type
asked for, as a user's file would be: Q4_K_M mixes Q4_K and Q6_K inside a layer.
The float16 file is deleted afterwards unless ``--keep-f16``.

    .venv/bin/python bench/random_gguf.py llama3.2-1b --types Q4_K_M,Q8_0,Q4_0
    .venv/bin/python bench/random_gguf.py llama3.1-8b --types Q4_K_M
    .venv/bin/conveyor bench compare --model out/models/llama3.2-1b-Q4_K_M.gguf --peers llamacpp
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
QUANTIZE = ROOT / ".peers" / "llama.cpp" / "build" / "bin" / "llama-quantize"
RANDOM_POOL = 1 << 24  # random float16 values drawn once; each tensor is a window of them, tiled


@dataclass(frozen=True, slots=True)
class Shape:
    """A model's shape as its config states it (the vocabulary is the default model's tokenizer's)."""

    arch: str  # GGUF architecture: llama or qwen3
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    head_dim: int
    tied: bool  # the LM head is the token embedding
    rope_theta: float = 500_000.0
    context: int = 131_072


SHAPES = {
    "llama3.2-1b": Shape("llama", 2048, 16, 32, 8, 8192, 64, tied=True),
    "llama3.2-3b": Shape("llama", 3072, 28, 24, 8, 8192, 128, tied=True),
    "llama3.1-8b": Shape("llama", 4096, 32, 32, 8, 14336, 128, tied=False),
    "qwen3-1.7b": Shape("qwen3", 2048, 28, 16, 8, 6144, 128, tied=True, rope_theta=1_000_000.0, context=40_960),
    "qwen3-4b": Shape("qwen3", 2560, 36, 32, 8, 9728, 128, tied=True, rope_theta=1_000_000.0, context=40_960),
    # What the tests convert: small enough to quantize in a second, K-quant rows (256 wide) included.
    "tiny": Shape("llama", 256, 2, 4, 2, 512, 64, tied=True, context=2048),
    "tiny-qwen3": Shape("qwen3", 256, 2, 4, 2, 512, 64, tied=False, context=2048),
}


def default_tokenizer() -> gguf.GGUFReader:
    from conveyor.model.weights.paths import default_model_path

    return gguf.GGUFReader(str(default_model_path()))


def tensors(shape: Shape, vocab: int) -> list[tuple[str, tuple[int, ...], bool]]:
    """(name, numpy shape, is a norm) of every tensor, in llama.cpp's names."""
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    found = [("token_embd.weight", (vocab, shape.hidden), False), ("output_norm.weight", (shape.hidden,), True)]
    if not shape.tied:
        found.append(("output.weight", (vocab, shape.hidden), False))
    for i in range(shape.layers):
        b = f"blk.{i}."
        found += [(b + "attn_norm.weight", (shape.hidden,), True), (b + "attn_q.weight", (q, shape.hidden), False),
                  (b + "attn_k.weight", (kv, shape.hidden), False), (b + "attn_v.weight", (kv, shape.hidden), False),
                  (b + "attn_output.weight", (shape.hidden, q), False), (b + "ffn_norm.weight", (shape.hidden,), True),
                  (b + "ffn_gate.weight", (shape.ffn, shape.hidden), False),
                  (b + "ffn_up.weight", (shape.ffn, shape.hidden), False),
                  (b + "ffn_down.weight", (shape.hidden, shape.ffn), False)]
        if shape.arch == "qwen3":
            found += [(b + "attn_q_norm.weight", (shape.head_dim,), True),
                      (b + "attn_k_norm.weight", (shape.head_dim,), True)]
    return found


def _copy_tokenizer(reader: gguf.GGUFReader, writer: gguf.GGUFWriter) -> int:
    """The default model's tokenizer keys into ``writer``; its vocabulary size."""
    vocab = 0
    for name, field in reader.fields.items():
        if not name.startswith("tokenizer."):
            continue
        value = field.contents()
        sub = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, value, field.types[0], sub_type=sub)
        if name == "tokenizer.ggml.tokens":
            vocab = len(value)
    return vocab


def random_blocks(type_name: str, dims: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Random blocks of a quantized type for a tensor of numpy shape ``dims``: random codes and sub-scales, the
    float16 scales (d, dmin) drawn so that weights stay near the float16 file's (|w| up to about 0.03)."""
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]
    rows, k = int(np.prod(dims[:-1])), dims[-1]
    raw = rng.integers(0, 256, (rows, k // block * size), dtype=np.uint8)
    blocks = raw.reshape(-1, size)
    scale_at = {"Q6_K": (208,), "Q3_K": (108,), "Q2_K": (80, 82), "IQ4_XS": (0,)}.get(
        type_name, (0, 2) if type_name.endswith("_K") or type_name.endswith("_1") else (0,))
    top = 0.03 / {"Q4_K": 63 * 15, "Q5_K": 63 * 31, "Q6_K": 128 * 32, "IQ4_XS": 32 * 127, "Q3_K": 32 * 4,
                  "Q2_K": 15 * 3}.get(type_name, 127)
    for offset in scale_at:
        values = rng.uniform(top / 4, top, len(blocks)).astype(np.float16)
        blocks[:, offset:offset + 2] = values.view(np.uint8).reshape(-1, 2)
    return raw


def write_f16(shape: Shape, path: Path, seed: int = 0, block_types: dict[str, str] | None = None) -> None:
    """The float16 file of ``shape`` at ``path``, tensor by tensor (never more than one in memory).

    ``block_types`` writes the tensors whose names end in one of its keys as random blocks of that quantized
    type instead (``{"attn_v.weight": "Q6_K"}``): a mix like llama-quantize's, where llama-quantize is not built."""
    block_types = block_types or {}

    def block_type(name: str) -> str | None:
        return next((kind for suffix, kind in block_types.items() if name.endswith(suffix)), None)

    writer = gguf.GGUFWriter(str(path), shape.arch)
    a = shape.arch
    writer.add_name(f"random weights at {path.stem}'s shape")
    writer.add_uint32(f"{a}.block_count", shape.layers)
    writer.add_uint32(f"{a}.context_length", shape.context)
    writer.add_uint32(f"{a}.embedding_length", shape.hidden)
    writer.add_uint32(f"{a}.feed_forward_length", shape.ffn)
    writer.add_uint32(f"{a}.attention.head_count", shape.heads)
    writer.add_uint32(f"{a}.attention.head_count_kv", shape.kv_heads)
    writer.add_uint32(f"{a}.attention.key_length", shape.head_dim)
    writer.add_uint32(f"{a}.attention.value_length", shape.head_dim)
    writer.add_uint32(f"{a}.rope.dimension_count", shape.head_dim)
    writer.add_float32(f"{a}.rope.freq_base", shape.rope_theta)
    writer.add_float32(f"{a}.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    vocab = _copy_tokenizer(default_tokenizer(), writer)
    writer.add_uint32(f"{a}.vocab_size", vocab)
    layout = tensors(shape, vocab)
    for name, dims, norm in layout:
        if (kind := block_type(name)) is not None:
            block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
            writer.add_tensor_info(name, (*dims[:-1], dims[-1] // block * size), np.dtype(np.uint8),
                                   int(np.prod(dims)) // block * size, gguf.GGMLQuantizationType[kind])
            continue
        dtype = np.float32 if norm else np.float16
        writer.add_tensor_info(name, dims, np.dtype(dtype), int(np.prod(dims)) * np.dtype(dtype).itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    pool = (rng.standard_normal(RANDOM_POOL, dtype=np.float32) * 0.02).astype(np.float16)
    for name, dims, norm in layout:
        if norm:
            writer.write_tensor_data(np.ones(dims, dtype=np.float32))
            continue
        if (kind := block_type(name)) is not None:
            writer.write_tensor_data(random_blocks(kind, dims, rng))
            continue
        count = int(np.prod(dims))
        start = int(rng.integers(0, RANDOM_POOL))
        values = np.resize(np.roll(pool, -start), count) if count > RANDOM_POOL - start else pool[start:start + count]
        writer.write_tensor_data(values.reshape(dims))
    writer.close()


def quantize(source: Path, target: Path, kind: str, threads: int, pure: bool = False) -> None:
    """``llama-quantize`` of ``source`` into ``kind`` (``--pure``: every tensor that type, no mix)."""
    if not QUANTIZE.exists():
        raise FileNotFoundError(f"no {QUANTIZE}: run `bash bench/peers/setup_llamacpp.sh` first")
    command = [str(QUANTIZE), *(["--pure"] if pure else []), str(source), str(target), kind, str(threads)]
    run = subprocess.run(command, capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"llama-quantize failed ({run.returncode}): {(run.stdout + run.stderr)[-2000:]}")


def make(name: str, kinds: list[str], out: Path, threads: int, pure: bool = False, keep_f16: bool = False,
         untied: bool = False) -> list[Path]:
    """Every file of ``name``'s shape asked for, in ``out``: ``{name}[-untied]-{kind}.gguf``."""
    shape = SHAPES[name]
    if untied:
        from dataclasses import replace

        shape, name = replace(shape, tied=False), f"{name}-untied"
    out.mkdir(parents=True, exist_ok=True)
    f16 = out / f"{name}-F16.gguf"
    start = time.perf_counter()
    if not f16.exists():
        write_f16(shape, f16)
        print(f"{f16}: {f16.stat().st_size / 2**20:,.0f} MiB in {time.perf_counter() - start:.0f} s", flush=True)
    made = []
    for kind in kinds:
        target = out / f"{name}-{kind}{'-pure' if pure else ''}.gguf"
        start = time.perf_counter()
        quantize(f16, target, kind, threads, pure)
        print(f"{target}: {target.stat().st_size / 2**20:,.0f} MiB in {time.perf_counter() - start:.0f} s", flush=True)
        made.append(target)
    if not keep_f16 and kinds:
        f16.unlink()
    return made


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("--types", default="Q4_K_M", help="llama-quantize types, comma-separated (none: F16 only)")
    parser.add_argument("--out", default=str(ROOT / "out" / "models"))
    parser.add_argument("--threads", type=int, default=2, help="llama-quantize's threads")
    parser.add_argument("--pure", action="store_true", help="every tensor the one type (llama-quantize --pure)")
    parser.add_argument("--untied", action="store_true", help="an LM head of its own, whatever the shape says")
    parser.add_argument("--keep-f16", action="store_true")
    args = parser.parse_args()
    kinds = [k for k in args.types.split(",") if k and k.lower() != "none"]
    make(args.shape, kinds, Path(args.out), args.threads, args.pure, args.keep_f16 or not kinds, args.untied)
    return 0


if __name__ == "__main__":
    sys.exit(main())
