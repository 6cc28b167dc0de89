// The device-side helper code every generated kernel includes, embedded as a
// string so that NVRTC needs no files of kerf's at run time. Everything here
// is kerf's own: half conversions and tensor-core instructions through inline
// PTX, vector memory access, guarded integer division, atomics.
#include "device_library.h"

namespace kerf::jit::cuda {

const char* device_library_source() {
  return R"KERF(
// ---- kerf device library (generated kernels include this first)
namespace kerf_dev {

template <int N> struct Args { unsigned long long s[N]; };

// 16-bit floats are kept as their bits; arithmetic happens in f32.
__device__ __forceinline__ float bf16_to_f32(unsigned short x) {
  return __uint_as_float(((unsigned int)x) << 16);
}
__device__ __forceinline__ unsigned short f32_to_bf16(float f) {
#if __CUDA_ARCH__ >= 800
  unsigned short r;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
  return r;
#else
  unsigned int u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (unsigned short)(u >> 16);
#endif
}
__device__ __forceinline__ float f16_to_f32(unsigned short x) {
  float r;
  asm("cvt.f32.f16 %0, %1;" : "=f"(r) : "h"(x));
  return r;
}
__device__ __forceinline__ unsigned short f32_to_f16(float f) {
  unsigned short r;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(f));
  return r;
}

// Narrowing to 16-bit floats from wider sources, rounded once (as the CPU back end does):
// an f64 or an integer goes to f32 rounded to odd (toward zero, the last bit set when
// inexact), which keeps the final round to nearest even as if done from the exact value.
__device__ __forceinline__ float f64_to_f32_odd(double d) {
  float f = __double2float_rz(d);
  if ((double)f != d && d == d) f = __uint_as_float(__float_as_uint(f) | 1u);
  return f;
}
__device__ __forceinline__ unsigned short f64_to_bf16(double d) { return f32_to_bf16(f64_to_f32_odd(d)); }
__device__ __forceinline__ unsigned short f64_to_f16(double d) { return f32_to_f16(f64_to_f32_odd(d)); }
// An integer as f64: exact below 2^53; beyond, rounded to odd too.
__device__ __forceinline__ double i64_to_f64_odd(long long i) {
  double d = (double)i;
  if ((long long)d != i && d < 9.2233720368547758e18 && d > -9.2233720368547758e18)
    d = __longlong_as_double(__double_as_longlong(__ll2double_rz(i)) | 1ll);
  return d;
}
__device__ __forceinline__ unsigned short i64_to_bf16(long long i) { return f64_to_bf16(i64_to_f64_odd(i)); }
__device__ __forceinline__ unsigned short i64_to_f16(long long i) { return f64_to_f16(i64_to_f64_odd(i)); }
// A float to u8 truncates toward zero and saturates to [0, 255]; NaN gives 0.
__device__ __forceinline__ unsigned char f_to_u8(double x) {
  return x != x ? 0 : x <= 0.0 ? 0 : x >= 255.0 ? 255 : (unsigned char)x;
}
// Shifts by the bit width or more (or by a negative amount) give 0 (shl) or the sign
// fill (shr, arithmetic), as on the CPU back end; C++ leaves them undefined.
template <class T> __device__ __forceinline__ T shl(T a, T b) {
  return (unsigned long long)b >= 8 * sizeof(T) ? (T)0 : (T)((unsigned long long)a << b);
}
template <class T> __device__ __forceinline__ T shr(T a, T b) {
  return a >> ((unsigned long long)b >= 8 * sizeof(T) ? (T)(8 * sizeof(T) - 1) : b);
}

// Integer division and remainder that never trap: a zero divisor gives 0, and so does
// the one quotient that overflows (MIN / -1), as on the CPU back end.
template <class T> __device__ __forceinline__ T idiv(T a, T b) {
  if (b == 0) return 0;
  if (b == -1) return a == (T)((unsigned long long)1 << (8 * sizeof(T) - 1)) ? (T)0 : (T)(0 - a);
  return a / b;
}
template <class T> __device__ __forceinline__ T irem(T a, T b) {
  if (b == 0 || b == -1) return 0;
  return a % b;
}

// Vector memory access of B bytes.
template <int B> struct VecBits;
template <> struct VecBits<1> { typedef unsigned char type; };
template <> struct VecBits<2> { typedef unsigned short type; };
template <> struct VecBits<4> { typedef unsigned int type; };
template <> struct VecBits<8> { typedef uint2 type; };
template <> struct VecBits<16> { typedef uint4 type; };

template <class T, int W> struct __align__(sizeof(T) * W) Pack { T v[W]; };

template <class T, int W> __device__ __forceinline__ Pack<T, W> ld(const T* p) {
  typedef typename VecBits<sizeof(T) * W>::type V;
  Pack<T, W> r;
  if constexpr (sizeof(T) == 2 && W >= 2) {
    // 16-bit elements come out of 32-bit words by shifts, so that widening a
    // bf16 to f32 costs one instruction instead of an unpack and a shift.
    const V raw = *reinterpret_cast<const V*>(p);
    const unsigned* w = reinterpret_cast<const unsigned*>(&raw);
#pragma unroll
    for (int i = 0; i < W / 2; ++i) {
      r.v[2 * i] = (T)(w[i] & 0xffffu);
      r.v[2 * i + 1] = (T)(w[i] >> 16);
    }
  } else {
    *reinterpret_cast<V*>(&r) = *reinterpret_cast<const V*>(p);
  }
  return r;
}
template <class T, int W> __device__ __forceinline__ void st(T* p, const Pack<T, W>& v) {
  typedef typename VecBits<sizeof(T) * W>::type V;
  *reinterpret_cast<V*>(p) = *reinterpret_cast<const V*>(&v);
}

// Loads and stores with an L2 cache policy (sm_80+). The "memory" clobber keeps
// them in program order with the kernel's other accesses to the same memory.
__device__ __forceinline__ unsigned long long l2_policy_evict_first() {
  unsigned long long p;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(p));
  return p;
}
__device__ __forceinline__ unsigned long long l2_policy_evict_last() {
  unsigned long long p;
  asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(p));
  return p;
}
template <class T, int W>
__device__ __forceinline__ Pack<T, W> ld_hint(const T* p, unsigned long long pol) {
  constexpr int B = int(sizeof(T)) * W;
  Pack<T, W> r;
  if constexpr (B == 16) {
    uint4 v;
    asm volatile("ld.global.L2::cache_hint.v4.u32 {%0,%1,%2,%3}, [%4], %5;"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p), "l"(pol) : "memory");
    *reinterpret_cast<uint4*>(&r) = v;
  } else if constexpr (B == 8) {
    uint2 v;
    asm volatile("ld.global.L2::cache_hint.v2.u32 {%0,%1}, [%2], %3;"
                 : "=r"(v.x), "=r"(v.y) : "l"(p), "l"(pol) : "memory");
    *reinterpret_cast<uint2*>(&r) = v;
  } else if constexpr (B == 4) {
    unsigned v;
    asm volatile("ld.global.L2::cache_hint.u32 %0, [%1], %2;" : "=r"(v) : "l"(p), "l"(pol) : "memory");
    *reinterpret_cast<unsigned*>(&r) = v;
  } else if constexpr (B == 2) {
    unsigned short v;
    asm volatile("ld.global.L2::cache_hint.u16 %0, [%1], %2;" : "=h"(v) : "l"(p), "l"(pol) : "memory");
    *reinterpret_cast<unsigned short*>(&r) = v;
  } else {
    unsigned v;
    asm volatile("ld.global.L2::cache_hint.u8 %0, [%1], %2;" : "=r"(v) : "l"(p), "l"(pol) : "memory");
    *reinterpret_cast<unsigned char*>(&r) = (unsigned char)v;
  }
  return r;
}
template <class T, int W>
__device__ __forceinline__ void st_hint(T* p, const Pack<T, W>& x, unsigned long long pol) {
  constexpr int B = int(sizeof(T)) * W;
  if constexpr (B == 16) {
    const uint4 v = *reinterpret_cast<const uint4*>(&x);
    asm volatile("st.global.L2::cache_hint.v4.u32 [%0], {%1,%2,%3,%4}, %5;"
                 :: "l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w), "l"(pol) : "memory");
  } else if constexpr (B == 8) {
    const uint2 v = *reinterpret_cast<const uint2*>(&x);
    asm volatile("st.global.L2::cache_hint.v2.u32 [%0], {%1,%2}, %3;" :: "l"(p), "r"(v.x), "r"(v.y), "l"(pol)
                 : "memory");
  } else if constexpr (B == 4) {
    const unsigned v = *reinterpret_cast<const unsigned*>(&x);
    asm volatile("st.global.L2::cache_hint.u32 [%0], %1, %2;" :: "l"(p), "r"(v), "l"(pol) : "memory");
  } else if constexpr (B == 2) {
    const unsigned short v = *reinterpret_cast<const unsigned short*>(&x);
    asm volatile("st.global.L2::cache_hint.u16 [%0], %1, %2;" :: "l"(p), "h"(v), "l"(pol) : "memory");
  } else {
    const unsigned v = *reinterpret_cast<const unsigned char*>(&x);
    asm volatile("st.global.L2::cache_hint.u8 [%0], %1, %2;" :: "l"(p), "r"(v), "l"(pol) : "memory");
  }
}

// The value `v` of lane `src` (its low five bits) of this warp; every lane takes part.
__device__ __forceinline__ float shfl_idx(float v, int src) { return __shfl_sync(0xffffffffu, v, src); }
__device__ __forceinline__ double shfl_idx(double v, int src) { return __shfl_sync(0xffffffffu, v, src); }
__device__ __forceinline__ int shfl_idx(int v, int src) { return __shfl_sync(0xffffffffu, v, src); }
__device__ __forceinline__ long long shfl_idx(long long v, int src) { return __shfl_sync(0xffffffffu, v, src); }
__device__ __forceinline__ unsigned short shfl_idx(unsigned short v, int src) {
  return (unsigned short)__shfl_sync(0xffffffffu, (unsigned)v, src);
}
__device__ __forceinline__ unsigned char shfl_idx(unsigned char v, int src) {
  return (unsigned char)__shfl_sync(0xffffffffu, (unsigned)v, src);
}
__device__ __forceinline__ bool shfl_idx(bool v, int src) { return __shfl_sync(0xffffffffu, (int)v, src) != 0; }

// Barriers of the whole grid (dsl::grid_sync, grid_arrive, grid_await; the launch is
// cooperative, so every program is resident). An arrival: after a block barrier,
// thread 0 adds one to the counter with a release reduction, which publishes the
// program's writes (ordered before it by the block barrier) at device scope. A wait
// after k arrivals: thread 0 spins with acquire loads until every program has arrived
// k times, and a block barrier holds the other threads until then. (Against a fence,
// a relaxed add, a spin with 64 ns sleeps and a second fence: 0.3-0.8 us less per
// barrier in the embedding backward on an H100.) Before sm_70: fences around a relaxed
// add and a volatile spin. Right after its last barrier each program counts its exit
// (grid_exit_count), and at the kernel's end the program whose exit came last
// (grid_exit_finish) sets the counter back to zero for the next launch: no program
// looks at the counter after its last barrier, and every one has passed it once all
// have counted their exits. The add's round trip overlaps the work after the barrier
// (at the kernel's end, in a program's last instructions, it added to the kernel's time).
__device__ __forceinline__ void grid_arrive(int* counter) {
  __syncthreads();
  if (threadIdx.x == 0) {
#if __CUDA_ARCH__ >= 700
    asm volatile("red.release.gpu.global.add.s32 [%0], 1;" ::"l"(counter) : "memory");
#else
    __threadfence();
    atomicAdd(counter, 1);
#endif
  }
}
__device__ __forceinline__ void grid_await(int* counter, int arrivals) {
  if (threadIdx.x == 0) {
    const int target = arrivals * int(gridDim.x * gridDim.y * gridDim.z);
#if __CUDA_ARCH__ >= 700
    for (;;) {
      int seen;
      asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(seen) : "l"(counter) : "memory");
      if (seen >= target) break;
    }
#else
    while (*static_cast<volatile int*>(counter) < target) {
    }
    __threadfence();
#endif
  }
  __syncthreads();
}
__device__ __forceinline__ void grid_sync(int* counter, int arrivals) {
  grid_arrive(counter);
  grid_await(counter, arrivals);
}
__device__ __forceinline__ int grid_exit_count(int* counter) {
  return threadIdx.x == 0 ? atomicAdd(counter, 1) : 0;
}
__device__ __forceinline__ void grid_exit_finish(int* counter, int old, int counts) {
  if (threadIdx.x == 0 && old == counts * int(gridDim.x * gridDim.y * gridDim.z) - 1) atomicExch(counter, 0);
}

