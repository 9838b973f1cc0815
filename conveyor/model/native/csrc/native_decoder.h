// The whole model in one call per step: the token embedding, every decoder layer, the LM head on the rows that
// are sampled and each logit row's argmax, on inputs handed over as plain lists, so that no Python or tensor
// dispatch runs between the kernels, nor around them.
//
// Inside the stack, a projection can hand some row counts to torch's own GEMM (oneDNN / MKL, and AMX for bf16
// where the CPU has it) on a plain copy of its weight: `--kernels auto` times both once per machine and
// routes each (projection, row count class) to the faster (NativeDecoder::route_to_torch).

#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <variant>
#include <vector>

#include "attention.h"
#include "experts.h"
#include "family_rows.h"
#include "gemm.h"
#include "quant_gemm.h"
#include "rows.h"
#include "tensors.h"

namespace conveyor {

// y [m, n] = x [m, k] . W^T (+ bias) through torch's own GEMM, on the plain weight [n, k] (float32 or bf16: then
// x is rounded to bf16 for the product, as F.linear on bf16 weights does). x and y stay float32.
inline void torch_linear(const float* x, int64_t m, int64_t k, const torch::Tensor& weight,
                         const torch::Tensor& bias, float* y) {
  auto xt = torch::from_blob(const_cast<float*>(x), {m, k});
  auto yt = torch::from_blob(y, {m, weight.size(0)});
  if (weight.scalar_type() == torch::kFloat32) {
    if (bias.numel() == 0) {
      at::mm_out(yt, xt, weight.t());
    } else {
      at::addmm_out(yt, bias, xt, weight.t());
    }
    return;
  }
  yt.copy_(at::linear(xt.to(weight.scalar_type()), weight));
  if (bias.numel() != 0) yt.add_(bias);
}

// A projection's weight as the stack takes it: packed by pack_linear_weight, or quantized (QuantizedWeight).
using ProjectionWeight = std::variant<torch::Tensor, QuantWeight>;

// A decoder's layers on packed weights (float32, bf16, or quantized codes, projection by projection): Llama's,
// and what other families change in them (set_family, set_layer_traits: QK-norm, norms after attention and
// MLP, GeGLU, an embedding scale, an attention scale, a second rope for windowed layers, sliding windows, and
// layers that keep their K/V in KV groups of their own). One forward runs every layer for a flat batch of
// prompt and decode rows: in eager PyTorch the same step is about twelve dispatches per layer, each costing Python and allocator time that at batch 1 adds
// up to a third of the step. With bfloat16, its weights are
// packed bf16; norms, biases and everything computed stay float32. The KV cache it is handed may hold float32,
// bf16 or fp8 e5m2 (--kv-cache-dtype), whatever the weights are.
class NativeDecoder {
 public:
  NativeDecoder(int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t hidden, int64_t intermediate, double eps,
              torch::Tensor final_norm, int64_t width, bool bfloat16)
      : heads_(heads), kv_heads_(kv_heads), dim_(head_dim), hidden_(hidden), intermediate_(intermediate),
        eps_(static_cast<float>(eps)), final_norm_(final_norm.contiguous()), width_(width), bf16_(bfloat16) {
    TORCH_CHECK(heads % kv_heads == 0, "query heads must be a multiple of KV heads");
    with_gemm_path(width, bfloat16, [](auto) {});  // refuses a width (or bf16) this build lacks
    quant_dot_ = default_quant_dot(width);
    TORCH_CHECK(attend_fn<v8>(head_dim) != nullptr, "no attention kernel for head size ", head_dim);
    check_float_rows(final_norm_, "final_norm");
  }

  // Weights packed by pack_linear_weight for this stack's width and dtype; norms and biases float32 (a bias
  // may be an empty tensor). A projection that route_to_torch will send to torch's GEMM also needs its plain
  // weight [N, K] (float32, or bf16 on a bf16 stack); the others take an empty tensor.
  // A quantized projection runs on the quantized kernels (use_quant_dot's kind), whatever the stack's width.
  // A layer whose MLP is a mixture of experts takes empty gate_up and down weights, and set_layer_experts.
  void add_layer(torch::Tensor input_norm, ProjectionWeight qkv, torch::Tensor qkv_bias, ProjectionWeight o,
                 torch::Tensor post_norm, ProjectionWeight gate_up, torch::Tensor gate_up_bias, ProjectionWeight down,
                 torch::Tensor down_bias, torch::Tensor qkv_plain, torch::Tensor o_plain, torch::Tensor gate_up_plain,
                 torch::Tensor down_plain) {
    quantized_gate_up_ |= std::holds_alternative<QuantWeight>(gate_up);
    const int64_t qkv_width = (heads_ + 2 * kv_heads_) * dim_;
    Layer layer{input_norm.contiguous(), post_norm.contiguous(),
                {projection(qkv, qkv_bias, qkv_plain, hidden_, qkv_width),
                 projection(o, torch::empty({0}), o_plain, heads_ * dim_, hidden_),
                 projection(gate_up, gate_up_bias, gate_up_plain, hidden_, 2 * intermediate_),
                 projection(down, down_bias, down_plain, intermediate_, hidden_)}};
    layer.cache_index = static_cast<int64_t>(layers_.size());
    for (const auto* t : {&layer.input_norm, &layer.post_norm}) {
      TORCH_CHECK(t->scalar_type() == torch::kFloat32, "norm weights and biases must be float32 (on every stack)");
    }
    for (size_t which = 0; which < kProjections; ++which) {
      const Projection& p = layer.projections[which];
      TORCH_CHECK(torch_rows_[which].empty() || p.absent() || p.plain.numel() > 0, kProjectionNames[which],
                  " is routed to torch's GEMM: every layer needs its plain weight");
    }
    layers_.push_back(std::move(layer));
  }

