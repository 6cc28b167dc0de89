// What the memory gives a one-pass read-modify-write of a bf16 matrix in the orders
// kerf's in-place kernels walk it (lora_merge: programs that own a block of rows and
// walk its columns; WALK_ROWS: programs that own a block of columns and walk its rows, their
// row slices contiguous, or interleaved so that the slices running together hold neighbouring
// rows), beside cudaMemcpy of the same bytes; and the column strips again with each step's tile
// fetched by one bulk tensor copy (TMA, sm_90) into a ring of shared memory, written back by
// 16-byte stores or by a bulk tensor copy too; and one tile a program, the columns first, with
// the side reads of a merge at rank 16 or 64 (A's columns and B's rows, from L2) beside W's
// tile. No LoRA work: each element gets 0.001 added, so the figures bound what the access
// order alone allows. Stand-alone (no kerf):
//
//   nvcc -arch=sm_90a -O3 -o /tmp/access_order_bench tools/access_order_bench.cu
//   /tmp/access_order_bench [ROWS COLS]        # default 8192 8192
//
// Each line: the median of 50 timed launches (CUDA events, after 10 untimed), over
// three buffers in turn (so L2 holds none of them), and GB/s of the bytes read plus
// written. Rows and columns should be multiples of 128 and 1024.
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

namespace {

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

__device__ __forceinline__ uint4 bump(uint4 v) {
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&v);
  for (int k = 0; k < 4; ++k) h[k] = __hadd2(h[k], __float2bfloat162_rn(0.001f));
  return v;
}

// One 16-byte vector a thread at a time, the whole array in a grid-stride loop.
__global__ void grid_stride(const uint4* x, uint4* y, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    y[i] = bump(x[i]);
}

// One step of 1024 vectors, 4 a thread of 256: element e of the step lies at offset(e);
// all four loads issued before the stores.
template <class Offset>
__device__ __forceinline__ void step(const uint4* x, uint4* y, Offset offset) {
  uint4 v[4];
  size_t o[4];
  for (int k = 0; k < 4; ++k) {
    o[k] = offset(int(threadIdx.x) + k * 256);
    v[k] = x[o[k]];
  }
  for (int k = 0; k < 4; ++k) y[o[k]] = bump(v[k]);
}

// A block owns BM rows and 1/split of the columns and walks them VS vectors (16 bytes
// each) a row at a time, BM * VS = 1024 vectors a step. cols_first: the column slices on
// grid axis x, so the blocks running together hold a few row blocks across all of their
// columns.
template <int BM, int VS>
__global__ void row_blocks(const uint4* x, uint4* y, int cols, int split, int cols_first) {
  const int rb = cols_first ? blockIdx.y : blockIdx.x, sl = cols_first ? blockIdx.x : blockIdx.y;
  const int vpr = cols / 8, span = vpr / split;
  for (int c0 = sl * span; c0 < (sl + 1) * span; c0 += VS)
    step(x, y, [&](int e) { return size_t(rb * BM + e / VS) * vpr + c0 + e % VS; });
}

// A block owns VS vectors of every row of 1/split of the rows and walks them BM rows a
// step; the column strips on grid axis x, so the blocks running together cover whole rows.
template <int BM, int VS>
__global__ void column_strips(const uint4* x, uint4* y, int rows, int cols, int split) {
  const int vpr = cols / 8, per = rows / split;
  for (int r0 = blockIdx.y * per; r0 < (blockIdx.y + 1) * per; r0 += BM)
    step(x, y, [&](int e) { return size_t(r0 + e / VS) * vpr + blockIdx.x * VS + e % VS; });
}

// column_strips with the row slices interleaved: slice j takes the BM-row steps j, j + split,
// j + 2 split, ..., so the slices running together hold neighbouring rows (one window of
// split * BM rows moving down the array) instead of rows / split apart.
template <int BM, int VS>
__global__ void column_strips_interleaved(const uint4* x, uint4* y, int rows, int cols, int split) {
  const int vpr = cols / 8;
  for (int r0 = blockIdx.y * BM; r0 < rows; r0 += split * BM)
    step(x, y, [&](int e) { return size_t(r0 + e / VS) * vpr + blockIdx.x * VS + e % VS; });
}

