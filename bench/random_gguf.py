"""GGUF files at real models' shapes with random weights, converted by llama-quantize: speed tests at real sizes.

A decode step's speed depends on the shapes and the formats of the weights, not on
their values, so a file of random weights at Llama 3.2 1B's shape times what the
real file would. Each file is first written as float16 (norms float32; the mixtures
of experts as random Q8_0, below) with the default model's tokenizer (its
vocabulary, so the embedding and LM head are 49,152 rows rather than the real
model's), then converted by llama.cpp's own ``llama-quantize``
(``bench/peers/setup_llamacpp.sh`` builds it) into each type asked for, as a user's
file would be: Q4_K_M mixes Q4_K and Q6_K inside a layer. The source file is
deleted afterwards unless ``--keep-source``.

Mixtures of experts are written as ``qwen3moe`` files (llama.cpp's Qwen3-MoE: QK-norm, a float32 router, each
projection of every expert stacked in one 3-D tensor), which both llama.cpp and Conveyor run. OLMoE-1B-7B's shape
is one too, though OLMoE normalizes its queries and keys over the whole projection rather than per head, and
does not rescale its top-8 weights to sum to 1: the same multiplies grouped otherwise and eight divides, beside
the 50 million weights a token reads in each layer's experts, so the time is OLMoE's.

The mixtures of experts (the large ones about 7 and 15 billion weights) start from random Q8_0 blocks: random
int8 codes and a float16 scale per 32 weights, about half the disk (the half-30B's float16 file would be 30 GB)
and quick to write; ``llama-quantize --allow-requantize`` then dequantizes each tensor to float32 and quantizes
it as it would a float16 one. The file it writes is as fair a speed test as one from real weights: llama-quantize
picks each tensor's type from its name, shape and layer (the Q4_K_M mix: Q6_K for the LM head and for some
layers' values and down projections), never from the values, and a type's blocks are the same bytes whatever
they hold. The half-30B took 44 s to write (15 GB) and 14 minutes to quantize on 2 busy cores, under 1.5 GB
of RAM at most: one tensor at a time. A random router spreads tokens over the experts about evenly, as a
trained one is taught to; one request reads its top-k experts in every layer either way.

    .venv/bin/python bench/random_gguf.py llama3.2-1b --types Q4_K_M,Q8_0,Q4_0
    .venv/bin/python bench/random_gguf.py llama3.1-8b --types Q4_K_M
    .venv/bin/python bench/random_gguf.py qwen3-30b-a3b-half --types Q4_K_M
    .venv/bin/conveyor bench compare --model out/models/llama3.2-1b-Q4_K_M.gguf --peers llamacpp
"""

from __future__ import annotations

import argparse
import functools
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import gguf
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
QUANTIZE = ROOT / ".peers" / "llama.cpp" / "build" / "bin" / "llama-quantize"
RANDOM_POOL = 1 << 24  # random float16 values drawn once; each tensor is a window of them, tiled


@dataclass(frozen=True, slots=True)
class Shape:
    """A model's shape as its config states it (the vocabulary is the default model's tokenizer's)."""

    arch: str  # GGUF architecture: llama, qwen3 or qwen3moe
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    head_dim: int
    tied: bool  # the LM head is the token embedding
    rope_theta: float = 500_000.0
    context: int = 131_072
    experts: int = 0  # a mixture of experts' count (0: a dense MLP), how many a token uses, and their width
    experts_used: int = 0
    expert_ffn: int = 0
    source: str = "F16"  # what llama-quantize converts: F16, or random Q8_0 blocks (about half the disk)

    @property
    def moe(self) -> bool:
        """Whether each layer's MLP is a mixture of experts."""
        return self.experts > 0


