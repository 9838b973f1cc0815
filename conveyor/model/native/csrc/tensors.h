// Checks at the tensor boundary: what the entry points (kernels.cpp) and the stack (native_decoder.h) verify
// before they hand raw pointers to the kernels, which read through them unchecked.

#pragma once

#include <torch/extension.h>

#include <array>
#include <cstdint>
#include <memory>
#include <string>

#include "gemm.h"
#include "quant_gemm.h"

namespace conveyor {

// The width a packed weight was laid out for, from its tile's columns (0: none of ours). A float32 weight is
// [tiles, K, T]; a bf16 one [tiles, ceil(K / 2), 32, 2].
inline int64_t packed_width(const torch::Tensor& packed) {
  if (packed.scalar_type() == torch::kBFloat16) {
    return has_bfloat16() && packed.dim() == 4 && packed.size(2) == 32 && packed.size(3) == 2 ? 512 : 0;
  }
  int64_t width = 0;
  for (const int64_t w : kernel_widths()) {
    with_path(w, [&](auto path) {
      if (packed.dim() == 3 && packed.scalar_type() == torch::kFloat32 && packed.size(2) == decltype(path)::kTile) {
        width = w;
      }
    });
  }
  return width;
}

// The inputs a packed weight of k inputs has in its second dimension (pairs of them for bf16).
inline int64_t packed_inputs(int64_t k, bool bf16) { return bf16 ? (k + 1) / 2 : k; }

// A tensor's elements as path P's weight (float, or bf16 bits), once its dtype is checked.
template <typename P>
const typename P::Weight* weight_data(const torch::Tensor& t) {
  return static_cast<const typename P::Weight*>(t.data_ptr());
}

inline const float* optional_data(const torch::Tensor& t) { return t.numel() == 0 ? nullptr : t.data_ptr<float>(); }

inline void check_float_rows(const torch::Tensor& t, const char* name) {
  CONVEYOR_CHECK(t.scalar_type() == torch::kFloat32 && t.is_contiguous(), name, " must be a contiguous float32 tensor");
}

// A KV cache: contiguous float32, bfloat16, float16, or uint8 holding fp8 e5m2 bits (--kv-cache-dtype fp8).
inline void check_cache(const torch::Tensor& t, const char* name) {
  const auto dtype = t.scalar_type();
  CONVEYOR_CHECK((dtype == torch::kFloat32 || dtype == torch::kBFloat16 || dtype == torch::kHalf ||
                  dtype == torch::kByte) && t.is_contiguous(),
                 name, " must be a contiguous float32, bfloat16, float16 or uint8 (fp8 e5m2) tensor");
}

// Runs f with a cache's data as its element type: float, uint16_t (bf16 bits), Float16Bits or uint8_t (fp8 e5m2
// bits).
template <typename Fn>
void with_cache_data(const torch::Tensor& cache, const Fn& f) {
  switch (cache.scalar_type()) {
    case torch::kBFloat16: return f(static_cast<uint16_t*>(cache.data_ptr()));
    case torch::kByte: return f(static_cast<uint8_t*>(cache.data_ptr()));
    case torch::kHalf: return f(static_cast<Float16Bits*>(cache.data_ptr()));
    default: return f(cache.data_ptr<float>());
  }
}

inline torch::Tensor as_int64(const torch::Tensor& t) { return t.to(torch::kInt64).contiguous(); }

// Every row must name one of the block tables and a context that table covers: attention_rows reads
// through both unchecked. All three tensors int64 and contiguous (as_int64).
inline void check_rows(const torch::Tensor& tables, const torch::Tensor& row_seq,
                       const torch::Tensor& context_lens, int64_t block_size) {
  const int64_t* seqs = row_seq.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  for (int64_t row = 0; row < row_seq.numel(); ++row) {
    CONVEYOR_CHECK(seqs[row] >= 0 && seqs[row] < tables.size(0), "row ", row, " names block table ", seqs[row], " of ",
                tables.size(0));
    CONVEYOR_CHECK(lens[row] >= 1 && lens[row] <= tables.size(1) * block_size, "context length outside the block table");
  }
}

// A QuantWeight over tensors (conveyor/model/quant/formats.py packs them), which it keeps alive: the shapes and
// dtypes checked here, the rest by quant_weight.
inline QuantWeight make_quant_weight(torch::Tensor codes, torch::Tensor scales, torch::Tensor mins, int64_t n,
                                     int64_t k, int64_t group, int64_t storage_bits, int64_t code_bits,
                                     int64_t zero_point, bool levels) {
  auto held = std::make_shared<std::array<torch::Tensor, 3>>(
      std::array<torch::Tensor, 3>{codes.contiguous(), scales.contiguous(), mins.contiguous()});
  const auto& [c, s, m] = *held;
  const auto dtype = s.scalar_type();
  CONVEYOR_CHECK(dtype == torch::kHalf || dtype == torch::kFloat32, "scales must be float16 or float32");
  CONVEYOR_CHECK(m.numel() == 0 || (m.scalar_type() == dtype && m.sizes() == s.sizes()),
                 "mins must be empty or shaped and typed as the scales");
  QuantWeight w = quant_weight(nullptr, nullptr, m.numel() > 0 ? m.data_ptr() : nullptr, dtype == torch::kHalf, n, k,
                               group, storage_bits, code_bits, zero_point, levels);
  CONVEYOR_CHECK(c.scalar_type() == torch::kUInt8 && c.dim() == 3 && c.size(0) == w.tiles() &&
                     c.size(1) == w.groups() && c.size(2) == w.group_bytes(),
                 "codes must be uint8 [", w.tiles(), ", ", w.groups(), ", ", w.group_bytes(), "]");
  CONVEYOR_CHECK(s.dim() == 3 && s.size(0) == w.tiles() && s.size(1) == w.groups() && s.size(2) == kQuantTile,
                 "scales must be float16 or float32 [", w.tiles(), ", ", w.groups(), ", 16]");
  w.codes_data = c.data_ptr<uint8_t>();
  w.scales_data = static_cast<const uint8_t*>(s.data_ptr());
  w.owner = held;
  return w;
}

// A K-quant QuantWeight over its blocks tensor (uint8 [tiles, k / 256, block bytes]), which it keeps alive.
inline QuantWeight make_k_quant_weight(torch::Tensor blocks, const std::string& type, int64_t n, int64_t k) {
  auto held = std::make_shared<torch::Tensor>(blocks.contiguous());
  QuantWeight w = k_quant_weight(nullptr, type, n, k);
  const torch::Tensor& b = *held;
  CONVEYOR_CHECK(b.scalar_type() == torch::kUInt8 && b.dim() == 3 && b.size(0) == w.tiles() &&
                     b.size(1) == k / kSuperBlock && b.size(2) == k_block_bytes(w.layout),
                 type, " blocks must be uint8 [", w.tiles(), ", ", k / kSuperBlock, ", ", k_block_bytes(w.layout), "]");
  w.codes_data = b.data_ptr<uint8_t>();
  w.owner = held;
  return w;
}

}  // namespace conveyor
