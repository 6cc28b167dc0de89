// The CPU back end's interface when kerf is built without LLVM: it reports
// itself unavailable and says how to get it. (With LLVM, jit/cpu/ defines
// these functions instead.)
#if !defined(KERF_HAVE_LLVM)

#include "kerf/error.h"
#include "kerf/jit/cpu_backend.h"

namespace kerf::jit::cpu {
namespace {

[[noreturn]] void not_built() {
  throw NotAvailable(
      "kerf was built without LLVM, so the CPU back end is off; install llvm-dev (e.g. "
      "llvm-14-dev) and rebuild");
}

}  // namespace

bool available() {
  return false;
}
std::string llvm_version() {
  return "";
}
std::string host_cpu() {
  return "";
}
std::string host_features() {
  return "";
}
std::unique_ptr<CpuKernel> compile(const ir::Function&) {
  not_built();
}
std::string emit_llvm_ir(const ir::Function&) {
  not_built();
}
void run_grid(const CpuKernel&, Grid, const Slot*) {
  not_built();
}
int thread_count() {
  return 0;
}  // no pool without the back end

}  // namespace kerf::jit::cpu

#endif  // !KERF_HAVE_LLVM