  // From now on, steps of lo..hi rows (inclusive) run projection `name` (qkv, o, gate_up or down) on torch's
  // GEMM instead of the packed kernels; for lm_head, LM heads over lo..hi logit rows do. Every layer added so
  // far (or set_io, for lm_head) must have handed that projection's plain weight.
  void route_to_torch(const std::string& name, int64_t lo, int64_t hi) {
    TORCH_CHECK(lo >= 1 && lo <= hi, "rows ", lo, "..", hi, " is no range of row counts");
    if (name == "lm_head") {
      TORCH_CHECK(lm_head_.plain.numel() > 0, "lm_head has no plain weight to hand torch's GEMM (set_io)");
      lm_head_torch_rows_.push_back({lo, hi});
      return;
    }
    const auto it = std::find(kProjectionNames.begin(), kProjectionNames.end(), name);
    TORCH_CHECK(it != kProjectionNames.end(), "no projection named ", name, " (qkv, o, gate_up, down, lm_head)");
    const auto which = static_cast<size_t>(it - kProjectionNames.begin());
    for (const Layer& layer : layers_) {
      const Projection& p = layer.projections[which];
      TORCH_CHECK(p.absent() || p.plain.numel() > 0, name, " has no plain weight to hand torch's GEMM");
    }
    torch_rows_[which].push_back({lo, hi});
  }

  // From now on, SwiGLU is fused into the packed gate/up GEMM at exactly these row counts (inclusive ranges).
  void fuse_swiglu_at(const std::vector<std::pair<int64_t, int64_t>>& ranges) {
    fused_rows_.clear();
    for (const auto& [lo, hi] : ranges) {
      TORCH_CHECK(lo >= 1 && lo <= hi, "rows ", lo, "..", hi, " is no range of row counts");
      fused_rows_.push_back({lo, hi});
    }
  }

  // What the family changes model-wide: the embedding's scale (1: none; Gemma's sqrt(hidden)), attention's score
  // scale (1/sqrt(head_dim) for Llama; Gemma's query_pre_attn_scalar^-1/2), the MLP's gate activation ("silu":
  // SwiGLU, "gelu_pytorch_tanh": GeGLU), the windowed layers' own rotary tables (empty: one rope for all), and
  // clip_qkv: OLMoE's clamp of Q, K and V to +-clip_qkv after the QK-norm (0: none).
  void set_family(double embedding_scale, double attention_scale, const std::string& activation,
                  torch::Tensor local_cos, torch::Tensor local_sin, double clip_qkv = 0.0) {
    TORCH_CHECK(clip_qkv >= 0.0, "clip_qkv must be positive (0: no clamp)");
    clip_ = static_cast<float>(clip_qkv);
    TORCH_CHECK(activation == "silu" || activation == "gelu_pytorch_tanh", "no activation ", activation,
                " (silu, gelu_pytorch_tanh)");
    TORCH_CHECK(attention_scale > 0.0, "the attention scale must be positive");
    embedding_scale_ = static_cast<float>(embedding_scale);
    attention_scale_ = static_cast<float>(attention_scale);
    gelu_ = activation == "gelu_pytorch_tanh";
    if (local_cos.numel() != 0) {
      check_float_rows(local_cos, "local_cos");
      check_float_rows(local_sin, "local_sin");
      TORCH_CHECK(local_cos.dim() == 2 && local_cos.size(1) == dim_ && local_sin.sizes() == local_cos.sizes() &&
                      (!cos_.defined() || local_cos.size(0) == cos_.size(0)),
                  "local cos and sin must be [positions, ", dim_, "], as many positions as set_io's tables");
    }
    local_cos_ = local_cos;
    local_sin_ = local_sin;
  }