// Atomics (relaxed, device scope). 16-bit floats use a compare-and-swap loop
// on the aligned 32-bit word that holds them.
__device__ __forceinline__ float atomic_add(float* p, float v) { return atomicAdd(p, v); }
__device__ __forceinline__ double atomic_add(double* p, double v) { return atomicAdd(p, v); }
__device__ __forceinline__ int atomic_add(int* p, int v) { return atomicAdd(p, v); }
__device__ __forceinline__ long long atomic_add(long long* p, long long v) {
  return (long long)atomicAdd(reinterpret_cast<unsigned long long*>(p), (unsigned long long)v);
}
// Fire-and-forget adds of W consecutive floats (16-byte or 8-byte aligned): one
// vector reduction on sm_90 and later, W scalar ones before.
template <int W> __device__ __forceinline__ void red_add(float* p, const Pack<float, W>& v) {
#if __CUDA_ARCH__ >= 900
  if (W == 4)
    asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(p), "f"(v.v[0]), "f"(v.v[1]),
                 "f"(v.v[W > 2 ? 2 : 0]), "f"(v.v[W > 3 ? 3 : 0]) : "memory");
  else if (W == 2)
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" ::"l"(p), "f"(v.v[0]), "f"(v.v[1]) : "memory");
  else
#endif
  {
#pragma unroll
    for (int j = 0; j < W; ++j) atomicAdd(p + j, v.v[j]);
  }
}
template <bool IsBf16>
__device__ __forceinline__ unsigned short atomic_add_16(unsigned short* p, unsigned short v) {
  unsigned int* word = reinterpret_cast<unsigned int*>((size_t)p & ~(size_t)3);
  const unsigned int shift = ((size_t)p & 2) ? 16u : 0u;
  unsigned int old = *word, assumed;
  const float add = IsBf16 ? bf16_to_f32(v) : f16_to_f32(v);
  do {
    assumed = old;
    const unsigned short cur = (unsigned short)((assumed >> shift) & 0xffffu);
    const float sum = (IsBf16 ? bf16_to_f32(cur) : f16_to_f32(cur)) + add;
    const unsigned short nxt = IsBf16 ? f32_to_bf16(sum) : f32_to_f16(sum);
    const unsigned int repl = (assumed & ~(0xffffu << shift)) | ((unsigned int)nxt << shift);
    old = atomicCAS(word, assumed, repl);
  } while (old != assumed);
  return (unsigned short)((old >> shift) & 0xffffu);
}

