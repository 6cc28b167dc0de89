// The CPU back end's compiler: LLVM module -> O3 for the host CPU -> machine
// code in the process's one ORC LLJIT.
//
// Every kernel gets its own resource tracker, so destroying a CpuKernel frees
// its code. The JIT session is created on first use and shared (by
// shared_ptr) with the kernels, so it outlives all of them whatever the order
// of static destruction.
#include <llvm/ADT/StringMap.h>
#include <llvm/Config/llvm-config.h>
#include <llvm/ExecutionEngine/Orc/CompileUtils.h>
#include <llvm/ExecutionEngine/Orc/ExecutionUtils.h>
#include <llvm/ExecutionEngine/Orc/JITTargetMachineBuilder.h>
#include <llvm/ExecutionEngine/Orc/LLJIT.h>
#include <llvm/ExecutionEngine/Orc/ThreadSafeModule.h>
#include <llvm/IR/LLVMContext.h>
#include <llvm/IR/Module.h>
#include <llvm/Passes/PassBuilder.h>
#include <llvm/Support/Host.h>
#include <llvm/Support/MemoryBuffer.h>
#include <llvm/Support/TargetSelect.h>
#include <llvm/Support/raw_ostream.h>
#include <llvm/Target/TargetMachine.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "jit/cpu/llvm_codegen.h"
#include "jit/cpu/object_code.h"
#include "jit/cpu/stack_budget.h"
#include "kerf/error.h"
#include "kerf/jit/cpu_backend.h"

namespace kerf::jit::cpu {
namespace {

std::string error_text(llvm::Error e) {
  return llvm::toString(std::move(e));
}

llvm::orc::JITTargetMachineBuilder host_machine_builder() {
  auto jtmb = llvm::orc::JITTargetMachineBuilder::detectHost();
  if (!jtmb)
    throw NotAvailable("CPU back end: LLVM cannot target this host: " +
                       error_text(jtmb.takeError()));
  jtmb->setCPU(llvm::sys::getHostCPUName().str());
  jtmb->setCodeGenOptLevel(llvm::CodeGenOpt::Aggressive);
  return std::move(*jtmb);
}

// The process's LLJIT, guarded by one lock for adding and removing code.
class JitSession {
 public:
  static std::shared_ptr<JitSession> get() {
    static std::mutex mutex;
    static std::shared_ptr<JitSession> session;
    std::lock_guard<std::mutex> lock(mutex);
    if (!session) session = std::make_shared<JitSession>();
    return session;
  }

  JitSession() {
    static std::once_flag native_target;
    std::call_once(native_target, [] {
      llvm::InitializeNativeTarget();
      llvm::InitializeNativeTargetAsmPrinter();
    });
    auto jit =
        llvm::orc::LLJITBuilder().setJITTargetMachineBuilder(host_machine_builder()).create();
    if (!jit)
      throw NotAvailable("CPU back end: cannot start LLVM's JIT: " + error_text(jit.takeError()));
    jit_ = std::move(*jit);
    // Kernels call libm (expf, logf, fmodf) and memcpy/memset: resolve them in this process.
    auto process = llvm::orc::DynamicLibrarySearchGenerator::GetForCurrentProcess(
        jit_->getDataLayout().getGlobalPrefix());
    if (!process)
      throw NotAvailable("CPU back end: cannot resolve the process's symbols: " +
                         error_text(process.takeError()));
    jit_->getMainJITDylib().addGenerator(std::move(*process));
  }

  // Adds an optimised module and returns the address of `entry_name` in it.
  CpuKernel::Entry add(llvm::orc::ThreadSafeModule module, const std::string& entry_name,
                       llvm::orc::ResourceTrackerSP& tracker) {
    std::lock_guard<std::mutex> lock(mutex_);
    tracker = jit_->getMainJITDylib().createResourceTracker();
    if (llvm::Error e = jit_->addIRModule(tracker, std::move(module)))
      throw CompileError("CPU back end: ORC rejected the module", error_text(std::move(e)), "");
    auto symbol = jit_->lookup(entry_name);
    if (!symbol) {
      const std::string log = error_text(symbol.takeError());
      llvm::consumeError(tracker->remove());
      throw CompileError("CPU back end: the machine code for '" + entry_name + "' failed", log, "");
    }
    return reinterpret_cast<CpuKernel::Entry>(static_cast<uintptr_t>(symbol->getAddress()));
  }

  void remove(const llvm::orc::ResourceTrackerSP& tracker) {
    std::lock_guard<std::mutex> lock(mutex_);
    llvm::consumeError(tracker->remove());
  }