// One tile of BM rows by VS vectors a program, the programs of a row block adjacent in launch
// order (the columns first), each also reading what a merge of rank R needs beside its W tile:
// A's columns [R, VS * 8] (from a [R, cols] array) and B's rows [BM, R] (from a [rows, R] array),
// both small enough to stay in L2 and read by every program of their column or row block. What
// they read is folded into a word that decides nothing (the side arrays hold zeros), so the
// loads stay and the result is the plain bump; W's loads are issued first, as a kernel whose
// product waits on the side reads would.
template <int BM, int VS, int R>
__global__ void __launch_bounds__(256) tiles_with_side_reads(const uint4* x, uint4* y, const uint4* a_side,
                                                             const uint4* b_side, int cols, unsigned never) {
  constexpr int NW = BM * VS / 256, NA = (R * VS + 255) / 256, NB = (BM * R / 8 + 255) / 256;
  const int vpr = cols / 8;
  uint4 v[NW];
  size_t o[NW];
  for (int k = 0; k < NW; ++k) {
    const int e = int(threadIdx.x) + k * 256;
    o[k] = size_t(blockIdx.y * BM + e / VS) * vpr + blockIdx.x * VS + e % VS;
    v[k] = x[o[k]];
  }
  unsigned mix = 0;
  for (int k = 0; k < NA; ++k) {
    const int e = int(threadIdx.x) + k * 256;
    if (e < R * VS) {
      const uint4 t = a_side[size_t(e / VS) * vpr + blockIdx.x * VS + e % VS];
      mix ^= t.x ^ t.y ^ t.z ^ t.w;
    }
  }
  for (int k = 0; k < NB; ++k) {
    const int e = int(threadIdx.x) + k * 256;
    if (e < BM * R / 8) {
      const uint4 t = b_side[size_t(blockIdx.y) * (BM * R / 8) + e];
      mix ^= t.x ^ t.y ^ t.z ^ t.w;
    }
  }
  for (int k = 0; k < NW; ++k) {
    uint4 w = bump(v[k]);
    if (mix == never) w.x ^= 1u;
    y[o[k]] = w;
  }
}

// Column strips of BM rows by 128 bf16 (256 bytes), each step's tile fetched by one bulk
// tensor copy into a ring of S slots (an mbarrier each; thread 0 issues the copies S steps
// ahead). The step's 16 KB is bumped by 256 threads, 64 bytes each, and written back by 16-byte
// stores, or (tma_store) into its slot and out by one bulk tensor copy, whose reads of the
// slot are waited for before the slot is filled again.
__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return unsigned(__cvta_generic_to_shared(p));
}

template <int BM, int S>
__global__ void __launch_bounds__(256) tma_strips(const __grid_constant__ CUtensorMap map, uint4* y, int rows,
                                                   int cols, int split, int tma_store) {
  extern __shared__ __align__(1024) unsigned char smem[];
  constexpr int tile_bytes = BM * 256;
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem + S * tile_bytes);
  const int per = rows / split, r0 = blockIdx.y * per, steps = per / BM, c0 = blockIdx.x * 128;
  const int vpr = cols / 8;
  const unsigned long long tmap = reinterpret_cast<unsigned long long>(&map);
  const auto issue = [&](int i) {
    const int slot = i % S;
    const unsigned bar = smem_addr(bars + slot), dst = smem_addr(smem + slot * tile_bytes);
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(tile_bytes) : "memory");
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];" ::"r"(
            dst),
        "l"(tmap), "r"(c0), "r"(r0 + i * BM), "r"(bar)
        : "memory");
  };
  if (threadIdx.x == 0) {
    for (int k = 0; k < S; ++k)
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(bars + k)) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  }
  __syncthreads();
  if (threadIdx.x == 0)
    for (int i = 0; i < S && i < steps; ++i) issue(i);
  for (int i = 0; i < steps; ++i) {
    const int slot = i % S;
    const unsigned bar = smem_addr(bars + slot), parity = unsigned(i / S) & 1u;
    unsigned done = 0;
    while (!done)
      asm volatile(
          "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
          : "=r"(done)
          : "r"(bar), "r"(parity)
          : "memory");
    uint4* tile = reinterpret_cast<uint4*>(smem + slot * tile_bytes);
    for (int k = 0; k < BM * 16 / 256; ++k) {
      const int e = int(threadIdx.x) + k * 256;  // vector e of the tile: row e / 16, column e % 16
      const uint4 v = bump(tile[e]);
      if (tma_store)
        tile[e] = v;
      else
        y[size_t(r0 + i * BM + e / 16) * vpr + blockIdx.x * 16 + e % 16] = v;
    }
    if (tma_store) asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncthreads();  // every thread is done with the slot (and, storing through it, has written it)
    if (threadIdx.x == 0) {
      if (tma_store) {
        asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];" ::"l"(tmap),
                     "r"(c0), "r"(r0 + i * BM), "r"(smem_addr(tile))
                     : "memory");
        asm volatile("cp.async.bulk.commit_group;" ::: "memory");
        if (i + S < steps) asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
      }
      if (i + S < steps) issue(i + S);
    }
  }
  if (threadIdx.x == 0 && tma_store) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

}  // namespace