  // What the family changes in layer `layer` (added already): QK-norm weights over a head [head_dim] (empty:
  // none), norms over attention's and the MLP's outputs before each joins the residual stream [hidden] (empty:
  // none; then the layer's post_norm is the norm before the MLP, as Llama's), the window it attends to (0: the
  // whole context), whether it rotates by the local rope (set_family), and where its K/V lives: its KV group
  // (whose slots and tables a step hands over) and its index in the cache tensor's first dimension.
  void set_layer_traits(int64_t layer, torch::Tensor q_norm, torch::Tensor k_norm, torch::Tensor attn_out_norm,
                        torch::Tensor mlp_out_norm, int64_t window, bool local_rope, int64_t kv_group,
                        int64_t cache_index) {
    TORCH_CHECK(layer >= 0 && layer < static_cast<int64_t>(layers_.size()), "no layer ", layer);
    TORCH_CHECK((q_norm.numel() == 0) == (k_norm.numel() == 0), "QK-norm needs both q_norm and k_norm");
    TORCH_CHECK((attn_out_norm.numel() == 0) == (mlp_out_norm.numel() == 0),
                "norms after attention and the MLP come together");
    // A QK-norm over each head (head_dim floats: Qwen3, Gemma 3) or over the whole projection (OLMoE).
    const bool whole = q_norm.numel() == heads_ * dim_ && k_norm.numel() == kv_heads_ * dim_ && heads_ > 1;
    for (const auto& [t, size] : {std::pair{&q_norm, whole ? heads_ * dim_ : dim_},
                                  {&k_norm, whole ? kv_heads_ * dim_ : dim_}, {&attn_out_norm, hidden_},
                                  {&mlp_out_norm, hidden_}}) {
      TORCH_CHECK(t->numel() == 0 || (t->scalar_type() == torch::kFloat32 && t->numel() == size),
                  "a norm weight of ", size, " floats expected");
    }
    TORCH_CHECK(window >= 0 && kv_group >= 0 && cache_index >= 0, "window, kv_group and cache_index are >= 0");
    Layer& w = layers_[layer];
    w.q_norm = q_norm.contiguous();
    w.k_norm = k_norm.contiguous();
    w.attn_out_norm = attn_out_norm.contiguous();
    w.mlp_out_norm = mlp_out_norm.contiguous();
    w.window = window;
    w.local_rope = local_rope;
    w.kv_group = kv_group;
    w.cache_index = cache_index;
  }

  // Layer `layer` (added with empty gate_up and down) runs a mixture of experts for its MLP: the router [experts,
  // hidden] (packed or quantized, as the layers' projections), and each expert's gate and up joined [2 width,
  // hidden] (gate first) and its down [hidden, width]; each row takes its top_k experts by the router's
  // softmax, their weights scaled to sum to 1 if `normalize` (experts.h).
  void set_layer_experts(int64_t layer, ProjectionWeight router, const std::vector<ProjectionWeight>& gate_up,
                         const std::vector<ProjectionWeight>& down, int64_t top_k, bool normalize, int64_t width) {
    TORCH_CHECK(layer >= 0 && layer < static_cast<int64_t>(layers_.size()), "no layer ", layer);
    Layer& w = layers_[layer];
    TORCH_CHECK(w.projections[kGateUp].absent() && w.projections[kDown].absent(),
                "a layer with experts is added with empty gate_up and down weights");
    const int64_t experts = static_cast<int64_t>(gate_up.size());
    TORCH_CHECK(experts >= 1 && static_cast<int64_t>(down.size()) == experts, "as many down as gate_up weights");
    TORCH_CHECK(top_k >= 1 && top_k <= experts, "top-", top_k, " of ", experts, " experts");
    TORCH_CHECK(width >= 1, "an expert's width must be positive");
    Experts moe{projection(router, torch::empty({0}), torch::empty({0}), hidden_, experts), {}, {}, {}, {}, top_k,
                width, normalize};
    for (int64_t e = 0; e < experts; ++e) {
      moe.gate_up.push_back(projection(gate_up[e], torch::empty({0}), torch::empty({0}), hidden_, 2 * width));
      moe.down.push_back(projection(down[e], torch::empty({0}), torch::empty({0}), width, hidden_));
    }
    w.experts = std::move(moe);
    for (int64_t e = 0; e < experts; ++e) {  // views of the weights the Projections just stored keep alive
      w.experts->gate_up_matrices.push_back(expert_matrix(w.experts->gate_up[e], hidden_));
      w.experts->down_matrices.push_back(expert_matrix(w.experts->down[e], width));
    }
  }

  // The experts each mixture-of-experts layer's rows chose in the last step, distinct ones counted, in layer order
  // (what the step profile reports beside the cost model's expectation).
  std::vector<int64_t> step_experts() const { return step_experts_; }

  // From now on, quantized projections run on the dot-product kind `name` (quant_dots(): portable, avx2,
  // vnni256, vnni512): all of them (`projection` empty; the default is the build's best at the stack's
  // width), or one projection (qkv, o, gate_up, down, lm_head) at steps of lo..hi rows, which --kernels auto
  // sets from what it measured (conveyor/model/quant/dot_choice.py).
  void use_quant_dot(const std::string& name, const std::string& projection, int64_t lo, int64_t hi) {
    const QuantDot dot = parse_quant_dot(name);
    if (projection.empty()) {
      quant_dot_ = dot;
      for (auto& ranges : quant_dot_rows_) ranges.clear();
      return;
    }
    TORCH_CHECK(lo >= 1 && lo <= hi, "rows ", lo, "..", hi, " is no range of row counts");
    size_t which = kProjections;  // the LM head's slot, after the layers' projections
    if (projection != "lm_head") {
      const auto it = std::find(kProjectionNames.begin(), kProjectionNames.end(), projection);
      TORCH_CHECK(it != kProjectionNames.end(), "no projection named ", projection,
                  " (qkv, o, gate_up, down, lm_head)");
      which = static_cast<size_t>(it - kProjectionNames.begin());
    }
    quant_dot_rows_[which].push_back({lo, hi, dot});
  }