  // Links an object (from emit_object) into a JITDylib of its own, so that two
  // loads of one object, which define the same symbol, never clash. Lookups that
  // miss there fall back to the main JITDylib's process symbols (libm, memcpy).
  CpuKernel::Entry add_object(const ObjectCode& object, llvm::orc::JITDylib*& dylib) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto jd = jit_->createJITDylib("kerf_object_" + std::to_string(next_dylib_++));
    if (!jd)
      throw CompileError("CPU back end: cannot make a JITDylib", error_text(jd.takeError()), "");
    jd->addToLinkOrder(jit_->getMainJITDylib());
    const auto drop = [&] { llvm::consumeError(jit_->getExecutionSession().removeJITDylib(*jd)); };
    auto buffer = llvm::MemoryBuffer::getMemBufferCopy(
        llvm::StringRef(object.bytes.data(), object.bytes.size()), object.entry);
    if (llvm::Error e = jit_->addObjectFile(*jd, std::move(buffer))) {
      const std::string log = error_text(std::move(e));
      drop();
      throw CompileError("CPU back end: ORC rejected a cached object", log, "");
    }
    auto symbol = jit_->lookup(*jd, object.entry);
    if (!symbol) {
      const std::string log = error_text(symbol.takeError());
      drop();
      throw CompileError("CPU back end: a cached object has no '" + object.entry + "'", log, "");
    }
    dylib = &*jd;
    return reinterpret_cast<CpuKernel::Entry>(static_cast<uintptr_t>(symbol->getAddress()));
  }

  void remove_dylib(llvm::orc::JITDylib& dylib) {
    std::lock_guard<std::mutex> lock(mutex_);
    llvm::consumeError(jit_->getExecutionSession().removeJITDylib(dylib));
  }

 private:
  std::mutex mutex_;
  std::unique_ptr<llvm::orc::LLJIT> jit_;
  uint64_t next_dylib_ = 0;
};

class OrcKernel final : public CpuKernel {
 public:
  OrcKernel(std::shared_ptr<JitSession> session, llvm::orc::ResourceTrackerSP tracker, Entry entry)
      : session_(std::move(session)), tracker_(std::move(tracker)), entry_(entry) {}
  ~OrcKernel() override { session_->remove(tracker_); }
  OrcKernel(const OrcKernel&) = delete;
  OrcKernel& operator=(const OrcKernel&) = delete;
  Entry entry() const override { return entry_; }

 private:
  std::shared_ptr<JitSession> session_;
  llvm::orc::ResourceTrackerSP tracker_;
  Entry entry_;
};

// A kernel loaded from an object, in its own JITDylib.
class ObjectKernel final : public CpuKernel {
 public:
  ObjectKernel(std::shared_ptr<JitSession> session, llvm::orc::JITDylib* dylib, Entry entry)
      : session_(std::move(session)), dylib_(dylib), entry_(entry) {}
  ~ObjectKernel() override { session_->remove_dylib(*dylib_); }
  ObjectKernel(const ObjectKernel&) = delete;
  ObjectKernel& operator=(const ObjectKernel&) = delete;
  Entry entry() const override { return entry_; }