// Tensor cores, fp32 accumulation: D = A(16x16, row) * B(16x8, col) + C for bf16/f16,
// D = A(16x8, row) * B(8x8, col) + C for TF32 (f32 bits rounded by round_tf32); the
// fragments are 4 registers of A and 2 of B either way.
#define KERF_MMA_SYNC(name, shape_types)                                                          \
  __device__ __forceinline__ void name(float* c, const unsigned* a, const unsigned* b) {         \
    asm volatile("mma.sync.aligned." shape_types " {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};" \
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])                               \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));           \
  }
KERF_MMA_SYNC(mma_bf16_16816, "m16n8k16.row.col.f32.bf16.bf16.f32")
KERF_MMA_SYNC(mma_f16_16816, "m16n8k16.row.col.f32.f16.f16.f32")
KERF_MMA_SYNC(mma_tf32_1688, "m16n8k8.row.col.f32.tf32.tf32.f32")
#undef KERF_MMA_SYNC
// f32 bits in place to TF32, rounded to nearest (ties away from zero, as cvt.rna does).
__device__ __forceinline__ void round_tf32(unsigned* r, int n) {
#pragma unroll
  for (int i = 0; i < n; ++i) asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r[i]) : "f"(__uint_as_float(r[i])));
}
// The m16n8k8 TF32 fragments that ldmatrix cannot transpose (32-bit elements), read one
// register at a time: A's from A^T [K, M] at (k0, m0), B's from B [K, N] at (k0, n0),
// rows `pitch` floats apart. Lane l holds row/column l / 4 and k's l % 4 (and + 4).
__device__ __forceinline__ void afrag_tf32_trans(unsigned* r, const float* s, int pitch, int k0, int m0, int lane) {
  const float* p = s + (k0 + (lane & 3)) * pitch + m0 + (lane >> 2);
  r[0] = __float_as_uint(p[0]);
  r[1] = __float_as_uint(p[8]);
  r[2] = __float_as_uint(p[4 * pitch]);
  r[3] = __float_as_uint(p[4 * pitch + 8]);
}
__device__ __forceinline__ void bfrag_tf32(unsigned* r, const float* s, int pitch, int k0, int n0, int lane) {
  const float* p = s + (k0 + (lane & 3)) * pitch + n0 + (lane >> 2);
  r[0] = __float_as_uint(p[0]);
  r[1] = __float_as_uint(p[4 * pitch]);
}