SHAPES = {
    "llama3.2-1b": Shape("llama", 2048, 16, 32, 8, 8192, 64, tied=True),
    "llama3.2-3b": Shape("llama", 3072, 28, 24, 8, 8192, 128, tied=True),
    "llama3.1-8b": Shape("llama", 4096, 32, 32, 8, 14336, 128, tied=False),
    "qwen3-1.7b": Shape("qwen3", 2048, 28, 16, 8, 6144, 128, tied=True, rope_theta=1_000_000.0, context=40_960),
    "qwen3-4b": Shape("qwen3", 2560, 36, 32, 8, 9728, 128, tied=True, rope_theta=1_000_000.0, context=40_960),
    # What the tests convert: small enough to quantize in a second, K-quant rows (256 wide) included.
    "tiny": Shape("llama", 256, 2, 4, 2, 512, 64, tied=True, context=2048),
    "tiny-qwen3": Shape("qwen3", 256, 2, 4, 2, 512, 64, tied=False, context=2048),
    # OLMoE-1B-7B (its QK-norm and unscaled top-8 weights aside: see above).
    "olmoe-1b-7b": Shape("qwen3moe", 2048, 16, 16, 16, 1024, 128, tied=False, rope_theta=10_000.0, context=4096,
                         experts=64, experts_used=8, expert_ffn=1024, source="Q8_0"),
    # Qwen3-30B-A3B with 24 of its 48 layers, so that its Q4_K_M (about 9 GB) fits 24 GB of RAM beside the rest.
    "qwen3-30b-a3b-half": Shape("qwen3moe", 2048, 24, 32, 4, 6144, 128, tied=False, rope_theta=1_000_000.0,
                                context=40_960, experts=128, experts_used=8, expert_ffn=768, source="Q8_0"),
    # What the tests convert from random Q8_0 blocks, as the large mixtures are.
    "tiny-qwen3moe": Shape("qwen3moe", 256, 2, 4, 2, 512, 64, tied=False, context=2048, experts=8, experts_used=2,
                           expert_ffn=128, source="Q8_0"),
}
NORM, ROUTER, MATRIX = "norm", "router", "matrix"  # a tensor's kind: float32 ones, float32 random, quantizable


@functools.lru_cache(maxsize=1)
def default_tokenizer() -> gguf.GGUFReader:
    """The default model's file, whose tokenizer every shape takes: read once per process (gguf's reader takes
    about 2 s over its 49k tokens and merges)."""
    from conveyor.model.weights.paths import default_model_path

    return gguf.GGUFReader(str(default_model_path()))


def tensors(shape: Shape, vocab: int) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, numpy shape, kind) of every tensor, in llama.cpp's names."""
    found = [("token_embd.weight", (vocab, shape.hidden), MATRIX), ("output_norm.weight", (shape.hidden,), NORM)]
    if not shape.tied:
        found.append(("output.weight", (vocab, shape.hidden), MATRIX))
    for i in range(shape.layers):
        found += [(f"blk.{i}.{name}", dims, kind) for name, dims, kind in _layer(shape)]
    return found


