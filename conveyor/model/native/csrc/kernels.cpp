// Native CPU kernels for the places a step loses most time in eager PyTorch, compiled as one translation unit
// (conveyor/model/native/kernels.py builds it on first use, for the CPU at hand):
//
//   vec.h           vectors (GCC/Clang vector extensions) and what every kernel shares on them
//   gemm.h          linear layers on packed weights: 256 and 512 bits, and bf16 weights
//   quant_gemm.h    linear layers on quantized weights (GGUF's integer codes), int8 activations
//   quant_tiles.h   their micro-kernels, one per dot-product kind (VNNI, AVX2, portable)
//   kquant_tiles.h  the super-block formats (K-quants, IQ4_XS) at the file's size, and their micro-kernels
//   experts.h       a mixture of experts' MLP: routing, rows grouped per expert, each expert's weights read once
//   attention.h     attention straight over the paged KV cache
//   rows.h          RMSNorm, rotary embedding, SwiGLU's activation, argmax
//   tensors.h       the checks at the tensor boundary
//   native_decoder.h  the whole model (embedding, layers, LM head, argmax) in one call per step
//   kernels.cpp     the tensor-level entry points (also what the tests compare with PyTorch), the Python module
//
// Every kernel comes in two widths, 256 bits (the portable path) and, where the target has AVX-512F, 512; the
// caller picks one per call or per stack (with_path), and a weight is packed for one width. Threads: ATen's
// parallel_for (OpenMP), which each kernel calls itself on raw rows (parallel.h).
//
// Only this file, tensors.h and native_decoder.h know torch: the kernels themselves take plain pointers and
// shapes, and kernel_check.cpp builds them with g++ alone (their test and microbenchmark, `make kernel-check`).

// The kernels share ATen's thread pool and raise its errors here (parallel.h); elsewhere they need no torch.
#define CONVEYOR_ATEN 1

#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <vector>

#include "attention.h"
#include "experts.h"
#include "gemm.h"
#include "huge_pages.h"
#include "native_decoder.h"
#include "quant_gemm.h"
#include "rows.h"
#include "tensors.h"
#include "vec.h"

