// Which tile values the CPU code generator keeps in stack arrays.
//
// A tile value is either *materialized* (computed once, at its place in the
// program, into a stack array) or *inline* (each consumer recomputes the
// element it needs from the operands' elements, inside its own loop nest).
// Inline is cheaper for index arithmetic and single-use elementwise chains;
// arrays are needed where a value is expensive and reused, where its
// computation is not elementwise (dot, reductions), where it must survive
// loop iterations, and where a load must read memory at its own place in the
// program (before a later store or loop).
#pragma once

#include <vector>

#include "kerf/jit/ir.h"

namespace kerf::jit::cpu {

struct TilePlan {
  std::vector<bool> materialized;         // by ValueId; scalars are never materialized
  std::vector<const ir::Operation*> def;  // by ValueId: the defining op (null for block args)
  std::vector<bool> is_block_arg;         // by ValueId: an argument of a For body
  std::vector<int> uses;                  // by ValueId: number of uses, nested ones included
};

TilePlan plan_tiles(const ir::Function& f);

}  // namespace kerf::jit::cpu