// Fragments from shared memory (16-byte aligned rows).
__device__ __forceinline__ void ldmatrix_x4(unsigned* r, const void* smem_row) {
  const unsigned a = (unsigned)__cvta_generic_to_shared(smem_row);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}
__device__ __forceinline__ void ldmatrix_x2(unsigned* r, const void* smem_row) {
  const unsigned a = (unsigned)__cvta_generic_to_shared(smem_row);
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];"
               : "=r"(r[0]), "=r"(r[1]) : "r"(a));
}
__device__ __forceinline__ void ldmatrix_x2_trans(unsigned* r, const void* smem_row) {
  const unsigned a = (unsigned)__cvta_generic_to_shared(smem_row);
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];"
               : "=r"(r[0]), "=r"(r[1]) : "r"(a));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned* r, const void* smem_row) {
  const unsigned a = (unsigned)__cvta_generic_to_shared(smem_row);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}

// Asynchronous global -> shared copies (sm_80+), for software pipelining. P
// (0, 64, 128 or 256): the L2 prefetch size hint of 16-byte copies (how much
// L2 fetches from DRAM around a miss; 0: none given).
template <int B, int P = 0>
__device__ __forceinline__ void cp_async(void* smem, const void* gmem, bool pred) {
  const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
  const int src_bytes = pred ? B : 0;  // 0: fill with zeros, read nothing
  if (B == 16 && P == 256)
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;" :: "r"(s), "l"(gmem), "r"(src_bytes));
  else if (B == 16 && P == 128)
    asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;" :: "r"(s), "l"(gmem), "r"(src_bytes));
  else if (B == 16 && P == 64)
    asm volatile("cp.async.cg.shared.global.L2::64B [%0], [%1], 16, %2;" :: "r"(s), "l"(gmem), "r"(src_bytes));
  else if (B == 16)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(s), "l"(gmem), "r"(src_bytes));
  else
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;" :: "r"(s), "l"(gmem), "n"(B), "r"(src_bytes));
}
// The same with an L2 cache policy (createpolicy: evict first or last), sm_80+.
// ptxas before 13.4 can drop the createpolicy that a cp.async's cache hint
// reads (the copy then decodes an unset descriptor register and the kernel
// dies with an illegal instruction, seen on sm_90a with CUDA 13.0), so with
// those compilers the copy goes without the hint (keeping its prefetch size);
// loads and stores keep theirs. With the hint it goes without a prefetch size.
#if defined(__CUDACC_VER_MAJOR__) && (__CUDACC_VER_MAJOR__ > 13 || (__CUDACC_VER_MAJOR__ == 13 && __CUDACC_VER_MINOR__ >= 4))
#define KERF_CP_ASYNC_HINT 1
#else
#define KERF_CP_ASYNC_HINT 0
#endif
template <int B, int P = 0>
__device__ __forceinline__ void cp_async_hint(void* smem, const void* gmem, bool pred, unsigned long long pol) {
#if KERF_CP_ASYNC_HINT
  const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
  const int src_bytes = pred ? B : 0;
  if (B == 16)
    asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;"
                 :: "r"(s), "l"(gmem), "r"(src_bytes), "l"(pol));
  else
    asm volatile("cp.async.ca.shared.global.L2::cache_hint [%0], [%1], %2, %3, %4;"
                 :: "r"(s), "l"(gmem), "n"(B), "r"(src_bytes), "l"(pol));