namespace conveyor {

// ----- Tensor-level entry points (also what the tests compare with PyTorch) -----

// A contiguous tensor of zeros on huge pages where Linux grants them (huge_pages.h). Measured over all the default
// model's weights, both kinds in one process and in turn, at 1 and 8 rows: 6-16% faster than 4 KiB pages. The KV
// pool is written through once when it is made: Decoder.zeroed_kv_cache says why.
torch::Tensor empty_on_huge_pages(at::IntArrayRef sizes, torch::ScalarType dtype) {
  int64_t numel = 1;
  for (const int64_t size : sizes) numel *= size;
  const size_t bytes = static_cast<size_t>(numel) * c10::elementSize(dtype);
  void* data = huge_page_alloc(bytes);
  TORCH_CHECK(data != nullptr, "out of memory for a buffer of ", huge_page_span(bytes), " bytes");
  return torch::from_blob(data, sizes, [bytes](void* p) { huge_page_free(p, bytes); },
                          torch::TensorOptions().dtype(dtype));
}

// The shape pack_linear_weight gives a weight [n, k] on the path of `width` bits (bf16 if asked).
std::vector<int64_t> packed_shape(int64_t n, int64_t k, int64_t width, bool bfloat16) {
  TORCH_CHECK(n > 0 && k > 0, "a weight of ", n, " x ", k, " has nothing to pack");
  std::vector<int64_t> shape;
  with_gemm_path(width, bfloat16, [&](auto path) {
    constexpr int64_t tile = decltype(path)::kTile;
    const int64_t tiles = (n + tile - 1) / tile;
    shape = bfloat16 ? std::vector<int64_t>{tiles, (k + 1) / 2, tile, 2} : std::vector<int64_t>{tiles, k, tile};
  });
  return shape;
}

// A 1-D buffer of `numel` float32 (or bf16) zeros on huge pages where Linux grants them (empty_on_huge_pages):
// what a model packs all its weights into, back to back in the order a step reads them. Packed one allocation
// each, a weight smaller than 2 MiB (or a large one's tail) is on 4 KiB pages, since a huge page must lie wholly inside
// the advised range. Measured with the default model's 120 layer GEMVs in turn, on 2 threads, in a C++
// harness: 1.25-1.36x the time of one GEMV over the same bytes apart, 1.05-1.07x in one buffer (in the engine,
// whose separate weights mostly got huge pages anyway, 1.00-1.02x a decode step).
torch::Tensor huge_page_buffer(int64_t numel, bool bfloat16) {
  TORCH_CHECK(numel > 0, "an empty buffer");
  return empty_on_huge_pages({numel}, bfloat16 ? torch::kBFloat16 : torch::kFloat32);
}

// weight [N, K] -> packed [ceil(N / T), K, T], zero-padded past N, for the path of `width` bits (T = 16 for
// 256, 32 for 512): the tile is as wide as that path's micro-kernel. With bfloat16, [ceil(N / 32), ceil(K / 2),
// 32, 2] in bf16 (a float32 weight rounded to nearest even), zero-padded past N and K: each column's pairs of
// consecutive k side by side, as vdpbf16ps reads them. Into `out` when given (contiguous, of packed_shape and
// the path's dtype: a slice of a huge_page_buffer), else into a new allocation on huge pages.
torch::Tensor pack_linear_weight(const torch::Tensor& weight, int64_t width, bool bfloat16,
                                 std::optional<torch::Tensor> out) {
  const auto dtype = weight.scalar_type();
  TORCH_CHECK(weight.dim() == 2 && (dtype == torch::kFloat32 || (bfloat16 && dtype == torch::kBFloat16)),
              "weight must be a 2-D float32 tensor (or bfloat16, packed for the bfloat16 kernels)");
  const int64_t n = weight.size(0), k = weight.size(1);
  const auto shape = packed_shape(n, k, width, bfloat16);
  const auto packed_dtype = bfloat16 ? torch::kBFloat16 : torch::kFloat32;
  torch::Tensor packed = out.has_value() ? *out : empty_on_huge_pages(shape, packed_dtype);
  TORCH_CHECK(packed.sizes() == at::IntArrayRef(shape) && packed.scalar_type() == packed_dtype &&
                  packed.is_contiguous(),
              "out must be a contiguous ", bfloat16 ? "bfloat16" : "float32", " tensor of shape ", shape);
  const int64_t tiles = shape[0], tile = shape[2];
  if (!bfloat16) {
    auto padded = torch::zeros({tiles * tile, k}, weight.options());
    padded.narrow(0, 0, n).copy_(weight);
    packed.copy_(padded.view({tiles, tile, k}).transpose(1, 2));
    return packed;
  }
  const int64_t pairs = shape[1];
  auto padded = torch::zeros({tiles * tile, 2 * pairs}, weight.options().dtype(torch::kBFloat16));
  padded.narrow(0, 0, n).narrow(1, 0, k).copy_(weight);
  packed.copy_(padded.view({tiles, tile, pairs, 2}).permute({0, 2, 1, 3}));
  return packed;
}

// x [M, K] float32 and a weight packed by pack_linear_weight for K inputs: checked; the packing's width.
int64_t check_gemm_operands(const torch::Tensor& x, const torch::Tensor& packed) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x must be a 2-D float32 tensor");
  const int64_t width = packed_width(packed);
  const bool bf16 = packed.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(width > 0 && packed.is_contiguous(), "packed weight expected");
  TORCH_CHECK(packed_inputs(x.size(1), bf16) == packed.size(1), "x has ", x.size(1), " features, the weight expects ",
              bf16 ? 2 * packed.size(1) : packed.size(1), bf16 ? " (or one fewer)" : "");
  return width;
}

// x [M, K] @ weight.T -> [M, N], the weight given packed by pack_linear_weight (its tile width picks the
// path). max_rows > 0 runs the micro-kernel at that height instead of the path's own (for timing).
torch::Tensor packed_linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t n, int64_t max_rows) {
  const int64_t width = check_gemm_operands(x, packed);
  const bool bf16 = packed.scalar_type() == torch::kBFloat16;
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(n <= packed.size(0) * packed.size(2), "n is larger than the packed weight");
  auto xc = x.contiguous();
  auto y = torch::empty({m, n}, x.options());
  with_gemm_path(width, bf16, [&](auto path) {
    using P = decltype(path);
    TORCH_CHECK(max_rows >= 0 && max_rows <= P::kTableRows, "max_rows above ", P::kTableRows, " for ", width, " bits");
    linear_rows<P>(xc.data_ptr<float>(), m, k, weight_data<P>(packed), n, nullptr, y.data_ptr<float>(),
                   static_cast<int>(max_rows));
  });
  return y;
}