int main(int argc, char** argv) {
  const int rows = argc > 2 ? std::atoi(argv[1]) : 8192, cols = argc > 2 ? std::atoi(argv[2]) : 8192;
  if (rows <= 0 || cols <= 0 || rows % 128 || cols % 1024) {
    std::fprintf(stderr, "ROWS must be a multiple of 128 and COLS of 1024\n");
    return 2;
  }
  const size_t bytes = size_t(rows) * cols * 2, n = bytes / 16;
  const int sets = 3;
  std::vector<uint4*> a(sets), b(sets);
  for (int i = 0; i < sets; ++i) {
    check(cudaMalloc(&a[i], bytes), "cudaMalloc");
    check(cudaMalloc(&b[i], bytes), "cudaMalloc");
    check(cudaMemset(a[i], 0x3f, bytes), "cudaMemset");  // bf16 0x3f3f: 0.746
    check(cudaMemset(b[i], 0x3f, bytes), "cudaMemset");
  }
  int sms = 0;
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), "cudaDeviceGetAttribute");
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  std::printf("%s, bf16 %dx%d (%.0f MB read and written)\n", prop.name, rows, cols, 2.0 * bytes / 1e6);
  constexpr int warm = 10, timed = 50;
  std::vector<cudaEvent_t> e0(warm + timed), e1(warm + timed);
  for (int i = 0; i < warm + timed; ++i) {
    check(cudaEventCreate(&e0[size_t(i)]), "cudaEventCreate");
    check(cudaEventCreate(&e1[size_t(i)]), "cudaEventCreate");
  }
  const auto time = [&](const char* name, auto launch) {
    for (int i = 0; i < warm + timed; ++i) {
      cudaEventRecord(e0[size_t(i)]);
      launch(i % sets);
      cudaEventRecord(e1[size_t(i)]);
    }
    check(cudaEventSynchronize(e1.back()), name);
    std::vector<float> t;
    for (int i = warm; i < warm + timed; ++i) {
      float ms = 0;
      cudaEventElapsedTime(&ms, e0[size_t(i)], e1[size_t(i)]);
      t.push_back(ms * 1000);
    }
    std::sort(t.begin(), t.end());
    const double us = t[t.size() / 2];
    std::printf("%-44s %8.1f us %7.0f GB/s\n", name, us, 2.0 * bytes / (us * 1e3));
  };
  time("cudaMemcpy (out of place)", [&](int s) { cudaMemcpyAsync(b[s], a[s], bytes, cudaMemcpyDeviceToDevice); });
  time("grid-stride, out of place", [&](int s) { grid_stride<<<sms * 8, 256>>>(a[s], b[s], n); });
  time("grid-stride, in place", [&](int s) { grid_stride<<<sms * 8, 256>>>(a[s], a[s], n); });
  char name[96];
  // One launch of a variant (`launch_once`, on buffer set 0) against the grid-stride loop on
  // the same bytes: true when every element was bumped once; else a line saying it is wrong.
  const auto bumps_once = [&](auto launch_once) {
    check(cudaMemset(a[0], 0x3f, bytes), "cudaMemset");
    check(cudaMemset(b[0], 0x3f, bytes), "cudaMemset");
    launch_once();
    grid_stride<<<sms * 8, 256>>>(b[0], b[0], n);
    std::vector<unsigned short> got(bytes / 2), want(bytes / 2);
    check(cudaMemcpy(got.data(), a[0], bytes, cudaMemcpyDeviceToHost), name);
    check(cudaMemcpy(want.data(), b[0], bytes, cudaMemcpyDeviceToHost), name);
    if (got == want) return true;
    std::printf("%-44s WRONG: not every element bumped once\n", name);
    return false;
  };
  const auto blocks = [&](auto kernel, int bm, int vs, int split, int cf) {
    if (cols / 8 / split < vs || rows % bm) return;
    std::snprintf(name, sizeof name, "row blocks %dx%dB, %d slices%s", bm, vs * 16, split, cf ? ", cols first" : "");
    time(name, [&](int s) {
      const dim3 grid = cf ? dim3(split, rows / bm) : dim3(rows / bm, split);
      kernel<<<grid, 256>>>(a[s], a[s], cols, split, cf);
    });
  };
  for (const int split : {4, 16, 64})
    for (const int cf : {0, 1}) {
      blocks(row_blocks<64, 16>, 64, 16, split, cf);
      blocks(row_blocks<16, 64>, 16, 64, split, cf);
    }
  blocks(row_blocks<8, 128>, 8, 128, 4, 0);
  const auto strips = [&](auto kernel, int bm, int vs, int split) {
    if ((rows / split) % bm || cols / 8 % vs) return;
    std::snprintf(name, sizeof name, "column strips %dx%dB, %d row slices", bm, vs * 16, split);
    time(name, [&](int s) { kernel<<<dim3(cols / 8 / vs, split), 256>>>(a[s], a[s], rows, cols, split); });
  };
  for (const int split : {2, 4, 8, 16}) {
    strips(column_strips<64, 16>, 64, 16, split);
    strips(column_strips<32, 32>, 32, 32, split);
    strips(column_strips<16, 64>, 16, 64, split);
  }
  for (const int split : {4, 8, 16}) {
    if (rows % (64 * split)) continue;
    std::snprintf(name, sizeof name, "column strips 64x256B, %d row slices interleaved", split);
    time(name, [&](int s) {
      column_strips_interleaved<64, 16><<<dim3(cols / 8 / 16, split), 256>>>(a[s], a[s], rows, cols, split);
    });
  }
  // One tile a program with a merge's side reads (A's columns, B's rows) at ranks 16 and 64,
  // checked first against the grid-stride loop like the TMA variants.
  uint4 *a_side = nullptr, *b_side = nullptr;
  check(cudaMalloc(&a_side, size_t(64) * cols * 2), "cudaMalloc");
  check(cudaMalloc(&b_side, size_t(rows) * 64 * 2), "cudaMalloc");
  check(cudaMemset(a_side, 0, size_t(64) * cols * 2), "cudaMemset");
  check(cudaMemset(b_side, 0, size_t(rows) * 64 * 2), "cudaMemset");
  const auto side = [&](auto kernel, int bm, int vs, int r) {
    if (rows % bm || cols / 8 % vs) return;
    std::snprintf(name, sizeof name, "tiles %dx%dB, cols first, rank %d side reads", bm, vs * 16, r);
    const dim3 grid(cols / 8 / vs, rows / bm);
    if (!bumps_once([&] { kernel<<<grid, 256>>>(a[0], a[0], a_side, b_side, cols, 0xffffffffu); })) return;
    time(name, [&](int s) { kernel<<<grid, 256>>>(a[s], a[s], a_side, b_side, cols, 0xffffffffu); });
  };
  side(tiles_with_side_reads<64, 16, 0>, 64, 16, 0);
  side(tiles_with_side_reads<64, 16, 16>, 64, 16, 16);
  side(tiles_with_side_reads<64, 16, 64>, 64, 16, 64);
  side(tiles_with_side_reads<128, 16, 64>, 128, 16, 64);
  side(tiles_with_side_reads<64, 32, 64>, 64, 32, 64);
  side(tiles_with_side_reads<128, 32, 64>, 128, 32, 64);
  side(tiles_with_side_reads<32, 32, 64>, 32, 32, 64);
  // The column strips through TMA (sm_90 and later): a tensor map over each buffer, 64 rows by
  // 256 bytes a box.
  if (prop.major >= 9) {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult q{};
    check(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q),
          "cudaGetDriverEntryPointByVersion");
    if (!fn || q != cudaDriverEntryPointSuccess) {
      std::fprintf(stderr, "cuTensorMapEncodeTiled: not in this driver\n");
      return 1;
    }
    const auto encode = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
    constexpr int BM = 64;
    std::vector<CUtensorMap> maps(sets);
    for (int i = 0; i < sets; ++i) {
      const cuuint64_t dims[2] = {cuuint64_t(cols), cuuint64_t(rows)}, strides[1] = {cuuint64_t(cols) * 2};
      const cuuint32_t box[2] = {128, BM}, unit[2] = {1, 1};
      if (encode(&maps[size_t(i)], CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, a[i], dims, strides, box, unit,
                 CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                 CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS) {
        std::fprintf(stderr, "cuTensorMapEncodeTiled failed\n");
        return 1;
      }
    }
    const auto tma = [&](auto kernel, int stages, int split, int tma_store) {
      if ((rows / split) % BM || cols % 128) return;
      const size_t bytes_smem = size_t(stages) * BM * 256 + 8 * size_t(stages);
      check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes_smem)),
            "cudaFuncSetAttribute");
      std::snprintf(name, sizeof name, "column strips 64x256B TMA, %d stages, %d slices%s", stages, split,
                    tma_store ? ", TMA store" : "");
      if (!bumps_once([&] {
            kernel<<<dim3(cols / 128, split), 256, bytes_smem>>>(maps[0], a[0], rows, cols, split, tma_store);
          }))
        return;
      time(name, [&](int s) {
        kernel<<<dim3(cols / 128, split), 256, bytes_smem>>>(maps[size_t(s)], a[s], rows, cols, split, tma_store);
      });
    };
    for (const int split : {4, 8, 16})
      for (const int st : {0, 1}) {
        tma(tma_strips<BM, 2>, 2, split, st);
        tma(tma_strips<BM, 4>, 4, split, st);
      }
  }
  check(cudaDeviceSynchronize(), "the launches");
  return 0;
}