#else
  (void)pol;
  cp_async<B, P>(smem, gmem, pred);
#endif
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" :: "n"(N));
}

// Element offset of (r, c) in a 16-bit tile of `rows` rows kept in wgmma's
// 128-byte-swizzled layout: 64-column blocks of rows x 128 bytes, the 16-byte
// chunk c/8 of row r at chunk (c/8) ^ (r % 8) of its 128 bytes.
__device__ __forceinline__ int sw128(int r, int c, int rows) {
  return (c >> 6) * (rows * 64) + r * 64 + ((((c >> 3) & 7) ^ (r & 7)) << 3) + (c & 7);
}
// The same in the 32-byte-swizzled layout of a [rows, 16] tile: rows of 32 bytes, the
// 16-byte chunk c/8 of row r at chunk (c/8) ^ ((r / 4) % 2).
__device__ __forceinline__ int sw32(int r, int c) {
  return r * 16 + ((((c >> 3) & 1) ^ ((r >> 2) & 1)) << 3) + (c & 7);
}

}  // namespace kerf_dev
)KERF";
}

// Thread-block clusters (sm_90+): this program's rank in its cluster, the two
// halves of a barrier of the whole cluster (this program's shared-memory writes
// before its arrival are seen by the cluster's programs after their wait; the
// release is restricted to shared memory, so that it does not wait for the
// program's global writes and reductions to complete, which a full release at
// cluster scope does), and W-wide f32 (and byte) loads
// from the shared memory of program `rank` of the cluster at the offset `local`
// has here.
const char* cluster_helpers_source() {
  return R"KERF(
namespace kerf_dev {
__device__ __forceinline__ unsigned cluster_rank() {
  unsigned r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
__device__ __forceinline__ void cluster_arrive() {
  asm volatile("fence.release.sync_restrict::shared::cta.cluster;\n\t"
               "barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.aligned;" ::: "memory"); }
// An arrival with a full release: this program's earlier reads of the others' shared
// memory are done before any of them passes its wait (and writes where they read).
__device__ __forceinline__ void cluster_arrive_release() {
  asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
}
// The shared::cluster address of `local`'s place in the shared memory of program `rank`.
__device__ __forceinline__ unsigned cluster_addr(const void* local, unsigned rank) {
  const unsigned a = (unsigned)__cvta_generic_to_shared(local);
  unsigned ra;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(ra) : "r"(a), "r"(rank));
  return ra;
}
// W elements of T (2, 4, 8 or a multiple of 16 bytes, aligned to their size) from the
// shared memory of program `rank` at `local`'s place (cluster_load's hand-over and the
// cluster sums' reads of the other programs' values).
template <class T, int W> __device__ __forceinline__ Pack<T, W> ld_cluster_pack(const T* local, unsigned rank) {
  constexpr int N = int(sizeof(T)) * W;
  const unsigned ra = cluster_addr(local, rank);
  Pack<T, W> v;
  if constexpr (N == 2) {
    asm volatile("ld.shared::cluster.u16 %0, [%1];"
                 : "=h"(*reinterpret_cast<unsigned short*>(&v))
                 : "r"(ra)
                 : "memory");
  } else if constexpr (N == 4) {
    asm volatile("ld.shared::cluster.u32 %0, [%1];" : "=r"(*reinterpret_cast<unsigned*>(&v)) : "r"(ra) : "memory");
  } else if constexpr (N == 8) {
    unsigned* u = reinterpret_cast<unsigned*>(&v);
    asm volatile("ld.shared::cluster.v2.u32 {%0, %1}, [%2];" : "=r"(u[0]), "=r"(u[1]) : "r"(ra) : "memory");
  } else {
    static_assert(N % 16 == 0, "ld_cluster_pack moves 2, 4, 8 or a multiple of 16 bytes");
    unsigned* u = reinterpret_cast<unsigned*>(&v);
    #pragma unroll
    for (int k = 0; k < N / 16; ++k)
      asm volatile("ld.shared::cluster.v4.u32 {%0, %1, %2, %3}, [%4];"
                   : "=r"(u[4 * k]), "=r"(u[4 * k + 1]), "=r"(u[4 * k + 2]), "=r"(u[4 * k + 3])
                   : "r"(ra + 16u * k)
                   : "memory");
  }
  return v;
}
__device__ __forceinline__ unsigned ld_cluster_u8(const unsigned char* local, unsigned rank) {
  unsigned short v;
  asm volatile("ld.shared::cluster.u8 %0, [%1];" : "=h"(v) : "r"(cluster_addr(local, rank)) : "memory");
  return v;
}
}  // namespace kerf_dev
)KERF";
}