// x [M, K] -> silu(x . Wg^T) * (x . Wu^T) [M, I], gate and up packed together as one [2I, K] weight (gate first,
// I a whole number of the path's tiles): the stack's fused SwiGLU, callable alone to time it against the
// unfused pair (packed_linear, then silu_and_mul).
torch::Tensor packed_swiglu(const torch::Tensor& x, const torch::Tensor& packed, int64_t intermediate) {
  const int64_t width = check_gemm_operands(x, packed);
  const bool bf16 = packed.scalar_type() == torch::kBFloat16;
  auto xc = x.contiguous();
  auto out = torch::empty({x.size(0), intermediate}, x.options());
  with_gemm_path(width, bf16, [&](auto path) {
    using P = decltype(path);
    TORCH_CHECK(intermediate > 0 && intermediate % P::kTile == 0 && packed.size(0) * P::kTile == 2 * intermediate,
                "gate and up must be whole ", P::kTile, "-column tiles, packed as one [2 * ", intermediate, ", K]");
    swiglu_rows<P>(xc.data_ptr<float>(), x.size(0), x.size(1), weight_data<P>(packed), intermediate, nullptr,
                   out.data_ptr<float>());
  });
  return out;
}

// query [T, H, D]; k_cache / v_cache [blocks, block_size, KVH, D] of one dtype: float32, bfloat16 or uint8 of
// fp8 e5m2 bits (widened to float32 as they are read); block_tables [S, max_blocks]; row_seq [T] (which table
// each row uses); context_lens [T]; window > 0: each row sees the last `window` positions of its context only.
// Returns [T, H, D] float32.
torch::Tensor paged_attention(const torch::Tensor& query, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                              const torch::Tensor& block_tables, const torch::Tensor& row_seq,
                              const torch::Tensor& context_lens, double scale, int64_t width, int64_t window) {
  check_cache(k_cache, "k_cache");
  check_cache(v_cache, "v_cache");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "k_cache and v_cache must have one dtype");
  TORCH_CHECK(query.scalar_type() == torch::kFloat32 && query.dim() == 3, "query must be [T, H, D] float32");
  auto q = query.contiguous();
  auto tables = as_int64(block_tables), seqs = as_int64(row_seq), lens = as_int64(context_lens);
  const int64_t rows = q.size(0), heads = q.size(1), dim = q.size(2);
  const CacheShape shape{k_cache.size(1), k_cache.size(2), dim};
  TORCH_CHECK(heads % shape.kv_heads == 0 && k_cache.size(3) == dim, "head shapes do not match");
  const int64_t table_width = tables.size(1);
  check_rows(tables, seqs, lens, shape.block_size);
  auto out = torch::empty_like(q);
  with_path(width, [&](auto path) {
    with_cache_data(k_cache, [&](auto* k) {
      using P = decltype(path);
      const auto* v = static_cast<const std::remove_pointer_t<decltype(k)>*>(v_cache.data_ptr());
      attention_rows<typename P::Vec>(q.data_ptr<float>(), rows, heads * dim, heads, k, v, shape,
                                      tables.data_ptr<int64_t>(), table_width, seqs.data_ptr<int64_t>(),
                                      lens.data_ptr<int64_t>(), static_cast<float>(scale), window,
                                      out.data_ptr<float>());
    });
  });
  return out;
}

// Root-mean-square norm of each row, times weight.
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps, int64_t width) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.dim() == 2, "2-D float32 x expected");
  auto xc = x.contiguous().clone();
  TORCH_CHECK(weight.numel() == xc.size(1) && weight.is_contiguous(), "weight must have one entry per column");
  auto out = torch::empty_like(xc);
  with_path(width, [&](auto path) {
    rms_norm_rows<typename decltype(path)::Vec>(xc.data_ptr<float>(), nullptr, weight.data_ptr<float>(), xc.size(0),
                                                xc.size(1), static_cast<float>(eps), out.data_ptr<float>());
  });
  return out;
}