  // What a step's inputs are looked up in, and its last projection: the token embedding [vocab, hidden]
  // (float32, or bf16 on a bf16 model, or quantized: looked up from its codes), the rotary tables cos / sin
  // [positions, head_dim] float32, and the LM head packed like the layers' projections or quantized (its plain
  // weight [vocab, hidden] in the stack's dtype when route_to_torch sends some row counts of it to torch's
  // GEMM, else empty).
  void set_io(ProjectionWeight embedding_weight, torch::Tensor cos, torch::Tensor sin, ProjectionWeight lm_head,
              torch::Tensor lm_head_plain) {
    int64_t vocab;
    if (const auto* quant = std::get_if<QuantWeight>(&embedding_weight)) {
      TORCH_CHECK(quant->k == hidden_, "the embedding must have ", hidden_, " columns");
      embedding_quant_ = *quant;
      vocab = quant->n;
    } else {
      const torch::Tensor& embedding = std::get<torch::Tensor>(embedding_weight);
      TORCH_CHECK(embedding.dim() == 2 && embedding.size(1) == hidden_ && embedding.is_contiguous() &&
                      (embedding.scalar_type() == torch::kFloat32 || embedding.scalar_type() == torch::kBFloat16),
                  "the embedding must be a contiguous [vocab, ", hidden_, "] float32 or bfloat16 tensor");
      embedding_ = embedding;
      vocab = embedding.size(0);
    }
    check_float_rows(cos, "cos");
    check_float_rows(sin, "sin");
    TORCH_CHECK(cos.dim() == 2 && cos.size(1) == dim_ && sin.sizes() == cos.sizes(), "cos and sin must be [positions, ",
                dim_, "]");
    cos_ = cos;
    sin_ = sin;
    lm_head_ = projection(lm_head, torch::empty({0}), lm_head_plain, hidden_, vocab);
  }

  // One step over a flat batch of T rows, its inputs as plain lists (the caller builds no tensor for them):
  // each row's token and position, the KV slot it writes, which sequence it belongs to (row_seq, an index
  // into block_tables, one table per sequence), and logit_rows, the rows the LM head runs on. A row sees
  // positions [0, position] of its sequence: a decode row its whole context, a prompt row the prompt up to
  // itself. kv_cache is [layers, 2, blocks, block_size, KVH, D]. With KV groups (set_layer_traits), slots and
  // block_tables are group 0's, and group_slots / group_tables those of groups 1, 2, ... in turn; a table's
  // NULL entries (-1: blocks a windowed group gave back) are never read. Returns the final-normed hidden
  // states [T, hidden] and the logits [logit rows, vocab], both float32, and each logit row's argmax (the
  // greedy token, taken while the logits are still in cache).
  std::tuple<torch::Tensor, torch::Tensor, std::vector<int64_t>> step(
      const std::vector<int64_t>& token_ids, const std::vector<int64_t>& positions, torch::Tensor& kv_cache,
      const std::vector<int64_t>& slots, const std::vector<std::vector<int64_t>>& block_tables,
      const std::vector<int64_t>& row_seq, const std::vector<int64_t>& logit_rows,
      const std::vector<std::vector<int64_t>>& group_slots,
      const std::vector<std::vector<std::vector<int64_t>>>& group_tables) {
    TORCH_CHECK(embedding_.defined() || embedding_quant_, "set_io must run before the first step");
    check_cache(kv_cache, "kv_cache");
    TORCH_CHECK(kv_cache.dim() == 6 && kv_cache.size(4) == kv_heads_ && kv_cache.size(5) == dim_,
                "kv_cache must be [layers, 2, blocks, block_size, kv_heads, head_dim]");
    TORCH_CHECK(group_slots.size() == group_tables.size(), "group_slots and group_tables must have one entry per "
                "KV group after the first");
    for (const Layer& layer : layers_) {
      TORCH_CHECK(layer.cache_index < kv_cache.size(0), "a layer's K/V at index ", layer.cache_index,
                  " of a cache of ", kv_cache.size(0));
      TORCH_CHECK(layer.kv_group <= static_cast<int64_t>(group_slots.size()), "a layer of KV group ",
                  layer.kv_group, ", but the step has ", group_slots.size() + 1);
      TORCH_CHECK(!layer.projections[kGateUp].absent() || layer.experts, "a layer without gate_up has no experts "
                  "either (set_layer_experts)");
    }
    const int64_t tokens = static_cast<int64_t>(token_ids.size());
    TORCH_CHECK(positions.size() == token_ids.size() && slots.size() == token_ids.size() &&
                    row_seq.size() == token_ids.size(),
                "token_ids, positions, slots and row_seq must have one entry per row");
    const CacheShape shape{kv_cache.size(3), kv_heads_, dim_};
    std::vector<GroupInputs> groups{{slots.data(), step_tables(block_tables, kv_cache.size(2))}};
    for (size_t g = 0; g < group_slots.size(); ++g) {
      TORCH_CHECK(group_slots[g].size() == token_ids.size() && group_tables[g].size() == block_tables.size(),
                  "each KV group's slots and tables must match the first group's");
      check_slots(group_slots[g], kv_cache.size(2) * shape.block_size);
      groups.push_back({group_slots[g].data(), step_tables(group_tables[g], kv_cache.size(2))});
      for (size_t seq = 0; seq < block_tables.size(); ++seq) {
        TORCH_CHECK(group_tables[g][seq].size() == block_tables[seq].size(), "a sequence's table must be as long in "
                    "every KV group");
      }
    }
    check_slots(slots, kv_cache.size(2) * shape.block_size);
    std::vector<int64_t> context_lens(tokens);
    for (int64_t t = 0; t < tokens; ++t) {
      TORCH_CHECK(positions[t] >= 0 && positions[t] < cos_.size(0), "position ", positions[t], " outside the ",
                  cos_.size(0), " the rotary tables cover");
      TORCH_CHECK(row_seq[t] >= 0 && row_seq[t] < static_cast<int64_t>(block_tables.size()), "row ", t,
                  " names block table ", row_seq[t], " of ", block_tables.size());
      context_lens[t] = positions[t] + 1;
      TORCH_CHECK(context_lens[t] <= static_cast<int64_t>(block_tables[row_seq[t]].size()) * shape.block_size,
                  "row ", t, ": position ", positions[t], " is past its sequence's blocks");
    }
    for (const int64_t row : logit_rows) TORCH_CHECK(row >= 0 && row < tokens, "logit row ", row, " of ", tokens);
    auto x = embed(token_ids);
    if (embedding_scale_ != 1.f) {
      with_gemm_path(width_, bf16_, [&](auto path) {
        scale_in_place<typename decltype(path)::Vec>(x.data_ptr<float>(), x.numel(), embedding_scale_);
      });
    }
    auto cos = rows_of(cos_, positions), sin = rows_of(sin_, positions);
    torch::Tensor local_cos, local_sin;
    if (local_cos_.numel() != 0) {
      local_cos = rows_of(local_cos_, positions);
      local_sin = rows_of(local_sin_, positions);
    }
    const Step step{tokens, x.data_ptr<float>(), {cos.data_ptr<float>(), sin.data_ptr<float>()},
                    {local_cos.defined() ? local_cos.data_ptr<float>() : nullptr,
                     local_sin.defined() ? local_sin.data_ptr<float>() : nullptr},
                    &kv_cache, shape, std::move(groups), row_seq.data(), context_lens.data()};
    auto out = torch::empty({tokens, hidden_}, x.options());
    torch::Tensor logits;
    std::vector<int64_t> greedy;
    with_gemm_path(width_, bf16_, [&](auto path) {
      using P = decltype(path);
      with_cache_data(kv_cache, [&](auto* cache) { run<P, std::remove_pointer_t<decltype(cache)>>(step, out.data_ptr<float>()); });
      logits = lm_head_logits<P>(out, logit_rows);
      greedy = argmax_rows<typename P::Vec>(logits.data_ptr<float>(), logits.size(0), logits.size(1));
    });
    return {out, logits, greedy};
  }

