// The canonical key encoding (see key.h) and its XXH3-128.
#include "kerf/cache/key.h"

#include <cstring>

namespace kerf::cache {
namespace {

enum class KeyKind : uint8_t { kernel = 1, tune = 2 };

// Field tags: never reuse a number for a different meaning.
enum Tag : uint8_t {
  kKernelName = 1,
  kIrHash = 2,
  kCodeHash = 3,
  kMeta = 4,
  kArgs = 5,
  kLayout = 6,
  kBackend = 7,
  kArch = 8,
  kCompiler = 9,
  kFeatures = 10,
  kKerfVersion = 11,
  kOp = 12,
  kShapeBucket = 13,
  kDtypes = 14,
  kDevice = 15,
};

// The family key stands in this for the compiler.
constexpr const char* kAnyCompiler = "*";

class Encoder {
 public:
  Encoder(KeyKind kind) {
    bytes_.append("kerf-key", 8);
    u32(kKeyEncodingVersion);
    bytes_.push_back(char(kind));
  }

  // A field: tag, byte count, then whatever `fill` appends.
  template <class Fill>
  void field(Tag tag, Fill&& fill) {
    bytes_.push_back(char(tag));
    const size_t at = bytes_.size();
    u32(0);
    fill();
    const uint32_t n = uint32_t(bytes_.size() - at - 4);
    std::memcpy(&bytes_[at], &n, 4);  // little endian on every host kerf supports (x86-64, arm64)
  }
  void string_field(Tag tag, const std::string& s) {
    field(tag, [&] { bytes_.append(s); });
  }
  void hash_field(Tag tag, const ir::Hash128& h) {
    field(tag, [&] {
      u64(h.hi);
      u64(h.lo);
    });
  }

  void u8(uint8_t v) { bytes_.push_back(char(v)); }
  void u32(uint32_t v) { append(&v, 4); }
  void u64(uint64_t v) { append(&v, 8); }
  void str(const std::string& s) {
    u32(uint32_t(s.size()));
    bytes_.append(s);
  }

  std::string take() { return std::move(bytes_); }

 private:
  void append(const void* p, size_t n) { bytes_.append(static_cast<const char*>(p), n); }
  std::string bytes_;
};

CacheKey finish(std::string encoding, std::string family_encoding) {
  CacheKey k;
  k.id = ir::hash_bytes(encoding.data(), encoding.size());
  k.family = ir::hash_bytes(family_encoding.data(), family_encoding.size());
  k.encoding = std::move(encoding);
  return k;
}

std::string encode_kernel(const KernelKeyFields& f, const std::string& compiler) {
  Encoder e(KeyKind::kernel);
  e.string_field(kKernelName, f.kernel);
  e.hash_field(kIrHash, f.ir_hash);
  e.hash_field(kCodeHash, f.code_hash);
  e.field(kMeta, [&] {
    e.u32(uint32_t(f.meta.size()));
    for (const ir::MetaValue& m : f.meta) {
      e.str(m.name);
      e.u64(uint64_t(m.value));
    }
  });
  e.field(kArgs, [&] {
    e.u32(uint32_t(f.args.size()));
    for (const dsl::ArgSpec& a : f.args) {
      e.u8(uint8_t(a.kind));
      if (a.kind == ir::ParamKind::Scalar) continue;  // a scalar's type comes from the kernel
      e.u8(uint8_t(a.dtype));
      e.u8(uint8_t(a.rank));
      e.u8(uint8_t(a.facts.contiguous_last));
      e.u8(uint8_t(a.facts.aligned16));
      e.u32(a.facts.dims_div16);
      e.u32(a.facts.strides_div16);
      e.u32(a.facts.dims_div8);
      e.u32(a.facts.strides_div8);
    }
  });
  e.string_field(kLayout, f.layout);
  e.string_field(kBackend, f.target.backend);
  e.string_field(kArch, f.target.arch);
  e.string_field(kCompiler, compiler);
  e.string_field(kFeatures, f.target.features);
  e.string_field(kKerfVersion, f.kerf_version);
  return e.take();
}

std::string hex128(const ir::Hash128& h) {
  return h.hex();
}

}  // namespace

std::string CacheKey::stem() const {
  return hex128(family) + "-" + hex128(id);
}

CacheKey kernel_key(const KernelKeyFields& f) {
  return finish(encode_kernel(f, f.target.compiler), encode_kernel(f, kAnyCompiler));
}

CacheKey tune_key(const TuneKeyFields& f) {
  Encoder e(KeyKind::tune);
  e.string_field(kOp, f.op);
  e.field(kShapeBucket, [&] {
    e.u32(uint32_t(f.shape_bucket.size()));
    for (int64_t d : f.shape_bucket) e.u64(uint64_t(d));
  });
  e.field(kDtypes, [&] {
    e.u32(uint32_t(f.dtypes.size()));
    for (DType t : f.dtypes) e.u8(uint8_t(t));
  });
  e.string_field(kLayout, f.layout);
  e.string_field(kBackend, f.target.backend);
  e.string_field(kArch, f.target.arch);
  e.string_field(kFeatures, f.target.features);
  e.string_field(kDevice, f.target.device);
  e.string_field(kKerfVersion, f.kerf_version);
  std::string encoding = e.take();
  std::string same = encoding;  // no compiler in a tune key: its family is itself
  return finish(std::move(encoding), std::move(same));
}

KernelKeyFields kernel_fields(const ir::Function& fn, const ir::Hash128& code_hash,
                              const std::string& layout, const Target& target) {
  KernelKeyFields f;
  f.kernel = fn.name;
  f.ir_hash = ir::hash(fn);
  f.code_hash = code_hash;
  f.meta = fn.meta;
  for (const ir::Param& p : fn.params)
    f.args.push_back(p.kind == ir::ParamKind::Scalar
                         ? dsl::ArgSpec::scalar()
                         : dsl::ArgSpec::tensor(p.dtype, p.rank, p.facts));
  f.layout = layout;
  f.target = target;
  f.kerf_version = kerf_version();
  return f;
}

std::string kerf_version() {
#if defined(KERF_VERSION)
  return KERF_VERSION;
#else
  return "unknown";
#endif
}

}  // namespace kerf::cache
