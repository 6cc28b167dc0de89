// What the memory gives a one-pass read-modify-write of a bf16 matrix in the orders
// kerf's in-place kernels walk it (lora_merge: programs that own a block of rows and
// walk its columns; WALK_ROWS: programs that own a block of columns and walk its rows, their
// row slices contiguous, or interleaved so that the slices running together hold neighbouring
// rows), beside cudaMemcpy of the same bytes. No LoRA work: each element gets 0.001 added, so
// the figures bound what the access order alone allows. Stand-alone (no kerf):
//
//   nvcc -arch=sm_90a -O3 -o /tmp/access_order_bench tools/access_order_bench.cu
//   /tmp/access_order_bench [ROWS COLS]        # default 8192 8192
//
// Each line: the median of 50 timed launches (CUDA events, after 10 untimed), over
// three buffers in turn (so L2 holds none of them), and GB/s of the bytes read plus
// written. Rows and columns should be multiples of 128 and 1024.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

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
  check(cudaDeviceSynchronize(), "the launches");
  return 0;
}
