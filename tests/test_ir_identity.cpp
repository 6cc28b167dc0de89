// A kernel's identity is the same in every process: another process (the
// kerf-inspect tool) computes the same IR hash for the same specialization.
#include <cstdio>
#include <string>

#include <sys/wait.h>

#include "catch.h"
#include "kerf/kernels/library.h"

using namespace kerf;

namespace {

std::string run(const std::string& cmd) {
  std::string out;
  FILE* p = popen(cmd.c_str(), "r");
  REQUIRE(p != nullptr);
  char buf[256];
  while (fgets(buf, sizeof buf, p)) out += buf;
  CHECK(pclose(p) == 0);
  while (!out.empty() && (out.back() == '\n' || out.back() == ' ')) out.pop_back();
  return out;
}

}  // namespace

TEST_CASE("every library kernel hashes the same in another process", "[ir][hash]") {
  for (const auto& e : kernels::library()) {
    for (DType t : {DType::bf16, DType::f32}) {
      const ir::Function fn = e.kernel().trace(e.example_args(t), e.example_meta(t));
      const std::string here = ir::hash(fn).hex();
      const std::string there =
          run(std::string(KERF_INSPECT_PATH) + " " + e.name + " --dtype " + dtype_name(t) + " --hash");
      INFO(e.name << " " << dtype_name(t));
      CHECK(there == here);
    }
  }
}

TEST_CASE("kerf-inspect prints IR, CUDA source and refuses unknown kernels", "[ir][tools]") {
  const std::string ir_text = run(std::string(KERF_INSPECT_PATH) + " moe_lora_materialize --dtype bf16");
  CHECK(ir_text.find("kernel @moe_lora_materialize(") != std::string::npos);
  CHECK(ir_text.find("// hash ") != std::string::npos);
  const std::string cuda = run(std::string(KERF_INSPECT_PATH) + " dora_norm --cuda sm_90a");
  CHECK(cuda.find("extern \"C\" __global__") != std::string::npos);
  FILE* p = popen((std::string(KERF_INSPECT_PATH) + " no_such_kernel 2>&1").c_str(), "r");
  char buf[512] = {0};
  const size_t n = fread(buf, 1, sizeof buf - 1, p);
  CHECK(pclose(p) != 0);
  CHECK(std::string(buf, n).find("no library kernel named 'no_such_kernel'") != std::string::npos);
  // Arguments that are not what they name are refused, saying so.
  for (const auto& [args, message] :
       {std::pair<std::string, std::string>{" dora_norm --cuda banana", "'banana' is not a GPU architecture"},
        {" dora_norm --meta BLOCK_M=abc", "--meta wants NAME=INTEGER, got 'BLOCK_M=abc'"},
        {" dora_norm --meta =", "--meta wants NAME=INTEGER"},
        {" dora_norm --compile sm_90a --save ''", "--save needs a file name"},
        {" list extra", "list takes no arguments, got 'extra'"}}) {
    CAPTURE(args);
    FILE* q = popen((std::string(KERF_INSPECT_PATH) + args + " 2>&1").c_str(), "r");
    char out[512] = {0};
    const size_t got = fread(out, 1, sizeof out - 1, q);
    const int status = pclose(q);
    CHECK(WIFEXITED(status));
    CHECK(WEXITSTATUS(status) == 2);  // bad arguments, as kerf-cache says them
    CHECK(std::string(out, got).find(message) != std::string::npos);
  }
  // -h is help, not a kernel's name.
  CHECK(run(std::string(KERF_INSPECT_PATH) + " -h").find("usage: kerf-inspect") != std::string::npos);
}