 private:
  // A step's block tables, padded with block 0 to the longest, each block checked to lie in the cache.
  struct StepTables {
    std::vector<int64_t> ids;
    int64_t width;
  };

  // One KV group's part of a step: the slot each row writes, and the sequences' tables.
  struct GroupInputs {
    const int64_t* slots;
    StepTables tables;
  };

  // The step's rows of one rotary table: cos and sin [T, head_dim].
  struct Rope {
    const float *cos, *sin;
  };

  // One forward's inputs, checked.
  struct Step {
    int64_t tokens;
    float *x;
    Rope rope, local_rope;  // local_rope: the windowed layers' own tables (set_family), else null
    torch::Tensor* kv_cache;
    CacheShape shape;
    std::vector<GroupInputs> groups;
    const int64_t *row_seq, *context_lens;
  };

  static void check_slots(const std::vector<int64_t>& slots, int64_t num_slots) {
    for (const int64_t slot : slots) TORCH_CHECK(slot >= 0 && slot < num_slots, "slot ", slot, " outside the cache");
  }

  static StepTables step_tables(const std::vector<std::vector<int64_t>>& tables, int64_t num_blocks) {
    int64_t width = 1;
    for (const auto& table : tables) width = std::max<int64_t>(width, static_cast<int64_t>(table.size()));
    std::vector<int64_t> ids(tables.size() * width, 0);
    for (size_t seq = 0; seq < tables.size(); ++seq) {
      for (size_t i = 0; i < tables[seq].size(); ++i) {
        const int64_t block = tables[seq][i];
        TORCH_CHECK(block >= -1 && block < num_blocks, "block ", block, " outside the cache of ", num_blocks);
        ids[seq * width + i] = std::max<int64_t>(block, 0);  // a NULL entry (-1) is never read: block 0 stands in
      }
    }
    return {std::move(ids), width};
  }

  // The embedding rows of the step's tokens, float32 [T, hidden] (widened from a bf16 table).
  torch::Tensor embed(const std::vector<int64_t>& token_ids) const {
    const int64_t vocab = embedding_quant_ ? embedding_quant_->n : embedding_.size(0);
    for (const int64_t id : token_ids) TORCH_CHECK(id >= 0 && id < vocab, "token id ", id, " outside the vocabulary");
    if (embedding_quant_) {
      auto x = torch::empty({static_cast<int64_t>(token_ids.size()), hidden_}, torch::kFloat32);
      dequantize_rows(*embedding_quant_, token_ids.data(), static_cast<int64_t>(token_ids.size()), x.data_ptr<float>());
      return x;
    }
    return rows_of(embedding_, token_ids).to(torch::kFloat32);
  }