 private:
  std::shared_ptr<JitSession> session_;
  llvm::orc::JITDylib* dylib_;
  Entry entry_;
};

// The new pass manager's O3 pipeline, tuned for the host through `tm`.
void optimize(llvm::Module& m, llvm::TargetMachine& tm) {
  llvm::LoopAnalysisManager lam;
  llvm::FunctionAnalysisManager fam;
  llvm::CGSCCAnalysisManager cgam;
  llvm::ModuleAnalysisManager mam;
  llvm::PipelineTuningOptions tuning;
  tuning.LoopVectorization = true;
  tuning.SLPVectorization = true;
  llvm::PassBuilder pb(&tm, tuning);
  pb.registerModuleAnalyses(mam);
  pb.registerCGSCCAnalyses(cgam);
  pb.registerFunctionAnalyses(fam);
  pb.registerLoopAnalyses(lam);
  pb.crossRegisterProxies(lam, fam, cgam, mam);
  llvm::ModulePassManager mpm = pb.buildPerModuleDefaultPipeline(llvm::OptimizationLevel::O3);
  mpm.run(m, mam);
}

std::string module_text(const llvm::Module& m) {
  std::string text;
  llvm::raw_string_ostream os(text);
  m.print(os, nullptr);
  return os.str();
}

// IR -> optimised module for the host (shared by compile and emit_object).
struct OptimizedModule {
  std::unique_ptr<llvm::LLVMContext> ctx;
  std::unique_ptr<llvm::Module> module;
  std::unique_ptr<llvm::TargetMachine> tm;
  int64_t stack_bytes = 0;
};

OptimizedModule optimized_module(const ir::Function& f, const std::string& entry_name) {
  OptimizedModule out;
  out.ctx = std::make_unique<llvm::LLVMContext>();
  GeneratedModule gen = generate_llvm_module(f, *out.ctx, entry_name);
  if (gen.stack_bytes > kMaxTileStackBytes)
    throw CompileError(
        "kernel '" + f.name + "': its tiles need " + std::to_string(gen.stack_bytes >> 20) +
            " MiB per program; the CPU back end "
            "keeps tiles on the stack and allows " +
            std::to_string(kMaxTileStackBytes >> 20) + " MiB: use smaller block sizes",
        "", "");
  auto tm = host_machine_builder().createTargetMachine();
  if (!tm)
    throw NotAvailable("CPU back end: no target machine for this host: " +
                       error_text(tm.takeError()));
  gen.module->setDataLayout((*tm)->createDataLayout());
  gen.module->setTargetTriple((*tm)->getTargetTriple().str());
  optimize(*gen.module, **tm);
  out.module = std::move(gen.module);
  out.tm = std::move(*tm);
  out.stack_bytes = gen.stack_bytes;
  return out;
}

double ms_since(std::chrono::steady_clock::time_point start) {
  using Ms = std::chrono::duration<double, std::milli>;
  return Ms(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

bool available() {
  return true;
}

std::string llvm_version() {
  return LLVM_VERSION_STRING;
}

std::string host_cpu() {
  return llvm::sys::getHostCPUName().str();
}

std::string host_features() {
  llvm::StringMap<bool> features;
  llvm::sys::getHostCPUFeatures(features);
  std::vector<std::string> list;
  for (const auto& entry : features)
    list.push_back((entry.getValue() ? "+" : "-") + entry.getKey().str());
  std::sort(list.begin(), list.end(),
            [](const std::string& a, const std::string& b) { return a.substr(1) < b.substr(1); });
  std::string out;
  for (const std::string& f : list) out += (out.empty() ? "" : ",") + f;
  return out;
}

std::string emit_llvm_ir(const ir::Function& f) {
  ir::verify(f);
  llvm::LLVMContext ctx;
  GeneratedModule gen = generate_llvm_module(f, ctx, "kerf_" + f.name);
  return module_text(*gen.module);
}

ObjectCode emit_object(const ir::Function& f) {
  ir::verify(f);
  const auto start = std::chrono::steady_clock::now();
  JitSession::get();  // initialises LLVM's native target once
  ObjectCode object;
  // Each loaded object has a JITDylib of its own, so one fixed name per kernel is enough.
  object.entry = "kerf_" + f.name;
  OptimizedModule m = optimized_module(f, object.entry);
  // The same code generator (target machine, opt level) the JIT's compile layer uses.
  llvm::orc::SimpleCompiler compiler(*m.tm);
  auto buffer = compiler(*m.module);
  if (!buffer)
    throw CompileError("CPU back end: LLVM could not emit machine code for '" + f.name + "'",
                       error_text(buffer.takeError()), "");
  object.bytes.assign((*buffer)->getBufferStart(), (*buffer)->getBufferEnd());
  object.stack_bytes = m.stack_bytes;
  object.compile_ms = ms_since(start);
  return object;
}

std::unique_ptr<CpuKernel> load_object(const ObjectCode& object) {
  const auto start = std::chrono::steady_clock::now();
  std::shared_ptr<JitSession> session = JitSession::get();
  llvm::orc::JITDylib* dylib = nullptr;
  const CpuKernel::Entry entry = session->add_object(object, dylib);
  auto kernel = std::make_unique<ObjectKernel>(session, dylib, entry);
  kernel->stack_bytes = object.stack_bytes;
  kernel->compile_ms = ms_since(start);
  return kernel;
}

std::unique_ptr<CpuKernel> compile(const ir::Function& f) {
  ir::verify(f);
  const auto start = std::chrono::steady_clock::now();
  std::shared_ptr<JitSession> session = JitSession::get();

  // Unique per process: all kernels share the JIT's main library.
  static std::atomic<uint64_t> next_kernel{0};
  const std::string entry_name = "kerf_" + f.name + "_" + std::to_string(next_kernel++);

  OptimizedModule m = optimized_module(f, entry_name);

  llvm::orc::ResourceTrackerSP tracker;
  const CpuKernel::Entry entry = session->add(
      llvm::orc::ThreadSafeModule(std::move(m.module), std::move(m.ctx)), entry_name, tracker);
  auto kernel = std::make_unique<OrcKernel>(session, tracker, entry);
  kernel->stack_bytes = m.stack_bytes;
  kernel->compile_ms = ms_since(start);
  return kernel;
}

}  // namespace kerf::jit::cpu
