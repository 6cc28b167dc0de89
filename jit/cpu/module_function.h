// Small always-inlined functions that the CPU back end defines inside the
// module it generates (conversions, math), so that generated code calls no
// outside helper and its loops still vectorize.
#pragma once

#include <llvm/IR/IRBuilder.h>
#include <llvm/IR/Module.h>

#include <functional>
#include <string>

namespace kerf::jit::cpu {

using UnaryBody = std::function<llvm::Value*(llvm::IRBuilder<>&, llvm::Value*)>;

// The module's function `name` of one argument, defined with `body` on first use:
// internal, always inlined, no side effects.
inline llvm::Function* unary_module_function(llvm::Module& m, const std::string& name,
                                             llvm::Type* result, llvm::Type* arg,
                                             const UnaryBody& body) {
  if (llvm::Function* existing = m.getFunction(name)) return existing;
  auto* type = llvm::FunctionType::get(result, {arg}, false);
  auto* fn = llvm::Function::Create(type, llvm::GlobalValue::InternalLinkage, name, m);
  fn->addFnAttr(llvm::Attribute::AlwaysInline);
  fn->addFnAttr(llvm::Attribute::NoUnwind);
  fn->addFnAttr(llvm::Attribute::ReadNone);
  fn->addFnAttr(llvm::Attribute::WillReturn);
  llvm::IRBuilder<> b(llvm::BasicBlock::Create(m.getContext(), "entry", fn));
  b.CreateRet(body(b, fn->getArg(0)));
  return fn;
}

}  // namespace kerf::jit::cpu