  // Rows `index` of a table [rows, columns], contiguous [index.size(), columns] in the table's dtype.
  static torch::Tensor rows_of(const torch::Tensor& table, const std::vector<int64_t>& index) {
    auto ids = torch::from_blob(const_cast<int64_t*>(index.data()), {static_cast<int64_t>(index.size())},
                                torch::kInt64);
    return table.index_select(0, ids);
  }

  // The LM head on rows `rows` of the final hidden states: the packed kernels, or torch's GEMM where routed.
  template <typename P>
  torch::Tensor lm_head_logits(const torch::Tensor& hidden, const std::vector<int64_t>& rows) const {
    const int64_t m = static_cast<int64_t>(rows.size());
    bool every_row = m == hidden.size(0);  // a batch of decodes samples every row: no gather
    for (int64_t i = 0; every_row && i < m; ++i) every_row = rows[i] == i;
    const torch::Tensor x = every_row ? hidden : rows_of(hidden, rows);
    auto logits = torch::empty({m, lm_head_.n}, hidden.options());
    if (m == 0) return logits;
    if (lm_head_.quant) {
      quant_linear_rows(x.data_ptr<float>(), m, *lm_head_.quant, nullptr, logits.data_ptr<float>(),
                        quant_dot_for(kProjections, m));
    } else if (in_ranges(lm_head_torch_rows_, m)) {
      torch_linear(x.data_ptr<float>(), m, hidden_, lm_head_.plain, lm_head_.bias, logits.data_ptr<float>());
    } else {
      linear_rows<P>(x.data_ptr<float>(), m, hidden_, weight_data<P>(lm_head_.packed), lm_head_.n, nullptr,
                     logits.data_ptr<float>());
    }
    return logits;
  }

  // Every layer and the final norm on path P, the KV cache's elements C (float, bf16 or fp8 e5m2 bits, whatever
  // the weights are); out [tokens, hidden].
  template <typename P, typename C>
  void run(const Step& step, float* out) {
    using V = typename P::Vec;
    const int64_t tokens = step.tokens;
    step_experts_.clear();
    const int64_t q_width = heads_ * dim_, qkv_width = (heads_ + 2 * kv_heads_) * dim_;
    auto opts = final_norm_.options();
    auto normed = torch::empty({tokens, hidden_}, opts), qkv = torch::empty({tokens, qkv_width}, opts);
    auto attn = torch::empty({tokens, q_width}, opts), delta = torch::empty({tokens, hidden_}, opts);
    // A tile must not straddle gate and up; a gate/up on torch's GEMM, or quantized, goes through memory.
    const bool fused_swiglu = in_ranges(fused_rows_, tokens) && intermediate_ % P::kTile == 0 &&
                              !on_torch(kGateUp, tokens) && !quantized_gate_up_ && !gelu_;
    auto gate_up = torch::empty({fused_swiglu ? 0 : tokens, 2 * intermediate_}, opts);
    auto act = torch::empty({tokens, intermediate_}, opts);
    float* xp = step.x;
    float *np = normed.data_ptr<float>(), *qkvp = qkv.data_ptr<float>(), *ap = attn.data_ptr<float>();
    float *dp = delta.data_ptr<float>(), *gp = gate_up.data_ptr<float>(), *actp = act.data_ptr<float>();
    const float scale = attention_scale_ > 0.f ? attention_scale_ : 1.f / std::sqrt(static_cast<float>(dim_));
    const torch::Tensor& kv_cache = *step.kv_cache;
    const int64_t layer_stride = kv_cache.stride(0), kv_stride = kv_cache.stride(1);
    for (size_t l = 0; l < layers_.size(); ++l) {
      const Layer& w = layers_[l];
      C* k_cache = static_cast<C*>(kv_cache.data_ptr()) + w.cache_index * layer_stride;
      C* v_cache = k_cache + kv_stride;
      const GroupInputs& group = step.groups[w.kv_group];
      const Rope& rope = w.local_rope && step.local_rope.cos != nullptr ? step.local_rope : step.rope;
      // The previous layer's MLP output joins the residual stream on the way into this layer's norm.
      rms_norm_rows<V>(xp, l == 0 ? nullptr : dp, w.input_norm.data_ptr<float>(), tokens, hidden_, eps_, np);
      project<P>(w, kQkv, np, tokens, hidden_, qkvp);
      if (w.q_norm.numel() != 0) {  // over each head, or (a weight as wide as the projection) over all at once
        const int64_t q_span = w.q_norm.numel(), k_span = w.k_norm.numel();
        head_norm_rows<V>(qkvp, tokens, qkv_width, q_width / q_span, q_span, w.q_norm.data_ptr<float>(), eps_);
        head_norm_rows<V>(qkvp + q_width, tokens, qkv_width, kv_heads_ * dim_ / k_span, k_span,
                          w.k_norm.data_ptr<float>(), eps_);
      }
      if (clip_ > 0.f) clamp_in_place(qkvp, tokens * qkv_width, clip_);
      rotary_rows<V>(qkvp, tokens, qkv_width, heads_ + kv_heads_, dim_, rope.cos, rope.sin);
      write_kv_rows(qkvp + q_width, qkvp + q_width + kv_heads_ * dim_, tokens, qkv_width, group.slots, step.shape,
                    k_cache, v_cache);
      // Rows one at a time on 8 lanes on either path: 16 measured no faster (reading K and V bounds it).
      attention_rows<v8>(qkvp, tokens, qkv_width, heads_, k_cache, v_cache, step.shape, group.tables.ids.data(),
                         group.tables.width, step.row_seq, step.context_lens, scale, w.window, ap);
      project<P>(w, kO, ap, tokens, q_width, dp);
      if (w.attn_out_norm.numel() != 0) {  // a norm over attention's output before it joins the stream
        rms_norm_rows<V>(dp, nullptr, w.attn_out_norm.data_ptr<float>(), tokens, hidden_, eps_, dp);
      }
      rms_norm_rows<V>(xp, dp, w.post_norm.data_ptr<float>(), tokens, hidden_, eps_, np);
      if (w.experts) {
        run_experts<P>(*w.experts, np, tokens, dp);
      } else if (fused_swiglu) {
        const Projection& gate_up = w.projections[kGateUp];
        swiglu_rows<P>(np, tokens, hidden_, weight_data<P>(gate_up.packed), intermediate_,
                       optional_data(gate_up.bias), actp);
      } else {
        project<P>(w, kGateUp, np, tokens, hidden_, gp);
        if (gelu_) {
          gelu_tanh_and_mul_rows<V>(gp, tokens, intermediate_, actp);
        } else {
          silu_and_mul_rows<V>(gp, tokens, intermediate_, actp);
        }
      }
      if (!w.experts) project<P>(w, kDown, actp, tokens, intermediate_, dp);
      if (w.mlp_out_norm.numel() != 0) {
        rms_norm_rows<V>(dp, nullptr, w.mlp_out_norm.data_ptr<float>(), tokens, hidden_, eps_, dp);
      }
    }
    rms_norm_rows<V>(xp, layers_.empty() ? nullptr : dp, final_norm_.data_ptr<float>(), tokens, hidden_, eps_, out);
  }