const char* wgmma_helpers_source() {
  // A shared-memory descriptor of a 128-byte-swizzled operand (8-row groups
  // 1024 bytes apart), of a 32-byte-swizzled one, and the warpgroup's ordering steps.
  return R"KERF(
namespace kerf_dev {
__device__ __forceinline__ unsigned long long wgmma_desc(unsigned smem_addr) {
  return (unsigned long long)((smem_addr >> 4) & 0x3FFF) | (1ull << 16) | (64ull << 32) | (1ull << 62);
}
// The same for a 32-byte-swizzled MN-major operand 16 wide: 8-row groups 256 bytes apart.
__device__ __forceinline__ unsigned long long wgmma_desc32(unsigned smem_addr) {
  return (unsigned long long)((smem_addr >> 4) & 0x3FFF) | (1ull << 16) | (16ull << 32) | (3ull << 62);
}
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }
}  // namespace kerf_dev
)KERF";
}

std::string wgmma_wrapper_source(int n) {
  std::string out;
  // D[64, n] += A[64, 16] (registers, mma.sync's A fragment per warp) @ B[16, n]
  // (shared memory, descriptor); TB = 1: B is MN-major (n contiguous), 0: K-major.
  // Then the same with A from shared memory too (wgmma_ss_*).
  const int regs = n / 2;
  for (const char* t : {"bf16", "f16"}) {
    std::string d, outs;
    for (int i = 0; i < regs; ++i) {
      d += (i ? ", %" : "%") + std::to_string(i);
      outs += std::string(i ? ", " : "") + "\"+f\"(d[" + std::to_string(i) + "])";
    }
    const std::string a = "%" + std::to_string(regs) + ", %" + std::to_string(regs + 1) + ", %" +
                          std::to_string(regs + 2) + ", %" + std::to_string(regs + 3);
    out += "namespace kerf_dev {\ntemplate <int TB>\n__device__ __forceinline__ void wgmma_" + std::string(t) +
           "_n" + std::to_string(n) +
           "(float* d, const unsigned* a, unsigned long long desc) {\n"
           "  asm volatile(\"{\\n.reg .pred p;\\nsetp.ne.b32 p, 1, 0;\\n\"\n"
           "               \"wgmma.mma_async.sync.aligned.m64n" +
           std::to_string(n) + "k16.f32." + t + "." + t + " {" + d + "}, {" + a + "}, %" +
           std::to_string(regs + 4) + ", p, 1, 1, %" + std::to_string(regs + 5) + ";\\n}\\n\"\n" +
           "               : " + outs + "\n"
           "               : \"r\"(a[0]), \"r\"(a[1]), \"r\"(a[2]), \"r\"(a[3]), \"l\"(desc), \"n\"(TB));\n}\n";
    // D[64, n] += A[64, 16] @ B[16, n], both from shared memory through descriptors;
    // TA = 1: A is MN-major (shared memory holds A^T, m contiguous), 0: K-major.
    out += "template <int TA, int TB>\n__device__ __forceinline__ void wgmma_ss_" + std::string(t) + "_n" +
           std::to_string(n) +
           "(float* d, unsigned long long da, unsigned long long db) {\n"
           "  asm volatile(\"{\\n.reg .pred p;\\nsetp.ne.b32 p, 1, 0;\\n\"\n"
           "               \"wgmma.mma_async.sync.aligned.m64n" +
           std::to_string(n) + "k16.f32." + t + "." + t + " {" + d + "}, %" + std::to_string(regs) + ", %" +
           std::to_string(regs + 1) + ", p, 1, 1, %" + std::to_string(regs + 2) + ", %" +
           std::to_string(regs + 3) + ";\\n}\\n\"\n" +
           "               : " + outs + "\n"
           "               : \"l\"(da), \"l\"(db), \"n\"(TA), \"n\"(TB));\n}\n}  // namespace kerf_dev\n";
  }
  return out;
}

}  // namespace kerf::jit::cuda