// Rotary embedding in place on q [T, H, D] and k [T, KVH, D] (views of one projection output are fine):
// x * cos + rotate_half(x) * sin, with cos / sin [T, D] looked up by position.
void rotary_embedding(torch::Tensor& q, torch::Tensor& k, const torch::Tensor& cos, const torch::Tensor& sin,
                      int64_t width) {
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && q.stride(1) == q.size(2) && k.stride(1) == k.size(2) &&
                  cos.is_contiguous() && sin.is_contiguous(),
              "rotary embedding wants heads contiguous within a row");
  const int64_t tokens = q.size(0), dim = q.size(2);
  with_path(width, [&](auto path) {
    using V = typename decltype(path)::Vec;
    const float *c = cos.data_ptr<float>(), *s = sin.data_ptr<float>();
    rotary_rows<V>(q.data_ptr<float>(), tokens, q.stride(0), q.size(1), dim, c, s);
    rotary_rows<V>(k.data_ptr<float>(), tokens, k.stride(0), k.size(1), dim, c, s);
  });
}

// SwiGLU's gate: [M, 2I] (gate then up) -> silu(gate) * up, [M, I].
torch::Tensor silu_and_mul(const torch::Tensor& gate_up, int64_t width) {
  TORCH_CHECK(gate_up.is_contiguous() && gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "contiguous [M, 2I]");
  const int64_t rows = gate_up.size(0), size = gate_up.size(1) / 2;
  auto out = torch::empty({rows, size}, gate_up.options());
  with_path(width, [&](auto path) {
    silu_and_mul_rows<typename decltype(path)::Vec>(gate_up.data_ptr<float>(), rows, size, out.data_ptr<float>());
  });
  return out;
}

// The index of each row's largest value in x [rows, n] float32 (the first of equals; a NaN counts as largest).
// x as fp8 e5m2 bits (uint8, same shape), rounded as the native stack writes its fp8 KV cache: what the tests
// hold to torch's .to(torch.float8_e5m2).
torch::Tensor fp8_e5m2(const torch::Tensor& x) {
  check_float_rows(x, "x");
  auto out = torch::empty(x.sizes(), x.options().dtype(torch::kByte));
  store_cache_row(x.data_ptr<float>(), x.numel(), out.data_ptr<uint8_t>());
  return out;
}

// x as float16 (same shape), rounded as the native stack writes its float16 KV cache.
torch::Tensor float16(const torch::Tensor& x) {
  check_float_rows(x, "x");
  auto out = torch::empty(x.sizes(), x.options().dtype(torch::kHalf));
  store_cache_row(x.data_ptr<float>(), x.numel(), static_cast<Float16Bits*>(out.data_ptr()));
  return out;
}

std::vector<int64_t> argmax(const torch::Tensor& x, int64_t width) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x must be a 2-D float32 tensor");
  auto xc = x.contiguous();
  std::vector<int64_t> out;
  with_path(width, [&](auto path) {
    out = argmax_rows<typename decltype(path)::Vec>(xc.data_ptr<float>(), xc.size(0), xc.size(1));
  });
  return out;
}

// x [M, K] float32 through a quantized weight -> [M, N] float32, with the dot-product kind `dot` (empty: the
// build's best for 512 bits, else 256).
torch::Tensor quantized_linear(const torch::Tensor& x, const QuantWeight& weight, const std::string& dot) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x must be a 2-D float32 tensor");
  TORCH_CHECK(x.size(1) == weight.k, "x has ", x.size(1), " features, the weight expects ", weight.k);
  auto xc = x.contiguous();
  auto y = torch::empty({x.size(0), weight.n}, x.options());
  const QuantDot kind = dot.empty() ? default_quant_dot(512) : parse_quant_dot(dot);
  quant_linear_rows(xc.data_ptr<float>(), x.size(0), weight, nullptr, y.data_ptr<float>(), kind);
  return y;
}