def _layer(shape: Shape) -> list[tuple[str, tuple[int, ...], str]]:
    """(name under ``blk.N.``, numpy shape, kind) of one layer's tensors."""
    q, kv, h = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim, shape.hidden
    found = [("attn_norm.weight", (h,), NORM), ("attn_q.weight", (q, h), MATRIX), ("attn_k.weight", (kv, h), MATRIX),
             ("attn_v.weight", (kv, h), MATRIX), ("attn_output.weight", (h, q), MATRIX),
             ("ffn_norm.weight", (h,), NORM)]
    if shape.arch in ("qwen3", "qwen3moe"):
        found += [("attn_q_norm.weight", (shape.head_dim,), NORM), ("attn_k_norm.weight", (shape.head_dim,), NORM)]
    if shape.moe:
        e, f = shape.experts, shape.expert_ffn
        return [*found, ("ffn_gate_inp.weight", (e, h), ROUTER), ("ffn_gate_exps.weight", (e, f, h), MATRIX),
                ("ffn_up_exps.weight", (e, f, h), MATRIX), ("ffn_down_exps.weight", (e, h, f), MATRIX)]
    return [*found, ("ffn_gate.weight", (shape.ffn, h), MATRIX), ("ffn_up.weight", (shape.ffn, h), MATRIX),
            ("ffn_down.weight", (h, shape.ffn), MATRIX)]


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
    """The file llama-quantize converts, at ``path``, tensor by tensor (never more than one in memory): float16
    matrices, or random Q8_0 blocks where ``shape.source`` says so; norms and the router float32.

    ``block_types`` writes the matrices whose names end in one of its keys as random blocks of that quantized
    type instead (``{"attn_v.weight": "Q6_K"}``): a mix like llama-quantize's, where llama-quantize is not built."""
    if shape.source != "F16":
        block_types = {".weight": shape.source, **(block_types or {})}
    writer = gguf.GGUFWriter(str(path), shape.arch)
    writer.add_name(f"random weights at {path.stem}'s shape")
    _add_hyperparameters(writer, shape)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if shape.source == "F16" else gguf.LlamaFileType.MOSTLY_Q8_0)
    vocab = _copy_tokenizer(default_tokenizer(), writer)
    writer.add_uint32(f"{shape.arch}.vocab_size", vocab)
    layout = [(name, dims, kind, _stored_type(name, kind, block_types or {}))
              for name, dims, kind in tensors(shape, vocab)]
    for name, dims, _, stored in layout:
        _add_tensor_info(writer, name, dims, stored)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    pool = (rng.standard_normal(RANDOM_POOL, dtype=np.float32) * 0.02).astype(np.float16)
    for _, dims, kind, stored in layout:
        writer.write_tensor_data(_random_tensor(dims, kind, stored, pool, rng))
    writer.close()


def _add_hyperparameters(writer: gguf.GGUFWriter, shape: Shape) -> None:
    """The architecture's keys llama.cpp and Conveyor read the shape from."""
    a = shape.arch
    for key, value in (("block_count", shape.layers), ("context_length", shape.context),
                       ("embedding_length", shape.hidden), ("feed_forward_length", shape.ffn),
                       ("attention.head_count", shape.heads), ("attention.head_count_kv", shape.kv_heads),
                       ("attention.key_length", shape.head_dim), ("attention.value_length", shape.head_dim),
                       ("rope.dimension_count", shape.head_dim)):
        writer.add_uint32(f"{a}.{key}", value)
    writer.add_float32(f"{a}.rope.freq_base", shape.rope_theta)
    writer.add_float32(f"{a}.attention.layer_norm_rms_epsilon", 1e-5)
    if shape.moe:
        writer.add_uint32(f"{a}.expert_count", shape.experts)
        writer.add_uint32(f"{a}.expert_used_count", shape.experts_used)
        writer.add_uint32(f"{a}.expert_feed_forward_length", shape.expert_ffn)


def _stored_type(name: str, kind: str, block_types: dict[str, str]) -> str:
    """The type a tensor is written as: F32 for norms and the router, else its block type or F16."""
    if kind != MATRIX:
        return "F32"
    return next((block for suffix, block in block_types.items() if name.endswith(suffix)), "F16")


