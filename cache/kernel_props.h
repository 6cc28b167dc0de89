// The human-readable facts stored with a kernel entry (and in bundle
// manifests): what `kerf-cache list/inspect` shows.
#pragma once

#include <map>
#include <string>

#include "kerf/cache/key.h"
#include "kerf/jit/ir.h"

namespace kerf::cache {

std::map<std::string, std::string> kernel_props(const KernelKeyFields& f);

// "BLOCK_K=128,BLOCK_M=64,num_stages=3,num_warps=4"
std::string meta_text(const std::vector<ir::MetaValue>& meta);

}  // namespace kerf::cache