// x [M, K] float32 as the quantized kernels see it: int8 codes [M, K], each span's step [M, K / span] and each
// group's code sum [M, K / group] (what the tests hold the Python reference to); span 0: the group.
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> quantize_activations(const torch::Tensor& x, int64_t group,
                                                                             int64_t span) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x must be a 2-D float32 tensor");
  if (span == 0) span = group;
  TORCH_CHECK(group > 0 && span % group == 0 && x.size(1) % span == 0, "x's ", x.size(1),
              " features are no whole number of spans of ", span, " in groups of ", group);
  auto xc = x.contiguous();
  const int64_t m = x.size(0), k = x.size(1), groups = k / group, spans = k / span;
  const QuantizedRows rows = quantize_rows(xc.data_ptr<float>(), m, k, group, span);
  auto q = torch::empty({m, k}, torch::kInt8);
  auto d = torch::empty({m, spans}, torch::kFloat32);
  auto sums = torch::empty({m, groups}, torch::kInt32);
  std::copy(rows.q, rows.q + m * k, q.data_ptr<int8_t>());
  std::copy(rows.d, rows.d + m * spans, d.data_ptr<float>());
  std::copy(rows.sums, rows.sums + m * groups, sums.data_ptr<int32_t>());
  return {q, d, sums};
}

// Rows `ids` of a quantized weight as float32 [ids, K].
torch::Tensor quantized_rows(const QuantWeight& weight, const std::vector<int64_t>& ids) {
  for (const int64_t id : ids) TORCH_CHECK(id >= 0 && id < weight.n, "row ", id, " of ", weight.n);
  auto out = torch::empty({static_cast<int64_t>(ids.size()), weight.k}, torch::kFloat32);
  dequantize_rows(weight, ids.data(), static_cast<int64_t>(ids.size()), out.data_ptr<float>());
  return out;
}

// Each row's top-k experts [T, k] int64 and their weights [T, k] from router logits [T, experts] (experts.h).
std::tuple<torch::Tensor, torch::Tensor> route_experts(const torch::Tensor& logits, int64_t top_k, bool normalize) {
  check_float_rows(logits, "logits");
  TORCH_CHECK(logits.dim() == 2, "logits must be [rows, experts]");
  auto chosen = torch::empty({logits.size(0), top_k}, torch::kInt64);
  auto weights = torch::empty({logits.size(0), top_k}, torch::kFloat32);
  route_rows(logits.data_ptr<float>(), logits.size(0), logits.size(1), top_k, normalize, chosen.data_ptr<int64_t>(),
             weights.data_ptr<float>());
  return {chosen, weights};
}

// One expert's weight [n, k] for expert_mlp: quantized, or packed float32 for `width` bits.
ExpertMatrix expert_weight(const ProjectionWeight& weight, int64_t n, int64_t k, int64_t width) {
  if (const auto* quant = std::get_if<QuantWeight>(&weight)) {
    TORCH_CHECK(quant->n == n && quant->k == k, "an expert weight [", n, ", ", k, "] expected, not [", quant->n, ", ",
                quant->k, "]");
    return {nullptr, quant, n, k};
  }
  const torch::Tensor& packed = std::get<torch::Tensor>(weight);
  TORCH_CHECK(packed.scalar_type() == torch::kFloat32 && packed.is_contiguous() && packed.dim() == 3 &&
                  packed_width(packed) == width && packed.size(1) == k && packed.size(0) * packed.size(2) >= n,
              "an expert weight [", n, ", ", k, "] packed in float32 for ", width, " bits expected");
  return {packed.data_ptr(), nullptr, n, k};
}