  // A layer's projection: its packed weight, bias (float32, or empty) and plain weight (empty unless some row
  // counts run it on torch's GEMM).
  struct Projection {
    torch::Tensor packed, bias, plain;
    int64_t n;
    std::optional<QuantWeight> quant;  // set: the weight is quantized (packed and plain are empty)

    bool absent() const { return n == 0; }  // a mixture of experts' layer has no gate_up or down of its own
  };
  // A mixture of experts in place of a layer's MLP (set_layer_experts).
  struct Experts {
    Projection router;
    std::vector<Projection> gate_up, down;
    std::vector<ExpertMatrix> gate_up_matrices, down_matrices;  // the kernels' views of gate_up and down
    int64_t top_k, width;
    bool normalize;
  };
  enum Which : size_t { kQkv, kO, kGateUp, kDown, kProjections };
  static constexpr std::array<const char*, kProjections> kProjectionNames{"qkv", "o", "gate_up", "down"};
  struct Layer {
    torch::Tensor input_norm, post_norm;
    std::array<Projection, kProjections> projections;
    // set_layer_traits': empty norms are absent; window 0 is the whole context.
    torch::Tensor q_norm = torch::empty({0}), k_norm = torch::empty({0});
    torch::Tensor attn_out_norm = torch::empty({0}), mlp_out_norm = torch::empty({0});
    int64_t window = 0;
    bool local_rope = false;
    int64_t kv_group = 0, cache_index = 0;
    std::optional<Experts> experts;  // set_layer_experts': the MLP is a mixture of experts
  };
  struct RowRange {
    int64_t lo, hi;
  };
  struct DotRange {
    int64_t lo, hi;
    QuantDot dot;
  };

  // A mixture of experts' MLP over x [tokens, hidden] into out: route, group by expert, run (experts.h).
  template <typename P>
  void run_experts(const Experts& moe, const float* x, int64_t tokens, float* out) {
    const int64_t experts = static_cast<int64_t>(moe.gate_up.size());
    std::vector<float> logits(tokens * experts), weights(tokens * moe.top_k);
    std::vector<int64_t> chosen(tokens * moe.top_k);
    if (moe.router.quant) {  // the router on the stack's own kernels: it is never routed to torch's GEMM
      quant_linear_rows(x, tokens, *moe.router.quant, nullptr, logits.data(), quant_dot_);
    } else {
      linear_rows<P>(x, tokens, hidden_, weight_data<P>(moe.router.packed), experts, nullptr, logits.data());
    }
    route_rows(logits.data(), tokens, experts, moe.top_k, moe.normalize, chosen.data(), weights.data());
    const ExpertGroups groups = group_by_expert(chosen.data(), weights.data(), tokens, moe.top_k, experts);
    step_experts_.push_back(groups.distinct);
    expert_rows<P>(x, tokens, hidden_, moe.width, groups, moe.gate_up_matrices.data(), moe.down_matrices.data(), gelu_,
                   [&](int64_t rows) { return quant_dot_for(kGateUp, rows); }, out);
  }

  static ExpertMatrix expert_matrix(const Projection& p, int64_t k) {
    return {p.quant ? nullptr : p.packed.data_ptr(), p.quant ? &*p.quant : nullptr, p.n, k};
  }

