// Helpers the library kernels share: the slice of a loop that one program of
// grid axis 1 owns, for kernels whose programs share a long dimension (split-K
// style; the number of slices is the grid's, not a meta-parameter, so changing
// it compiles nothing new); rotated steps; the L2 hints of EVICT; the LoRA product's
// operand dtype and precision (DOT, TF32).
#pragma once

#include <utility>

#include "kerf/dsl/dsl.h"

namespace kerf::kernels {

// The L2 hints of the EVICT meta-parameter: 0 none; 1 the streamed tensor (read
// or written once) evicted first; 2 that, and the adapters (re-read by other
// programs) evicted last.
inline dsl::Evict streamed_hint(int64_t evict) { return evict >= 1 ? dsl::Evict::first : dsl::Evict::normal; }
inline dsl::Evict reused_hint(int64_t evict) { return evict >= 2 ? dsl::Evict::last : dsl::Evict::normal; }

// The LoRA product's operands: DOT, the dtype a kernel converts them into (default
// `fallback`); TF32 = 1 (only with DOT f32), f32 operands multiplied on the GPU's tensor
// cores as TF32 (the ops' choice for an f16 base with fp32 or bf16 adapters).
struct DotMeta {
  DType dtype;
  dsl::DotPrecision precision;
};
inline DotMeta dot_meta(dsl::Builder& k, DType fallback) {
  return {static_cast<DType>(k.meta("DOT", int64_t(fallback))),
          k.meta("TF32", 0) ? dsl::DotPrecision::tf32 : dsl::DotPrecision::ieee};
}

// The LoRA term beside a base tile, base + s * left @ right, after the SCALE_AFTER
// meta-parameter: without it s*left is rounded once to the product's dtype and the dot
// adds it times right onto the base directly; with it (adapters exact in the product's
// dtype: an f16 s*B could pass 65504) left enters as it is and s is applied in fp32 to the
// product. lora_left_operand gives the dot's left operand from its values read as f32
// (B's rows, or the embedding's A columns); base_plus_lora the sum.
inline dsl::Value lora_left_operand(const dsl::Value& left, const dsl::Value& s, bool scale_after, DType dot_t) {
  return scale_after ? left.to(dot_t) : (left * s).to(dot_t);
}
inline dsl::Value base_plus_lora(const dsl::Value& base, const dsl::Value& left, const dsl::Value& right,
                                 const dsl::Value& s, bool scale_after, int64_t warps_n,
                                 dsl::DotPrecision precision) {
  return scale_after ? base + s * dsl::dot(left, right, dsl::Value(), warps_n, precision)
                     : dsl::dot(left, right, base, warps_n, precision);
}

// The same sum for a program of one tile (ONE_TILE), from W's tile as it was read: the product
// first and W's values only after it, so that the code waits for W's bytes (asked for before the
// adapters') once the adapters are staged and multiplied, not before. The fp32 sum is the same
// either way round; without SCALE_AFTER the product is formed from zero instead of from the
// base (the same fp32 terms, summed in another order).
inline dsl::Value lora_sum_after_product(const dsl::Value& base, const dsl::Value& left, const dsl::Value& right,
                                         const dsl::Value& s, bool scale_after, int64_t warps_n,
                                         dsl::DotPrecision precision) {
  const dsl::Value prod = dsl::dot(left, right, dsl::Value(), warps_n, precision);
  return (scale_after ? s * prod : prod) + base.to(DType::f32);
}

// [lo, hi) of [0, n): part `part`'s share of `parts` slices, in whole `step`s (lo may pass
// n, leaving the slice empty).
inline std::pair<dsl::Value, dsl::Value> split_range(const dsl::Value& n, int64_t step, const dsl::Value& part,
                                                     const dsl::Value& parts) {
  using namespace kerf::dsl;
  const Value per_split = cdiv(cdiv(n, literal(step)), parts) * step;
  const Value lo = part * per_split;
  return {lo, minimum(n, lo + per_split)};
}

// [lo, hi) of [0, n): program_id(axis)'s share of num_programs(axis) slices, in whole `step`s.
inline std::pair<dsl::Value, dsl::Value> split_range(const dsl::Value& n, int64_t step, int axis = 1) {
  const dsl::Value parts = dsl::num_programs(axis);
  return split_range(n, step, dsl::program_id(axis), parts);
}

// The grid axes of a kernel whose programs each own a row block and a slice of
// its columns. By default row blocks are axis 0, so the programs the GPU starts
// together hold many row blocks at the same column positions; with the
// COLS_FIRST meta-parameter the slices are axis 0, so that they hold a few row
// blocks across all of their columns: one compact stretch of memory at a time.
struct RowSliceAxes {
  int rows = 0;
  int slices = 1;
};
inline RowSliceAxes row_slice_axes(dsl::Builder& k) {
  return k.meta("COLS_FIRST", 0) ? RowSliceAxes{1, 0} : RowSliceAxes{0, 1};
}

// Where the iteration at `k0` of for_range(lo, hi, step) goes when a program
// walks its steps starting `rot` steps in, wrapping around: every step is still
// taken once, in another order (programs whose rot differ add to different
// places at a time). Depends only on k0 and loop-invariant values, so loads it
// indexes still run ahead. The remainder by the step count is taken once, outside the
// loop (an iteration wraps with a compare, not a division by a value known only at run
// time, whose chain of dependent instructions each step and each prefetch would wait on).
inline dsl::Value rotated_step(const dsl::Value& k0, const dsl::Value& lo, const dsl::Value& hi, int64_t step,
                               const dsl::Value& rot) {
  using namespace kerf::dsl;
  const Value steps = cdiv(hi - lo, literal(step));  // > 0 inside the loop
  const Value first = rot % maximum(steps, literal(int64_t(1)));
  const Value j = (k0 - lo) / step + first;  // < 2 steps inside the loop
  return lo + where(j >= steps, j - steps, j) * step;
}

}  // namespace kerf::kernels
