"""How far a quantized file's next-token distributions lie from its float32 reference's: KL divergence, as
``llama-perplexity --kl-divergence`` reports it, for Conveyor and, where it is set up, llama.cpp (each engine
against its own float32 run of the same weights; conveyor/benchmarks/divergence.py says why this measure and
how it is taken). Beside it each quantized run's perplexity over the same tokens.

``--kv-cache-dtype`` sets both engines' cache (llama.cpp's ``-ctk``/``-ctv``): each is another draw of the
activations' rounding, which moves perplexity far more than it moves the KL divergence.

    python bench/kl_divergence.py [--model M] [--context 256] [--kv-cache-dtype float16]
        [--text tests/data/declaration-of-independence.txt]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from conveyor.benchmarks.divergence import LLAMA_BIN, LLAMA_CACHE_TYPES, conveyor_divergence, llama_cpp_divergence
from conveyor.benchmarks.report import format_table
from conveyor.core.config import EngineConfig, usable_cores
from conveyor.model.weights.paths import gguf_source, resolve_model

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a GGUF file or packaged name (default: the default model)")
    parser.add_argument("--text", type=Path, default=ROOT / "tests" / "data" / "declaration-of-independence.txt")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--kv-cache-dtype", choices=tuple(LLAMA_CACHE_TYPES), default="float16",
                        help="both engines' KV cache (llama.cpp's default and Conveyor's for a GGUF file: float16)")
    parser.add_argument("--no-llamacpp", action="store_true", help="Conveyor only")
    args = parser.parse_args()
    config = EngineConfig(model=args.model, max_model_len=args.context + 1, enable_prefix_caching=False,
                          kv_cache_dtype=args.kv_cache_dtype)
    rows = [["Conveyor", conveyor_divergence(config, args.text.read_text(encoding="utf-8"), args.context)]]
    gguf = gguf_source(resolve_model(config.model))
    if not args.no_llamacpp and gguf is not None and (LLAMA_BIN / "llama-perplexity").is_file():
        rows.append(["llama.cpp", llama_cpp_divergence(gguf, args.text, args.context, usable_cores(),
                                                       args.kv_cache_dtype)])
    print(f"model {gguf or config.model}; chunks of {args.context}; {args.kv_cache_dtype} KV cache")
    print(format_table(["engine", "mean KLD", "median KLD", "RMS Δp", "same top token", "perplexity"],
                       [[name, f"{d.mean_kld:.6f}", f"{d.median_kld:.6f}", f"{d.rms_dp:.3f}%", f"{d.same_top:.2f}%",
                         f"{d.perplexity:.4f}"] for name, d in rows]))


if __name__ == "__main__":
    main()
