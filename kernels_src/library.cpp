#include "kerf/kernels/library.h"

#include "kerf/kernels/kernels.h"

namespace kerf::kernels {
namespace {

dsl::ArgSpec tensor(DType t, int rank) {
  ir::TensorFacts f;
  f.contiguous_last = true;
  f.aligned16 = true;
  f.dims_div16 = (1u << rank) - 1;
  f.strides_div16 = (1u << (rank - 1)) - 1;
  return dsl::ArgSpec::tensor(t, rank, f);
}

int64_t dot_code(DType t) { return int64_t(is_half(t) ? t : DType::f32); }

}  // namespace

const std::vector<LibraryEntry>& library() {
  static const std::vector<LibraryEntry> entries = [] {
    std::vector<LibraryEntry> e;
    const auto scalar = dsl::ArgSpec::scalar();
    e.push_back({"dora_norm", dora_norm_fused,
                 [=](DType t) {
                   return std::vector<dsl::ArgSpec>{tensor(t, 2), tensor(t, 2), tensor(t, 2), tensor(DType::f32, 1),
                                                    scalar, scalar, tensor(DType::f32, 1), tensor(DType::f32, 1)};
                 },
                 [](DType t) {
                   return dsl::MetaMap{{"BLOCK_M", 64}, {"BLOCK_K", 64}, {"R_PAD", 16}, {"DOT", dot_code(t)},
                                       {"num_warps", 8}, {"num_stages", 3}};
                 }});
    e.push_back({"dora_norm_split", dora_norm_split,
                 [=](DType t) {
                   return std::vector<dsl::ArgSpec>{tensor(t, 2),          tensor(t, 2),          tensor(t, 2),
                                                    tensor(DType::f32, 1), scalar,                scalar,
                                                    tensor(DType::f32, 1), tensor(DType::f32, 1), tensor(DType::f32, 1),
                                                    tensor(DType::i32, 1)};
                 },
                 [](DType t) {
                   return dsl::MetaMap{{"BLOCK_M", 64}, {"BLOCK_K", 64}, {"R_PAD", 16}, {"DOT", dot_code(t)},
                                       {"num_warps", 8}, {"num_stages", 3}};
                 }});
    e.push_back({"dora_norm_partial", dora_norm_partial,
                 [=](DType t) {
                   return std::vector<dsl::ArgSpec>{tensor(t, 2), tensor(t, 2), tensor(t, 2), scalar,
                                                    tensor(DType::f32, 1)};
                 },
                 [](DType t) {
                   return dsl::MetaMap{{"BLOCK_M", 64}, {"BLOCK_K", 64}, {"R_PAD", 16}, {"DOT", dot_code(t)},
                                       {"num_stages", 3}};
                 }});
    e.push_back({"dora_norm_finish", dora_norm_finish,
                 [=](DType) {
                   return std::vector<dsl::ArgSpec>{tensor(DType::f32, 1), tensor(DType::f32, 1), scalar,
                                                    tensor(DType::f32, 1), tensor(DType::f32, 1)};
                 },
                 [](DType) { return dsl::MetaMap{{"BLOCK", 1024}}; }});
    // 4-bit W: `t` is the adapters' and m's dtype.
    const auto args_4bit = [=](DType t, bool split) {
      std::vector<dsl::ArgSpec> a = {tensor(DType::u8, 2), tensor(DType::f32, 1), tensor(DType::f32, 1),
                                     tensor(t, 2),         tensor(t, 2),          tensor(t, 1),
                                     scalar,               scalar,                scalar,
                                     tensor(DType::f32, 1), tensor(DType::f32, 1)};
      if (split) {
        a.push_back(tensor(DType::f32, 1));
        a.push_back(tensor(DType::i32, 1));
      }
      return a;
    };
    const auto meta_4bit = [](DType t) {
      return dsl::MetaMap{{"BLOCK_M", 64},
                          {"BLOCK_K", 128},
                          {"R_PAD", 16},
                          {"DOT", int64_t(t == DType::f16 ? DType::f16 : DType::bf16)},
                          {"num_warps", 8},
                          {"num_stages", 3}};
    };
    e.push_back({"dora_norm_4bit", dora_norm_4bit, [=](DType t) { return args_4bit(t, false); }, meta_4bit});
    e.push_back({"dora_norm_4bit_split", dora_norm_4bit_split, [=](DType t) { return args_4bit(t, true); }, meta_4bit});
    e.push_back({"moe_lora_materialize", moe_lora_materialize,
                 [=](DType t) {
                   return std::vector<dsl::ArgSpec>{tensor(t, 3), tensor(t, 3), tensor(t, 3), scalar, tensor(t, 3)};
                 },
                 [](DType t) {
                   return dsl::MetaMap{{"BLOCK_N", 64}, {"BLOCK_K", 128}, {"R_PAD", 16}, {"DOT", dot_code(t)},
                                       {"num_warps", 8}, {"num_stages", 3}};
                 }});
    // The LoRA ops' kernels (example args: contiguous, f32 accumulators where the ops use them).
    e.push_back(
        {"lora_merge", lora_merge,
         [=](DType t) {
           return std::vector<dsl::ArgSpec>{tensor(t, 3), tensor(t, 3), tensor(t, 3), scalar};
         },
         [](DType t) {
           return dsl::MetaMap{{"BLOCK_M", 64},
                               {"BLOCK_K", 128},
                               {"R_PAD", 16},
                               {"DOT", dot_code(t)},
                               {"SCALE_AFTER", is_half(t) ? 1 : 0},
                               {"num_stages", 3}};
         }});
    e.push_back({"moe_lora_backward", moe_lora_backward,
                 [=](DType t) {
                   return std::vector<dsl::ArgSpec>{tensor(t, 3),          tensor(t, 3),
                                                    tensor(t, 3),          scalar,
                                                    tensor(DType::f32, 3), tensor(t, 3)};
                 },
                 [](DType t) {
                   return dsl::MetaMap{{"BLOCK_N", 128},     {"BLOCK_K", 64},  {"R_PAD", 16},
                                       {"DOT", dot_code(t)}, {"num_warps", 8}, {"num_stages", 3}};
                 }});
    e.push_back({"moe_lora_backward_by_columns", moe_lora_backward_by_columns,
                 [=](DType t) {
                   return std::vector<dsl::ArgSpec>{tensor(t, 3), tensor(t, 3), tensor(t, 3),
                                                    scalar,       tensor(t, 3), tensor(DType::f32, 3)};
                 },
                 [](DType t) {
                   return dsl::MetaMap{{"BLOCK_N", 32},       {"BLOCK_K", 256},  {"R_PAD", 64},
                                       {"DOT", dot_code(t)}, {"num_warps", 8}, {"num_stages", 3}};
                 }});
    e.push_back({"lora_embedding", lora_embedding,
                 [=](DType t) {
                   return std::vector<dsl::ArgSpec>{
                       tensor(DType::i64, 1), tensor(t, 2), tensor(t, 2),
                       tensor(t, 2),          scalar,       tensor(t, 2),
                       tensor(DType::i64, 1), scalar,       scalar,       tensor(t, 2)};
                 },
                 [](DType t) {
                   return dsl::MetaMap{{"BLOCK_T", 32},
                                       {"BLOCK_D", 128},
                                       {"R_PAD", 16},
                                       {"DOT", dot_code(t)},
                                       {"num_stages", 3}};
                 }});
    e.push_back({"lora_embedding_backward", lora_embedding_backward,
                 [=](DType t) {
                   return std::vector<dsl::ArgSpec>{tensor(DType::i64, 1),
                                                    tensor(t, 2),
                                                    tensor(t, 2),
                                                    tensor(t, 2),
                                                    scalar,
                                                    tensor(DType::f32, 2),
                                                    tensor(DType::f32, 2),
                                                    tensor(DType::i32, 1),
                                                    tensor(DType::i32, 1),
                                                    tensor(DType::i64, 1),
                                                    scalar,
                                                    scalar,
                                                    scalar,
                                                    tensor(t, 2)};
                 },
                 [](DType t) {
                   return dsl::MetaMap{{"BLOCK_T", 64},
                                       {"BLOCK_D", 64},
                                       {"R_PAD", 16},
                                       {"DOT", dot_code(t)},
                                       {"num_stages", 3}};
                 }});
    e.push_back({"lora_embedding_gather", lora_embedding_gather,
                 [=](DType t) {
                   return std::vector<dsl::ArgSpec>{tensor(DType::i64, 1), tensor(t, 2), tensor(t, 2),
                                                    tensor(DType::i64, 1), scalar, scalar};
                 },
                 [](DType) {
                   return dsl::MetaMap{{"BLOCK_T", 128}, {"R_PAD", 16}};
                 }});
    e.push_back({"lora_embedding_scatter", lora_embedding_scatter,
                 [=](DType t) {
                   return std::vector<dsl::ArgSpec>{tensor(DType::i64, 1),
                                                    tensor(DType::f32, 2),
                                                    tensor(t, 2),
                                                    tensor(DType::f32, 2),
                                                    tensor(DType::i32, 1),
                                                    scalar,
                                                    scalar};
                 },
                 [](DType) {
                   return dsl::MetaMap{{"BLOCK_T", 128}, {"R_PAD", 16}, {"BY_FREQ", 1}};
                 }});
    e.push_back({"lora_embedding_backward_fused", lora_embedding_backward_fused,
                 [=](DType t) {
                   return std::vector<dsl::ArgSpec>{
                       tensor(DType::i64, 1), tensor(t, 2),          tensor(t, 2),          tensor(t, 2),
                       scalar,                tensor(DType::f32, 2), tensor(DType::f32, 2), tensor(DType::i32, 1),
                       tensor(DType::i64, 1), scalar,                scalar,                scalar,
                       tensor(t, 2),          tensor(t, 2),          tensor(DType::i32, 1),
                       tensor(t, 2)};
                 },
                 [](DType t) {
                   return dsl::MetaMap{{"BLOCK_T", 128}, {"BLOCK_D", 128}, {"R_PAD", 16}, {"DOT", dot_code(t)},
                                       {"BLOCK_V", 64},  {"BLOCK_M", 64},  {"ROTATE", 1}, {"num_warps", 4},
                                       {"num_stages", 3}};
                 }});
    e.push_back({"lora_embedding_group", lora_embedding_group,
                 [=](DType) {
                   return std::vector<dsl::ArgSpec>{tensor(DType::i64, 1), tensor(DType::i32, 1),
                                                    tensor(DType::i32, 1), tensor(DType::f32, 2), scalar};
                 },
                 [](DType) {
                   return dsl::MetaMap{{"BLOCK_T", 256}, {"BLOCK_M", 128}, {"BLOCK_K", 16}, {"FILL_B", 1}};
                 }});
    e.push_back({"lora_embedding_dense_a", lora_embedding_dense_a,
                 [=](DType t) {
                   return std::vector<dsl::ArgSpec>{tensor(DType::i32, 1), tensor(DType::i32, 1),
                                                    tensor(DType::f32, 2), tensor(t, 2),
                                                    tensor(DType::f32, 2), tensor(t, 2)};
                 },
                 [](DType) {
                   return dsl::MetaMap{{"BLOCK_V", 128}, {"R_PAD", 16}, {"FLUSH_B", 1},
                                       {"BLOCK_M", 128}, {"BLOCK_K", 16}};
                 }});
    e.push_back(
        {"embedding_count_ids", embedding_count_ids,
         [=](DType) {
           return std::vector<dsl::ArgSpec>{tensor(DType::i64, 1), tensor(DType::i32, 1), scalar};
         },
         [](DType) {
           return dsl::MetaMap{{"BLOCK_T", 64}};
         }});
    e.push_back(
        {"dora_norm_backward", dora_norm_backward,
         [=](DType t) {
           return std::vector<dsl::ArgSpec>{tensor(DType::f32, 1), tensor(t, 1), tensor(t, 1)};
         },
         [](DType) {
           return dsl::MetaMap{{"BLOCK", 1024}};
         }});
    e.push_back({"fill_3d", fill_3d,
                 [=](DType t) {
                   return std::vector<dsl::ArgSpec>{tensor(t, 3), scalar};
                 },
                 [](DType) {
                   return dsl::MetaMap{{"BLOCK_M", 16}, {"BLOCK_K", 128}};
                 }});
    e.push_back({"fill_pair", fill_pair,
                 [=](DType t) {
                   return std::vector<dsl::ArgSpec>{tensor(t, 3), tensor(DType::f32, 3), scalar};
                 },
                 [](DType) {
                   return dsl::MetaMap{{"BLOCK_M0", 8}, {"BLOCK_K0", 256}, {"BLOCK_M1", 128}, {"BLOCK_K1", 16}};
                 }});
    e.push_back({"flush_accumulator", flush_accumulator,
                 [=](DType t) {
                   return std::vector<dsl::ArgSpec>{tensor(DType::f32, 3), tensor(t, 3)};
                 },
                 [](DType) {
                   return dsl::MetaMap{{"BLOCK_M", 16}, {"BLOCK_K", 128}};
                 }});
    e.push_back({"transpose_3d", transpose_3d,
                 [=](DType t) {
                   return std::vector<dsl::ArgSpec>{tensor(t, 3), tensor(t, 3)};
                 },
                 [](DType) {
                   return dsl::MetaMap{{"BLOCK_M", 64}, {"BLOCK_K", 64}};
                 }});
    e.push_back({"fill", fill, [=](DType t) { return std::vector<dsl::ArgSpec>{tensor(t, 1), scalar}; },
                 [](DType) { return dsl::MetaMap{{"BLOCK", 1024}}; }});
    return e;
  }();
  return entries;
}

const LibraryEntry* find_in_library(const std::string& name) {
  for (const LibraryEntry& e : library())
    if (e.name == name) return &e;
  return nullptr;
}

}  // namespace kerf::kernels
