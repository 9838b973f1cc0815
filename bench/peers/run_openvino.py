"""OpenVINO GenAI's ``ContinuousBatchingPipeline``: continuous batching over a paged KV cache, float32.

Its CPU plugin keeps the KV cache in 8-bit integers by default (KV_CACHE_PRECISION
u8), a lossy compression that reads a quarter of the bytes per attended
position. Every other engine here keeps it in float32, so that is this runner's
default too (``--kv-cache-precision f32``); ``u8`` runs its own default. Inference runs
in f32 (``--inference-precision f32``) unless told ``bf16``; ``default`` for either
leaves the choice to OpenVINO (inference in bf16 on CPUs with AVX512-BF16 or AMX).

Token-id prompts, greedy, exactly ``output_len`` tokens (ignore_eos, with
min_new_tokens = max_new_tokens). Requests go in through ``add_request`` and the
runner drives ``step()`` itself, so that it sees when each one produced its
first token and when it finished. Runs in .peers/openvino (setup_openvino.sh).
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import openvino as ov
import openvino_genai as ov_genai
import peer_io

# The same limits as Conveyor's defaults: 128 sequences, a 2048-token step, 2 GiB of KV cache.
MAX_NUM_SEQS = 128
MAX_NUM_BATCHED_TOKENS = 2048
CACHE_SIZE_GB = 2


def make_pipeline(model_dir: str, kv_cache_precision: str, threads: int, prefix_caching: bool = False,
                  inference_precision: str = "f32") -> ov_genai.ContinuousBatchingPipeline:
    """``default`` for a precision leaves it to OpenVINO (inference: bf16 where the CPU has AVX512-BF16 or
    AMX, else f32; KV cache: u8)."""
    scheduler = ov_genai.SchedulerConfig()
    scheduler.cache_size = CACHE_SIZE_GB
    scheduler.max_num_seqs = MAX_NUM_SEQS
    scheduler.max_num_batched_tokens = MAX_NUM_BATCHED_TOKENS
    scheduler.dynamic_split_fuse = True
    scheduler.enable_prefix_caching = prefix_caching  # off: every engine computes every prompt (W1, W2)
    properties = {"INFERENCE_PRECISION_HINT": inference_precision, "KV_CACHE_PRECISION": kv_cache_precision,
                  "INFERENCE_NUM_THREADS": threads}
    properties = {key: value for key, value in properties.items() if value != "default"}
    return ov_genai.ContinuousBatchingPipeline(model_dir, scheduler, "CPU", properties)


def generation_config(output_len: int) -> ov_genai.GenerationConfig:
    config = ov_genai.GenerationConfig()
    config.do_sample = False
    config.max_new_tokens = output_len
    config.min_new_tokens = output_len
    config.ignore_eos = True
    return config


def run_together(pipe: ov_genai.ContinuousBatchingPipeline, requests: list[peer_io.Request]) -> list[peer_io.Record]:
    start = time.perf_counter()
    handles = [pipe.add_request(i, ov.Tensor(np.array([r["prompt_token_ids"]], dtype=np.int64)),
                                generation_config(r["output_len"])) for i, r in enumerate(requests)]
    first_token: list[float | None] = [None] * len(handles)
    finished: list[float | None] = [None] * len(handles)
    while pipe.has_non_finished_requests():
        pipe.step()
        now = time.perf_counter() - start
        for i, handle in enumerate(handles):
            if first_token[i] is None and handle.can_read():
                first_token[i] = now
            if finished[i] is None and handle.get_status() != ov_genai.GenerationStatus.RUNNING:
                finished[i] = now
    end = time.perf_counter() - start
    return [peer_io.record(handle.read_all()[0].generated_ids, ttft, done if done is not None else end)
            for handle, ttft, done in zip(handles, first_token, finished)]


if __name__ == "__main__":
    parser = peer_io.argument_parser(__doc__.splitlines()[0], peer_io.PEERS / "openvino" / "model")
    parser.add_argument("--kv-cache-precision", choices=("f32", "u8", "default"), default="f32")
    parser.add_argument("--inference-precision", choices=("f32", "bf16", "default"), default="f32")
    args = parser.parse_args()
    pipes: dict[bool, ov_genai.ContinuousBatchingPipeline] = {}

    def pipeline(prefix_caching: bool) -> ov_genai.ContinuousBatchingPipeline:
        if prefix_caching not in pipes:  # built when a workload needs it
            pipes[prefix_caching] = make_pipeline(args.model, args.kv_cache_precision, args.threads, prefix_caching,
                                                  args.inference_precision)
        return pipes[prefix_caching]

    label = f"OpenVINO GenAI ContinuousBatchingPipeline, {args.inference_precision}, KV {args.kv_cache_precision}"
    if Path(args.model).name.startswith("model-"):  # setup_openvino.sh's compressed exports: model-int8, model-int4
        label += f", {Path(args.model).name.removeprefix('model-')} weights"
    peer_io.main(label, ov_genai.__version__, args,
                 lambda requests: run_together(pipeline(False), requests),
                 lambda requests: run_together(pipeline(True), requests))