  Projection projection(const ProjectionWeight& weight, const torch::Tensor& bias, const torch::Tensor& plain,
                        int64_t k, int64_t n) const {
    std::optional<QuantWeight> quant;
    torch::Tensor packed = torch::empty({0});
    if (const auto* q = std::get_if<QuantWeight>(&weight)) {
      TORCH_CHECK(q->n == n && q->k == k, "a quantized [", n, ", ", k, "] weight expected, not [", q->n, ", ", q->k,
                  "]");
      TORCH_CHECK(plain.numel() == 0, "a quantized projection has no plain weight for torch's GEMM");
      quant = *q;
    } else {
      packed = std::get<torch::Tensor>(weight);
      if (packed.numel() == 0) return {packed, torch::empty({0}), torch::empty({0}), 0, std::nullopt};  // absent
      check_packed(packed, k, n);
    }
    TORCH_CHECK(bias.scalar_type() == torch::kFloat32, "norm weights and biases must be float32 (on every stack)");
    TORCH_CHECK(bias.numel() == 0 || bias.numel() == n, "a bias of ", n, " expected");
    const auto plain_dtype = bf16_ ? torch::kBFloat16 : torch::kFloat32;
    TORCH_CHECK(plain.numel() == 0 || (plain.dim() == 2 && plain.size(0) == n && plain.size(1) == k &&
                                       plain.scalar_type() == plain_dtype),
                "a plain weight must be [", n, ", ", k, "] in the stack's dtype, or empty");
    return {packed, bias.contiguous(), plain.numel() == 0 ? plain : plain.contiguous(), n, std::move(quant)};
  }

  void check_packed(const torch::Tensor& packed, int64_t k, int64_t n) const {
    TORCH_CHECK(packed_width(packed) == width_ && (packed.scalar_type() == torch::kBFloat16) == bf16_ &&
                    packed.size(1) == packed_inputs(k, bf16_) && packed.is_contiguous() &&
                    packed.size(0) * packed.size(2) >= n,
                "a [", n, ", ", k, "] weight packed for ", width_, " bits", bf16_ ? " in bfloat16" : "", " expected");
  }

  static bool in_ranges(const std::vector<RowRange>& ranges, int64_t rows) {
    for (const RowRange& range : ranges) {
      if (rows >= range.lo && rows <= range.hi) return true;
    }
    return false;
  }

  bool on_torch(Which which, int64_t rows) const { return in_ranges(torch_rows_[which], rows); }

  // The dot-product kind of a quantized projection (kProjections: the LM head) at a step of `rows` rows.
  QuantDot quant_dot_for(size_t which, int64_t rows) const {
    for (const DotRange& range : quant_dot_rows_[which]) {
      if (rows >= range.lo && rows <= range.hi) return range.dot;
    }
    return quant_dot_;
  }

  // y [rows, n] = x [rows, k] through a layer's projection: the packed kernels, or torch's GEMM where routed.
  template <typename P>
  void project(const Layer& layer, Which which, const float* x, int64_t rows, int64_t k, float* y) const {
    const Projection& w = layer.projections[which];
    if (w.quant) return quant_linear_rows(x, rows, *w.quant, optional_data(w.bias), y, quant_dot_for(which, rows));
    if (on_torch(which, rows)) return torch_linear(x, rows, k, w.plain, w.bias, y);
    linear_rows<P>(x, rows, k, weight_data<P>(w.packed), w.n, optional_data(w.bias), y);
  }

  int64_t heads_, kv_heads_, dim_, hidden_, intermediate_;
  float eps_;
  torch::Tensor final_norm_;
  int64_t width_;
  bool bf16_;
  std::vector<Layer> layers_;
  std::array<std::vector<RowRange>, kProjections> torch_rows_;
  torch::Tensor embedding_, cos_, sin_;  // set_io's
  // set_family's: 1 and 0 (1/sqrt(head_dim)) are Llama's; local tables empty: every layer rotates by cos_, sin_.
  float embedding_scale_ = 1.f, attention_scale_ = 0.f;
  float clip_ = 0.f;  // set_family's clip_qkv: Q, K and V clamped to +-clip_ after the QK-norm (0: none)
  bool gelu_ = false;
  torch::Tensor local_cos_ = torch::empty({0}), local_sin_ = torch::empty({0});
  std::optional<QuantWeight> embedding_quant_;  // set_io's, when the embedding is quantized
  bool quantized_gate_up_ = false;  // some layer's gate/up is quantized: SwiGLU is never fused
  std::vector<int64_t> step_experts_;  // the last step's distinct experts per mixture-of-experts layer
  QuantDot quant_dot_;
  std::array<std::vector<DotRange>, kProjections + 1> quant_dot_rows_;  // the layers' projections, then the LM head
  Projection lm_head_;
  std::vector<RowRange> lm_head_torch_rows_;
  // Fused SwiGLU pays where the step is compute-bound and the [T, 2I] projection outgrows L2 (measured: 5% off
  // a forward of 64 rows); below that the step is a weight stream, which reads faster as one stream in order
  // (2% slower fused at 1 and 8 rows). The default; --kernels auto sets what it measures (fuse_swiglu_at).
  std::vector<RowRange> fused_rows_{{kRowsPerBlock, std::numeric_limits<int64_t>::max()}};
};

}  // namespace conveyor