// x [T, hidden] through a mixture of experts on a given routing (chosen and weights [T, k], as route_experts
// gives them): each expert's gate and up joined [2 expert_width, hidden] and its down [hidden, expert_width],
// quantized or packed for `width` bits; the quantized ones on dot-product kind `dot` (empty: the build's best).
// What the tests hold to the reference's loop over experts.
torch::Tensor expert_mlp(const torch::Tensor& x, const torch::Tensor& chosen, const torch::Tensor& weights,
                         const std::vector<ProjectionWeight>& gate_up, const std::vector<ProjectionWeight>& down,
                         int64_t expert_width, int64_t width, bool gelu, const std::string& dot) {
  check_float_rows(x, "x");
  TORCH_CHECK(x.dim() == 2 && chosen.dim() == 2 && chosen.size(0) == x.size(0) && chosen.scalar_type() == torch::kInt64 &&
                  chosen.is_contiguous() && weights.sizes() == chosen.sizes(),
              "chosen (int64) and weights must be [rows, k] for x's rows");
  check_float_rows(weights, "weights");
  const int64_t hidden = x.size(1), experts = static_cast<int64_t>(gate_up.size());
  TORCH_CHECK(experts >= 1 && static_cast<int64_t>(down.size()) == experts, "as many down as gate_up weights");
  std::vector<ExpertMatrix> gate_up_m, down_m;
  for (int64_t e = 0; e < experts; ++e) {
    gate_up_m.push_back(expert_weight(gate_up[e], 2 * expert_width, hidden, width));
    down_m.push_back(expert_weight(down[e], hidden, expert_width, width));
  }
  const ExpertGroups groups = group_by_expert(chosen.data_ptr<int64_t>(), weights.data_ptr<float>(), x.size(0),
                                              chosen.size(1), experts);
  const QuantDot kind = dot.empty() ? default_quant_dot(width) : parse_quant_dot(dot);
  auto out = torch::empty_like(x);
  with_gemm_path(width, false, [&](auto path) {
    expert_rows<decltype(path)>(x.data_ptr<float>(), x.size(0), hidden, expert_width, groups, gate_up_m.data(),
                                down_m.data(), gelu, [&](int64_t) { return kind; }, out.data_ptr<float>());
  });
  return out;
}

}  // namespace conveyor