def _add_tensor_info(writer: gguf.GGUFWriter, name: str, dims: tuple[int, ...], stored: str) -> None:
    """A tensor's entry in the header: numpy shape and dtype for floats, byte shape and block type for blocks."""
    if stored in ("F32", "F16"):
        dtype = np.dtype(np.float32 if stored == "F32" else np.float16)
        writer.add_tensor_info(name, dims, dtype, int(np.prod(dims)) * dtype.itemsize)
        return
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[stored]]
    writer.add_tensor_info(name, (*dims[:-1], dims[-1] // block * size), np.dtype(np.uint8),
                           int(np.prod(dims)) // block * size, gguf.GGMLQuantizationType[stored])


def _random_tensor(dims: tuple[int, ...], kind: str, stored: str, pool: np.ndarray,
                   rng: np.random.Generator) -> np.ndarray:
    """A tensor's data: ones for a norm, random blocks of a quantized type, else a window of the random pool."""
    if kind == NORM:
        return np.ones(dims, dtype=np.float32)
    if stored not in ("F32", "F16"):
        return random_blocks(stored, dims, rng)
    count = int(np.prod(dims))
    start = int(rng.integers(0, RANDOM_POOL))
    values = np.resize(np.roll(pool, -start), count) if count > RANDOM_POOL - start else pool[start:start + count]
    return values.reshape(dims).astype(np.float32 if stored == "F32" else np.float16, copy=False)


def quantize(source: Path, target: Path, kind: str, threads: int, pure: bool = False) -> None:
    """``llama-quantize`` of ``source`` into ``kind`` (``--pure``: every tensor that type, no mix).

    ``--allow-requantize`` lets it take a source of random Q8_0 blocks, which it dequantizes to float32 as it
    widens float16; a float16 source has nothing it would refuse."""
    if not QUANTIZE.exists():
        raise FileNotFoundError(f"no {QUANTIZE}: run `bash bench/peers/setup_llamacpp.sh` first")
    flags = ["--allow-requantize", *(["--pure"] if pure else [])]
    command = [str(QUANTIZE), *flags, str(source), str(target), kind, str(threads)]
    run = subprocess.run(command, capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"llama-quantize failed ({run.returncode}): {(run.stdout + run.stderr)[-2000:]}")


def make(name: str, kinds: list[str], out: Path, threads: int, pure: bool = False, keep_source: bool = False,
         untied: bool = False, source: str | None = None) -> list[Path]:
    """Every file of ``name``'s shape asked for, in ``out``: ``{name}[-untied]-{kind}.gguf``. The source file
    (``{name}-F16.gguf``, or ``-Q8_0.gguf``: ``source`` overrides the shape's) goes afterwards unless kept or
    asked for itself."""
    shape = replace(SHAPES[name], source=source or SHAPES[name].source)
    if untied:
        shape, name = replace(shape, tied=False), f"{name}-untied"
    out.mkdir(parents=True, exist_ok=True)
    origin = out / f"{name}-{shape.source}.gguf"
    start = time.perf_counter()
    if not origin.exists():
        write_f16(shape, origin)
        print(f"{origin}: {origin.stat().st_size / 2**20:,.0f} MiB in {time.perf_counter() - start:.0f} s", flush=True)
    made = []
    for kind in kinds:
        target = out / f"{name}-{kind}{'-pure' if pure else ''}.gguf"
        if target == origin:
            made.append(target)
            continue
        start = time.perf_counter()
        quantize(origin, target, kind, threads, pure)
        print(f"{target}: {target.stat().st_size / 2**20:,.0f} MiB in {time.perf_counter() - start:.0f} s", flush=True)
        made.append(target)
    if not keep_source and kinds and origin not in made:
        origin.unlink()
    return made


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("--types", default="Q4_K_M", help="llama-quantize types, comma-separated (none: F16 only)")
    parser.add_argument("--out", default=str(ROOT / "out" / "models"))
    parser.add_argument("--threads", type=int, default=2, help="llama-quantize's threads")
    parser.add_argument("--pure", action="store_true", help="every tensor the one type (llama-quantize --pure)")
    parser.add_argument("--untied", action="store_true", help="an LM head of its own, whatever the shape says")
    parser.add_argument("--source", choices=["F16", "Q8_0"], help="the file llama-quantize converts (default: the "
                        "shape's, Q8_0 for the large mixtures of experts)")
    parser.add_argument("--keep-source", "--keep-f16", action="store_true", help="keep the file converted from")
    args = parser.parse_args()
    kinds = [k for k in args.types.split(",") if k and k.lower() != "none"]
    make(args.shape, kinds, Path(args.out), args.threads, args.pure, args.keep_source or not kinds, args.untied,
         args.source)
    return 0


if __name__ == "__main__":
    sys.exit(main())