// The compute releases the GIL: it touches no Python object (arguments are converted before, the result
// after), so the server's event loop keeps answering, streaming and accepting while a model step runs.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace conveyor;
  using release_gil = pybind11::call_guard<pybind11::gil_scoped_release>;
  using pybind11::arg;
  m.def("kernel_widths", &kernel_widths, "the vector widths in bits this build has kernels for");
  m.def("has_bfloat16", &has_bfloat16, "whether this build has the bfloat16 GEMMs (avx512_bf16)");
  m.def("packed_shape", &packed_shape, "the shape pack_linear_weight gives a weight [n, k]", arg("n"), arg("k"),
        arg("width") = 256, arg("bfloat16") = false);
  m.def("huge_page_buffer", &huge_page_buffer,
        "a 1-D float32 (or bf16) buffer of zeros on huge pages, resident only where written", arg("numel"),
        arg("bfloat16") = false, release_gil());
  m.def("pack_linear_weight", &pack_linear_weight, "weight [N, K] -> tiles [N/T, K, T] for a path's width",
        arg("weight"), arg("width") = 256, arg("bfloat16") = false, arg("out") = pybind11::none(), release_gil());
  m.def("packed_linear", &packed_linear, "x [M, K] times a packed weight -> [M, N]", arg("x"), arg("packed"),
        arg("n"), arg("max_rows") = 0, release_gil());
  m.def("packed_swiglu", &packed_swiglu, "silu(x . Wg^T) * (x . Wu^T), gate and up packed as one weight",
        arg("x"), arg("packed"), arg("intermediate"), release_gil());
  m.def("float16", &float16, "x rounded to float16 as the native stack writes a float16 KV cache", arg("x"));
  m.def("fp8_e5m2", &fp8_e5m2, "x rounded to fp8 e5m2, as uint8 bits (how an fp8 KV cache stores K and V)",
        arg("x"));
  m.def("argmax", &argmax, "the index of each row's largest value (first of equals; NaN counts as largest)",
        arg("x"), arg("width") = 256, release_gil());
  m.def("rms_norm", &rms_norm, "RMSNorm of each row, times weight", arg("x"), arg("weight"), arg("eps"),
        arg("width") = 256, release_gil());
  m.def("rotary_embedding", &rotary_embedding, "rotary embedding of q and k, in place", arg("q"), arg("k"),
        arg("cos"), arg("sin"), arg("width") = 256, release_gil());
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up", arg("gate_up"), arg("width") = 256, release_gil());
  m.def("paged_attention", &paged_attention, "attention of query rows over a paged KV cache", arg("query"),
        arg("k_cache"), arg("v_cache"), arg("block_tables"), arg("row_seq"), arg("context_lens"), arg("scale"),
        arg("width") = 256, arg("window") = 0, release_gil());
  m.def("quant_dots", &quant_dots, "the quantized dot-product kinds this build has (portable, avx2, vnni256, vnni512)");
  pybind11::class_<QuantWeight>(m, "QuantizedWeight", pybind11::module_local())
      .def(pybind11::init(&make_quant_weight), arg("codes"), arg("scales"), arg("mins"), arg("n"), arg("k"),
           arg("group"), arg("storage_bits"), arg("code_bits"), arg("zero_point"), arg("levels") = false)
      .def_static("k_quant", &make_k_quant_weight,
                  "a super-block weight (a K-quant, IQ4_XS) from its blocks (kquant_tiles.h's layout)", arg("blocks"),
                  arg("type"), arg("n"), arg("k"))
      .def_static("join", &join_quant_weights, "weights stacked along their outputs, each run by its own kernel",
                  arg("parts"))
      .def_readonly("n", &QuantWeight::n)
      .def_readonly("k", &QuantWeight::k)
      .def_property_readonly("bytes", &QuantWeight::bytes);
  m.def("quantized_linear", &quantized_linear, "x [M, K] through a quantized weight -> [M, N]", arg("x"),
        arg("weight"), arg("dot") = "", release_gil());
  m.def("quantize_activations", &quantize_activations, "x as int8 codes, a step per span and a code sum per group",
        arg("x"), arg("group"), arg("span") = 0, release_gil());
  m.def("quantized_rows", &quantized_rows, "rows of a quantized weight as float32", arg("weight"), arg("ids"),
        release_gil());
  m.def("route_experts", &route_experts, "each row's top-k experts and weights from router logits", arg("logits"),
        arg("top_k"), arg("normalize"), release_gil());
  m.def("expert_mlp", &expert_mlp, "x through a mixture of experts on a given routing", arg("x"), arg("chosen"),
        arg("weights"), arg("gate_up"), arg("down"), arg("expert_width"), arg("width") = 256, arg("gelu") = false,
        arg("dot") = "", release_gil());
  pybind11::class_<NativeDecoder>(m, "NativeDecoder", pybind11::module_local())
      .def(pybind11::init<int64_t, int64_t, int64_t, int64_t, int64_t, double, torch::Tensor, int64_t, bool>(),
           arg("heads"), arg("kv_heads"), arg("head_dim"), arg("hidden"), arg("intermediate"), arg("eps"),
           arg("final_norm"), arg("width"), arg("bfloat16") = false)
      .def("add_layer", &NativeDecoder::add_layer)
      .def("route_to_torch", &NativeDecoder::route_to_torch, arg("name"), arg("lo"), arg("hi"))
      .def("fuse_swiglu_at", &NativeDecoder::fuse_swiglu_at, arg("ranges"))
      .def("use_quant_dot", &NativeDecoder::use_quant_dot, arg("name"), arg("projection") = "", arg("lo") = 1,
           arg("hi") = std::numeric_limits<int64_t>::max())
      .def("set_io", &NativeDecoder::set_io, arg("embedding"), arg("cos"), arg("sin"), arg("lm_head"),
           arg("lm_head_plain"))
      .def("set_family", &NativeDecoder::set_family, arg("embedding_scale"), arg("attention_scale"),
           arg("activation"), arg("local_cos"), arg("local_sin"), arg("clip_qkv") = 0.0)
      .def("set_layer_traits", &NativeDecoder::set_layer_traits, arg("layer"), arg("q_norm"), arg("k_norm"),
           arg("attn_out_norm"), arg("mlp_out_norm"), arg("window"), arg("local_rope"), arg("kv_group"),
           arg("cache_index"))
      .def("set_layer_experts", &NativeDecoder::set_layer_experts, arg("layer"), arg("router"), arg("gate_up"),
           arg("down"), arg("top_k"), arg("normalize"), arg("width"))
      .def("step_experts", &NativeDecoder::step_experts)
      .def("step", &NativeDecoder::step, arg("token_ids"), arg("positions"), arg("kv_cache"), arg("slots"),
           arg("block_tables"), arg("row_seq"), arg("logit_rows"),
           arg("group_slots") = std::vector<std::vector<int64_t>>{},
           arg("group_tables") = std::vector<std::vector<std::vector<int64_t>>>{}, release_gil());
}
