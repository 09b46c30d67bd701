// A bfloat16 linear on the CPU's matrix units (AMX): out [M, N] = x [M, K] W^T, for the few rows
// of a decode step, where a step's time is the weights' trip from memory.
//
// Built at first use by engine/fast/cpu_linear_amx.py (the host's C++ compiler, -O3 -march=native)
// and called through ctypes. Where the build does not target AMX-BF16 or Linux refuses this
// process the tile state, the entries return -1 / -2 and compute nothing; the Python side then
// never offers the layout.
//
// The weight is packed once (`linear_amx_pack`) into the order the kernel reads it, so that a call
// streams it front to back, one pass, whatever the row count up to a chunk:
//   - columns in blocks of 16 (one tile's width), blocks in groups of kGroup (the tiles one pass
//     over a row block keeps: kGroup float accumulators);
//   - within a group, for each 32-deep slice of K, the group's B tiles side by side: tile (block,
//     slice) holds 16 rows of pairs, row p = for each of the block's 16 columns c, the weight
//     values W[c][2p], W[c][2p + 1] of the slice (the matrix units' pair layout), 1 KiB.
// So a group's tiles are one contiguous run of K / 32 x kGroup KiB, and groups follow each other.
//
// A call: the rows in chunks (at most kChunkRows, and at most kChunkBytes of A tiles: a chunk's
// input stays in the L2 cache); per chunk the column groups are shared by torch's OpenMP workers
// (`share`, cpu_kernel_share.h). A chunk of one row block (a decode step of up to 16 requests):
// per group, the group's accumulators zeroed, then for each slice one A tile (16 rows x 32 of x,
// read in place; fewer rows from the thread's own copy, `padded_tail`) and the group's B tiles,
// one tile product each. A chunk of several row blocks (`several`): up to kFewPairs pairs of row
// blocks (64 rows), A read in place as above and each column pair's B tiles meeting the row pairs
// right after each other (B reused from L1); more rows, first copied into A tiles of 1 KiB each
// (zero-padded, on 64-byte lines), then the groups in panels whose B tiles (whole K, about
// kPanelBytes) stay in L2; per panel, per pair of row blocks,
// K in even passes of at most kPassSlices slices (the pair's A tiles of a pass, 32 KiB, stay in L1
// while every column pair of the panel passes: the B tiles are loaded with the hint not to keep
// them in L1). Each block: two row blocks x two column blocks, 4 accumulators, each A and B tile
// loaded once for two products. Measured on a Sapphire Rapids class core against oneDNN's
// prepacked matmul, what made the difference: (1) the rounding and writing out of a finished block, done right after its tile
// stores, left the matrix unit idle: it now happens a few rows per slice during the next block
// (`Pending`), and the accumulators are stored in the next block's first slice (`Unstored`), not
// at the end of their own; (2) an output of kStreamBytes or more goes out in whole 64-byte lines
// past the cache (no read of each line before its write); (3) the L1 residency of A above: L2
// alone feeds less than one tile per product. The float tiles go out through small buffers, each
// element rounded once to the output's dtype (bfloat16: to nearest even, as PyTorch rounds).
// Products of bfloat16 values are exact in float and the sums are float: oneDNN's arithmetic on
// the same values, in another summation order.
//
// Two threads or more: a call of few rows per thread shares each chunk's column groups (one run of
// neighbouring groups per thread; above 64 rows its A tiles packed by all of them first); a call of
// many rows (kSplitRows per thread; half that for a weight of at most kSplitWeightBytes, which stays
// in a core's L2 cache) gives each thread one run of row pairs instead, on which it does what one thread
// does on a whole call (its own chunks, its own A tiles, no barrier per chunk, but each thread
// reading the whole weight). Measured on the Sapphire Rapids class core, two threads against one
// per call (`python -m course.tuning.levers linear-threads --rows 16,64,256,2048`, against the same
// at the column split), the small preset's [512, 512] / [1024, 512] / [512, 1536] at 2,048 rows: the
// column split 1.24 / 1.52 / 1.41x, the row split 1.73 / 1.87 / 1.89x (the columns' chunks each
// ended in a barrier, and every thread read A tiles the other had packed). At 256 rows the row split
// did as well or better for those weights (1.43-1.66x against 1.33-1.44x; these calls last 60-300 us
// and move by ~0.15x between sittings) but lost for larger ones, whose trips from L3 it doubles
// (ad-hoc timing: [3072, 512] gated 1.69 against 1.89x; the 0.6B shape's [4096, 1024] 1.52-1.58 against
// 1.81x, [6144, 1024] gated 1.67-1.71 against 1.93x; at 1,024 rows they are level or the row split
// leads: 1.94-2.00 against 1.85-2.02x); at 64 rows the column split leads everywhere (split by rows,
// each thread reads every weight for 32 rows: 1.32-1.37x against 1.57-1.61x). Either way each
// output value is computed exactly as on one thread (a row's products and sums do not depend on the
// rows beside it).
//
// The tile configuration belongs to the thread: each work loop holds its own for its duration
// (`OwnTiles`, cpu_amx_tiles.h), then the one in force before it (oneDNN's, or none) is back.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_kernel_share.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__) && defined(__linux__)
#define LINEAR_AMX 1
#include "cpu_amx_tiles.h"
#include "cpu_kernel_wide.h"  // the gated mode's SiLU (Wide<64>: 16-float vectors)
#else
#define LINEAR_AMX 0
#endif

namespace {

constexpr int64_t kCols = 16;       // columns of a block (one tile's width in floats)
constexpr int64_t kDepth = 32;      // K of a slice (one tile product's depth in bf16)
constexpr int64_t kGroup = 4;       // column blocks a pass keeps accumulators for
constexpr int64_t kRows = 16;       // rows of a block (a tile's rows)
constexpr int64_t kChunkRows = 256;  // rows whose input is kept in cache across the groups (at most)
constexpr int64_t kChunkBytes = 768 * 1024;  // a chunk's A tiles at most (a deep K: fewer rows), L2-resident
constexpr int64_t kPassSlices = 16;  // K slices per pass of a row pair (its A tiles, 32 KiB, stay in the L1 cache)
// B tiles of a panel of column groups (whole K), kept in the L2 cache (beside the next panel coming
// in and the chunk's A tiles). 256 KiB against 512, Qwen3-0.6B's linears on one thread
// (`python -m course.tuning.levers linear-amx --preset qwen3-0.6b --rows 128,256`, two runs of each
// tree): 139.8-140.0 / 236.3-238.7 ms a pass against 144.7-148.9 / 249.2-258.7 at 128 / 256 rows;
// 128-192 KiB (a single column group at K = 1,024) were slower at 2,048 rows.
constexpr int64_t kPanelBytes = 256 * 1024;
constexpr int64_t kFewPairs = 2;  // up to this many row pairs: each column pair meets them in turn (B reused from L1)
constexpr int64_t kSplitRows = 256;  // rows per thread from which threads split a call's rows, not its columns
constexpr int64_t kSplitWeightBytes = 2 << 20;  // a weight at most this big: from half as many rows per thread
constexpr int64_t kStreamBytes = 1 << 20;  // an output this big is written past the cache (it would not stay in it)
constexpr int64_t kTile = kRows * kDepth;  // bf16 elements of a B tile (16 pair rows x 16 columns x 2)

// Where tile (block nb, slice kb) starts in the packed weight, in elements.
inline int64_t tile_offset(int64_t nb, int64_t kb, int64_t blocks, int64_t slices) {
  const int64_t g0 = nb / kGroup * kGroup, width = std::min(kGroup, blocks - g0);
  return (g0 * slices + kb * width + (nb - g0)) * kTile;
}

// The first 64-byte boundary at or after p (a buffer allocated 64 bytes long more): tiles on line
// boundaries, each 64-byte row one cache line, not two.
template <typename T>
inline T* line_aligned(T* p) {
  return reinterpret_cast<T*>((reinterpret_cast<uintptr_t>(p) + 63) / 64 * 64);
}

#if LINEAR_AMX
// 16 floats -> 16 bfloat16, rounded to nearest even as PyTorch rounds (NaN lanes quieted, not rounded).
inline __m256i rounded_16(const float* src) {
  const __m512i u = _mm512_loadu_si512(src);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                _mm512_set1_epi32(0x7f800000));
  return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(rounded, nan, quiet));
}
inline void round_16(const float* src, uint16_t* dst) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), rounded_16(src));
}

// Software prefetch of the weight (all three on by default; `linear_amx_set_prefetch(0)` turns them off,
// to measure them: `python -m course.tuning.levers linear-amx`).
//   - One row block (`group_block`, a decode step): every slice also asks for 4 lines 16 KiB
//     further on in the packed weight, which the call reads front to back. The hardware's
//     prefetcher follows that stream but starts again at each 4 KiB page; these lines reach the
//     next pages first. ~3-4% off a pass over the 0.6B shape's weights from memory at 1 and 16
//     rows, on one thread and two (ad-hoc timing; it reads at ~15 GB/s, near this core's ~15.6).
//   - Up to kFewPairs row pairs (`several`'s few path, 17-64 rows): the first row pair's pass, which
//     reads each column pair's B tiles from memory, asks for 8 lines 16 KiB ahead each slice: ~12-16%
//     off that pass over the 0.6B shape's weights at 32 and 64 rows, on one thread and two (4 lines:
//     ~5%; 12 no better than 8).
//   - Several row blocks (`several`): the B tiles of the panel a thread multiplies next, fetched
//     into L2 a few lines a slice (`Ahead`) while the row pairs after the first multiply this
//     panel from L2. Without it, the first row pair of each panel waited on memory while the matrix
//     unit idled, and the later pairs ran on the unit with memory idle; 4 lines a slice (at 128
//     rows, 3 of every 8 of the next panel's lines) gained most: ~4-9% at 96-512 rows at both
//     presets' shapes, on one thread and two, measured with panels of 512 KiB (more lines a slice,
//     or every other line, made the call slower than none: the prefetches held the line fill
//     buffers the tile loads need; with 256 KiB panels, 3 lines were level with 4 within drift).
bool weight_prefetch = true;
constexpr int64_t kDecodeAheadBytes = 16 << 10;
constexpr int64_t kAheadLines = 4;
constexpr int64_t kFewAheadLines = 8;

// `lines` lines of the packed weight kDecodeAheadBytes past `at` (the first two kinds above).
inline void pages_ahead(const uint16_t* at, int64_t lines) {
  for (int64_t i = 0; i < lines; ++i)
    _mm_prefetch(reinterpret_cast<const char*>(at) + kDecodeAheadBytes + 64 * i, _MM_HINT_T1);
}

// Rows [r0, r0 + 16) of a chunk against one group of `width` column blocks starting at block nb0:
// tiles 0-3 accumulate, tile 4 is A, tiles 5-7 B. `a` points at the block's first row (stride lda
// elements); `acc` receives the 16 x (width x 16) floats.
template <int W>
inline void group_block(const uint16_t* a, int64_t lda, const uint16_t* b, int64_t slices, float* acc) {
  if (W > 0) _tile_zero(0);
  if (W > 1) _tile_zero(1);
  if (W > 2) _tile_zero(2);
  if (W > 3) _tile_zero(3);
  for (int64_t kb = 0; kb < slices; ++kb) {
    _tile_loadd(4, a + kb * kDepth, lda * 2);
    const uint16_t* t = b + kb * W * kTile;
    if (weight_prefetch) pages_ahead(t, kAheadLines);
    // B tiles in registers 5, 6, 7 in turn: a load need not wait for the product reading the last
    if (W > 0) { _tile_loadd(5, t, 64); _tile_dpbf16ps(0, 4, 5); }
    if (W > 1) { _tile_loadd(6, t + kTile, 64); _tile_dpbf16ps(1, 4, 6); }
    if (W > 2) { _tile_loadd(7, t + 2 * kTile, 64); _tile_dpbf16ps(2, 4, 7); }
    if (W > 3) { _tile_loadd(5, t + 3 * kTile, 64); _tile_dpbf16ps(3, 4, 5); }
  }
  const int64_t ld = kGroup * kCols * 4;  // bytes per row of acc
  if (W > 0) _tile_stored(0, acc, ld);
  if (W > 1) _tile_stored(1, acc + kCols, ld);
  if (W > 2) _tile_stored(2, acc + 2 * kCols, ld);
  if (W > 3) _tile_stored(3, acc + 3 * kCols, ld);
}

// acc (rows x cols floats, row stride kGroup x 16) -> out rows r0.. at column c0 (of n), each
// value rounded once. Gated (`mode` kSiluMul): acc's 16-column blocks are (gate, up) pairs of a
// SwiGLU projection and out gets, per pair, the 16 values R(R(silu(R(g))) * R(u)) at column c0 / 2:
// the bf16 linear's outputs, then cpu_elementwise_kernel.cpp's silu_mul on them, in one pass.
// kWidened: float32 out holding the bf16 outputs (each value rounded as kBf16 rounds it, then
// widened exactly), what a bfloat16 LM head's logits become before sampling, without the bf16
// copy in between.
constexpr int64_t kBf16 = 0, kF32 = 1, kSiluMul = 2, kWidened = 3;  // output modes
constexpr int64_t out_bytes(int64_t mode) { return mode == kF32 || mode == kWidened ? 4 : 2; }
inline void emit(const float* acc, int64_t rows, int64_t cols, void* out, int64_t mode, int64_t n, int64_t r0,
                 int64_t c0, bool stream = false) {
  using W = Wide<64>;
  for (int64_t i = 0; i < rows; ++i) {
    const float* src = acc + i * kGroup * kCols;
    if (mode == kSiluMul) {
      uint16_t* dst = static_cast<uint16_t*>(out) + (r0 + i) * n + c0 / 2;
      for (int64_t j = 0; j < cols; j += 2 * kCols) {
        const W::F g = W::round_bf16(W::load(src + j)), u = W::round_bf16(W::load(src + j + kCols));
        W::store(dst + j / 2, W::round_bf16(W::silu(g)) * u);  // the store rounds the product
      }
      continue;
    }
    if (mode == kF32) {
      std::memcpy(static_cast<float*>(out) + (r0 + i) * n + c0, src, cols * sizeof(float));
    } else if (mode == kWidened) {
      float* dst = static_cast<float*>(out) + (r0 + i) * n + c0;
      for (int64_t j = 0; j < cols; j += kCols) {  // 16 values: one 64-byte line
        const __m512i v = _mm512_slli_epi32(_mm512_cvtepu16_epi32(rounded_16(src + j)), 16);
        if (stream && reinterpret_cast<uintptr_t>(dst + j) % 64 == 0)
          _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + j), v);
        else
          _mm512_storeu_si512(dst + j, v);
      }
    } else {
      uint16_t* dst = static_cast<uint16_t*>(out) + (r0 + i) * n + c0;
      int64_t j = 0;
      if (stream)  // whole 64-byte lines written past the cache: no read of the line before the write
        for (; j + 2 * kCols <= cols && reinterpret_cast<uintptr_t>(dst + j) % 64 == 0; j += 2 * kCols)
          _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + j),
                              _mm512_inserti64x4(_mm512_castsi256_si512(rounded_16(src + j)), rounded_16(src + j + kCols), 1));
      for (; j < cols; j += kCols) round_16(src + j, dst + j);
    }
  }
}

// A finished pair of row blocks' float tiles (the partial sums after the last K pass) waiting to
// be emitted. Rounding and writing them out is vector work with stores that miss the cache; done
// right after the tile stores it left the matrix unit idle (skipping it, a wrong-output experiment
// ran twice as fast at [3072, 512] x 2048 rows). So the next pair_block emits it a few rows per
// slice, after the first slice (which stores these tiles), while its tile products run; whatever
// is left goes out at that block's end. A buffer is written again only by the block after next's
// first slice: program order keeps every reuse correct.
struct Pending {
  const float* acc[2] = {nullptr, nullptr};  // row block i's floats (row stride kGroup x 16)
  int64_t rows[2] = {0, 0};                  // valid rows of each (0: none)
  int64_t r0[2] = {0, 0};                    // their first output rows
  int64_t cols = 0, c0 = 0;                  // columns (floats per row) and the first output column
  int64_t next = 0;                          // rows emitted so far, over both blocks
  void* out = nullptr;
  int64_t mode = 0, n = 0;
  bool stream = false;  // write whole lines past the cache (an output too big to stay in it)
  int64_t total() const { return rows[0] + rows[1]; }
  // Emit up to `count` more rows.
  void step(int64_t count) {
    for (const int64_t stop = std::min(total(), next + count); next < stop; ++next) {
      const int64_t b = next < rows[0] ? 0 : 1, i = b ? next - rows[0] : next;
      emit(acc[b] + i * kGroup * kCols, 1, cols, out, mode, n, r0[b] + i, c0, stream);
    }
  }
  void flush() { step(total()); }
};

// The accumulator tiles of the block before, still in registers 0-3: stored during the next
// block's first slice, each just before its register starts over, so the matrix unit keeps
// multiplying while the last products of the block before finish (stored at the end of a block,
// every one waited for the last product's latency: ~15% of the time at 256 rows).
struct Unstored {
  float* acc0 = nullptr;  // tiles 0, 1 (row block 0; tile 1 at acc0 + 16)
  float* acc1 = nullptr;  // tiles 2, 3 (row block 1)
  int rows = 0, cols = 0;  // row blocks and column blocks held (0: none)
  void store() const {  // the tiles as they are, out of the pipeline (after a call's last block)
    const int64_t ld = kGroup * kCols * 4;
    if (rows > 0) _tile_stored(0, acc0, ld);
    if (rows > 0 && cols > 1) _tile_stored(1, acc0 + kCols, ld);
    if (rows > 1) _tile_stored(2, acc1, ld);
    if (rows > 1 && cols > 1) _tile_stored(3, acc1 + kCols, ld);
  }
};

// A run of the weight's bytes asked for kAheadLines lines at a time (`several`: the next panel).
struct Ahead {
  const char* next = nullptr;  // the next line to fetch
  const char* end = nullptr;   // past the last
  void step() {
    for (int64_t i = 0; i < kAheadLines && next < end; ++i, next += 64) _mm_prefetch(next, _MM_HINT_T1);
  }
};

// Two row blocks (A tiles 4, 5 from `a0`, `a1`: a row block's A tiles packed one after the other,
// 1 KiB each; R = 1: `a0` only) against C column blocks of one group (B tiles at `b`, `stride`
// elements apart per slice, in registers 6 and 7), slices [s0, s1): accumulators 0-3 = (row block
// i, column block j) at 2i + j, started from zero or (`load`) from acc0 / acc1 (16 x C x 16 each,
// row stride kGroup x 16), and left in the registers: `prev` (the block before's) is stored in the
// first slice, then `pend` (its floats, if final) emitted a few rows per slice; `prev` becomes this block.
// Each slice after the first also steps `ahead` (if any) and asks for `far_lines` lines of the
// weight kDecodeAheadBytes on (see weight_prefetch).
template <int R, int C>
inline void pair_block(const uint16_t* a0, const uint16_t* a1, const uint16_t* b, int64_t stride,
                       int64_t s0, int64_t s1, bool load, float* acc0, float* acc1, Unstored& prev, Pending& pend,
                       bool nt, int64_t a_slice, int64_t a_ld, Ahead* ahead, int64_t far_lines) {
  const int64_t ld = kGroup * kCols * 4;
  // B tiles past L1 (keeping the row pair's A tiles there) where each tile row is one cache line; a
  // weight off the 64-byte grid (not torch's allocation) has rows across two lines, each line read
  // by two loads: there only a normal load keeps it for the second
  nt = nt && reinterpret_cast<uintptr_t>(b) % 64 == 0;
  {  // the first slice: each accumulator register stored (the block before's), then started, then multiplied
    const uint16_t* t = b + s0 * stride;
    if (prev.rows > 0) _tile_stored(0, prev.acc0, ld);
    if (load) _tile_loadd(0, acc0, ld); else _tile_zero(0);
    _tile_loadd(4, a0 + s0 * a_slice, a_ld);
    if (nt) _tile_stream_loadd(6, t, 64); else _tile_loadd(6, t, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (prev.rows > 0 && prev.cols > 1) _tile_stored(1, prev.acc0 + kCols, ld);
    if (C > 1) {
      if (load) _tile_loadd(1, acc0 + kCols, ld); else _tile_zero(1);
      if (nt) _tile_stream_loadd(7, t + kTile, 64); else _tile_loadd(7, t + kTile, 64);
      _tile_dpbf16ps(1, 4, 7);
    }
    if (prev.rows > 1) _tile_stored(2, prev.acc1, ld);
    if (R > 1) {
      if (load) _tile_loadd(2, acc1, ld); else _tile_zero(2);
      _tile_loadd(5, a1 + s0 * a_slice, a_ld);
      _tile_dpbf16ps(2, 5, 6);
    }
    if (prev.rows > 1 && prev.cols > 1) _tile_stored(3, prev.acc1 + kCols, ld);
    if (R > 1 && C > 1) {
      if (load) _tile_loadd(3, acc1 + kCols, ld); else _tile_zero(3);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  const int64_t per = (pend.total() - pend.next + (s1 - s0) - 2) / std::max<int64_t>(1, s1 - s0 - 1);  // rows to emit per slice
  for (int64_t kb = s0 + 1; kb < s1; ++kb) {
    const uint16_t* t = b + kb * stride;
    _tile_loadd(4, a0 + kb * a_slice, a_ld);
    if (nt) _tile_stream_loadd(6, t, 64); else _tile_loadd(6, t, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (C > 1) {
      if (nt) _tile_stream_loadd(7, t + kTile, 64); else _tile_loadd(7, t + kTile, 64);
      _tile_dpbf16ps(1, 4, 7);
    }
    if (R > 1) {
      _tile_loadd(5, a1 + kb * a_slice, a_ld);
      _tile_dpbf16ps(2, 5, 6);
      if (C > 1) _tile_dpbf16ps(3, 5, 7);
    }
    pend.step(per);
    if (ahead != nullptr) ahead->step();
    pages_ahead(t, far_lines);  // few row pairs: B read from memory here
  }
  pend.flush();
  prev.acc0 = acc0, prev.acc1 = acc1, prev.rows = R, prev.cols = C;
}

// Rows [c0, c1) of the call (several row blocks) against column groups [begin, end). Up to
// kFewPairs row pairs, A read in place (`apack` null: x's rows, row stride lda, the rows from `full`
// on from the thread's copy `tail`): per group, column pair and K pass, the row pairs in turn (the
// B tiles read from memory once, again from L1). Packing those few rows first cost more than it
// saved (ad-hoc timing, [512, 512] at 64 rows, weight in cache: one thread 28.0 -> 25.6 us), and on
// two threads, which packed half each, every thread then read the half the other core had written
// (28.1 -> 17.9 us). More rows, copied to `apack` as A tiles: the groups in panels whose B tiles
// (whole K) stay in the L2 cache (about kPanelBytes); per panel, per row pair, per K pass
// (even passes of at most kPassSlices slices: the pair's A tiles of a pass stay in L1), the row
// pair meets every column pair of the panel in turn, so an output row is written left to right, a
// panel's width at a time. Each block's tiles go to a buffer during the next block (`Unstored`)
// and out during the one after that stored them (`Pending`): with one K pass, two staging buffers
// in turn; with several, partial sums carried between passes (one buffer per row pair, or per
// group of the panel). From the second row pair of a panel on, the next panel's B tiles (or, after
// the last, the first again when another chunk of rows follows: `again`) come into L2 a few lines
// a slice (`Ahead`).
inline void several(const uint16_t* apack, int64_t c0, int64_t c1, int64_t m, int64_t slices, int64_t blocks,
                    const uint16_t* w, int64_t begin, int64_t end, Pending& pend, const uint16_t* x, int64_t lda,
                    int64_t full, const uint16_t* tail, bool again) {
  constexpr int64_t kBuf = 2 * kRows * kGroup * kCols;  // floats of one row pair x one group
  const int64_t pairs = (c1 - c0 + 2 * kRows - 1) / (2 * kRows);
  const bool few = pairs <= kFewPairs;
  const int64_t panel = few ? 1 : std::max<int64_t>(1, kPanelBytes / (slices * kGroup * kTile * 2));
  const int64_t passes = (slices + kPassSlices - 1) / kPassSlices, depth = (slices + passes - 1) / passes;  // even passes
  const bool one_pass = passes == 1;
  static thread_local std::vector<float> buf;
  const int64_t need = one_pass ? 2 * kBuf : std::max(panel, pairs) * kBuf;
  if (static_cast<int64_t>(buf.size()) < need + 16) buf.assign(need + 16, 0.0f);
  float* const base = line_aligned(buf.data());
  int64_t flip = 0;
  Unstored prev;
  Ahead ahead;  // the next panel's bytes, stepped by a panel's row pairs after the first (empty on the few path)
  // One block: row pair pr, slices [s0, s1), column blocks j, j + 1 of group g; its partial sums
  // (several passes) in buffer `slot`.
  const auto block = [&](int64_t pr, int64_t s0, int64_t s1, int64_t g, int64_t j, int64_t slot) {
    const int64_t r0 = c0 + pr * 2 * kRows, r1 = r0 + kRows;
    // A tiles: packed (a row block's tiles one after the other, 1 KiB each), or read in place
    // (`apack` null: x's rows, row stride lda; a partial last block from `tail`)
    const bool packed = apack != nullptr;
    const uint16_t* a0 = packed ? apack + (2 * pr) * slices * kTile : r0 < full ? x + r0 * lda : tail;
    const uint16_t* a1 = packed ? a0 + slices * kTile : r1 < full ? x + r1 * lda : tail;
    const int64_t a_slice = packed ? kTile : kDepth, a_ld = packed ? 64 : lda * 2;  // elements a slice, bytes a row
    const int64_t nb0 = g * kGroup, width = std::min(kGroup, blocks - nb0), cols = std::min<int64_t>(2, width - j);
    const uint16_t* bj = w + tile_offset(nb0, 0, blocks, slices) + j * kTile;
    const int64_t stride = width * kTile;
    // one pass: the staging buffer the pending block is not in; several: this block's partial sums
    float* p0 = one_pass ? base + (flip ^= 1) * kBuf : base + slot * kBuf + j * kCols;
    float* p1 = p0 + kRows * kGroup * kCols;
    // B past L1 once the row pair 0 brought it into L2 (its first trip from memory with normal loads:
    // ~3% faster on weights out of cache at 256 rows)
    const bool load = s0 > 0, nt = !few && pr > 0;
    const int64_t far = few && pr == 0 && weight_prefetch ? kFewAheadLines : 0;
    Ahead* const fetching = pr > 0 ? &ahead : nullptr;
    if (r1 < c1) {
      if (cols == 2) pair_block<2, 2>(a0, a1, bj, stride, s0, s1, load, p0, p1, prev, pend, nt, a_slice, a_ld, fetching, far);
      else pair_block<2, 1>(a0, a1, bj, stride, s0, s1, load, p0, p1, prev, pend, nt, a_slice, a_ld, fetching, far);
    } else {
      if (cols == 2) pair_block<1, 2>(a0, a1, bj, stride, s0, s1, load, p0, p1, prev, pend, nt, a_slice, a_ld, fetching, far);
      else pair_block<1, 1>(a0, a1, bj, stride, s0, s1, load, p0, p1, prev, pend, nt, a_slice, a_ld, fetching, far);
    }
    if (s1 == slices) {  // emitted during the next block (or at the end)
      pend.acc[0] = p0, pend.acc[1] = p1;
      pend.rows[0] = std::min(kRows, m - r0), pend.rows[1] = r1 < c1 ? std::min(kRows, m - r1) : 0;
      pend.r0[0] = r0, pend.r0[1] = r1;
      pend.cols = cols * kCols, pend.c0 = (nb0 + j) * kCols, pend.next = 0;
    } else {
      pend.rows[0] = pend.rows[1] = 0, pend.next = 0;
    }
  };
  const auto width = [&](int64_t g) { return std::min(kGroup, blocks - g * kGroup); };
  if (few) {  // a column pair's B tiles met by each row pair in turn, right after each other (from L1)
    for (int64_t g = begin; g < end; ++g)
      for (int64_t j = 0; j < width(g); j += 2)
        for (int64_t s0 = 0; s0 < slices; s0 += depth)
          for (int64_t pr = 0; pr < pairs; ++pr) block(pr, s0, std::min(slices, s0 + depth), g, j, pr);
  } else {
    for (int64_t g0 = begin; g0 < end; g0 += panel) {
      // what `ahead` fetches during this panel: the next panel of [begin, end), or after the last
      // its first again where another chunk of rows follows (`again`)
      const int64_t gn = g0 + panel < end ? g0 + panel : again ? begin : end;
      ahead.next = ahead.end = nullptr;
      if (weight_prefetch && gn != g0 && gn < end) {  // groups follow each other whole: one run of bytes
        ahead.next = reinterpret_cast<const char*>(w + gn * kGroup * slices * kTile);
        ahead.end = reinterpret_cast<const char*>(w + std::min(blocks, std::min(end, gn + panel) * kGroup) * slices * kTile);
      }
      for (int64_t pr = 0; pr < pairs; ++pr)
        for (int64_t s0 = 0; s0 < slices; s0 += depth)
          for (int64_t g = g0; g < std::min(end, g0 + panel); ++g)
            for (int64_t j = 0; j < width(g); j += 2) block(pr, s0, std::min(slices, s0 + depth), g, j, g - g0);
    }
  }
  prev.store();  // the last block's tiles (the caller then emits `pend`)
}

// The last `count` (< kRows) rows of x, K each, as a row block of kRows rows in this thread's own
// buffer (one A tile per slice, read in place). Each thread copies the rows it reads, so no thread
// reads a buffer another core wrote: on two threads a padded copy made once by the calling thread
// cost the other core ~3-4 us a call ([512, 512] at 1-15 rows, weight in cache: slower on two
// threads than on one). The rows past `count` hold whatever the buffer held (zeros, or an earlier
// call's rows): each is multiplied on its own into accumulator rows that are never written out.
inline const uint16_t* padded_tail(const uint16_t* rows, int64_t count, int64_t k) {
  static thread_local std::vector<uint16_t> buf;
  if (static_cast<int64_t>(buf.size()) < kRows * k + 32) buf.assign(kRows * k + 32, 0);
  uint16_t* const t = line_aligned(buf.data());
  std::memcpy(t, rows, count * k * sizeof(uint16_t));
  return t;
}

int64_t run(const uint16_t* x, int64_t m, int64_t k, const uint16_t* w, int64_t n, void* out, int64_t mode,
            int64_t threads) {
  const int64_t ldo = mode == kSiluMul ? n / 2 : n;  // out's row length
  if (!tiles_permitted()) return -2;
  const int64_t blocks = n / kCols, slices = k / kDepth, groups = (blocks + kGroup - 1) / kGroup;
  const int64_t full = m / kRows * kRows;  // rows served in place; the rest from a copy (`padded_tail`)
  const int64_t chunk = std::clamp<int64_t>(kChunkBytes / (2 * k) / (2 * kRows) * (2 * kRows), 2 * kRows, kChunkRows);
  for (int64_t c0 = 0; c0 < m; c0 += chunk) {
    const int64_t c1 = std::min(m, c0 + chunk);
    // Several row blocks: the chunk's rows as A tiles, each 1 KiB contiguous (the last block's rows
    // past the chunk zero), packed by the call's threads before any of them multiplies.
    static thread_local std::vector<uint16_t> apack;
    uint16_t* a_tiles = nullptr;  // apack's first 64-byte line
    const int64_t rbs = c1 - c0 > kRows ? (c1 - c0 + kRows - 1) / kRows : 0;
    // Up to kFewPairs row pairs: A read in place (see the top), nothing packed.
    const int64_t packed_blocks = c1 - c0 <= kFewPairs * 2 * kRows ? 0 : rbs;
    if (packed_blocks) {
      apack.resize(rbs * kRows * k + 32);
      a_tiles = line_aligned(apack.data());
    }
    auto pack = [&](int64_t rb_begin, int64_t rb_end) {
      for (int64_t rb = rb_begin; rb < rb_end; ++rb)
        for (int64_t kb = 0; kb < slices; ++kb)
          for (int64_t i = 0; i < kRows; ++i) {
            uint16_t* dst = a_tiles + (rb * slices + kb) * kTile + i * kDepth;
            const int64_t row = c0 + rb * kRows + i;
            if (row < c1)
              std::memcpy(dst, x + row * k + kb * kDepth, kDepth * sizeof(uint16_t));
            else
              std::memset(dst, 0, kDepth * sizeof(uint16_t));
          }
    };
    share_after(packed_blocks, pack, groups, threads, [&](auto&& next) {
      OwnTiles tiles(8);
      Pending pend;
      pend.out = out, pend.mode = mode, pend.n = ldo;
      pend.stream = m * ldo * out_bytes(mode) >= kStreamBytes;
      const uint16_t* tail = nullptr;  // this thread's copy of the partial last row block, made at first use
      const auto tail_rows = [&] { return tail ? tail : (tail = padded_tail(x + full * k, m - full, k)); };
      int64_t begin, end;
      while (next(begin, end)) {
      if (c1 - c0 > kRows) {  // several row blocks
        several(a_tiles, c0, c1, m, slices, blocks, w, begin, end, pend, x, k, full,
                packed_blocks || c1 <= full ? nullptr : tail_rows(), c1 < m);
      } else {
        alignas(64) float acc[kRows * kGroup * kCols];
        for (int64_t g = begin; g < end; ++g) {
          const int64_t nb0 = g * kGroup, width = std::min(kGroup, blocks - nb0);
          const uint16_t* b = w + tile_offset(nb0, 0, blocks, slices);
          for (int64_t r0 = c0; r0 < c1; r0 += kRows) {
            const uint16_t* a = r0 < full ? x + r0 * k : tail_rows();
            switch (width) {
              case 4: group_block<4>(a, k, b, slices, acc); break;
              case 3: group_block<3>(a, k, b, slices, acc); break;
              case 2: group_block<2>(a, k, b, slices, acc); break;
              default: group_block<1>(a, k, b, slices, acc); break;
            }
            emit(acc, std::min(kRows, m - r0), width * kCols, out, mode, ldo, r0, nb0 * kCols);
          }
        }
      }
      }
      pend.flush();
      if (pend.stream) _mm_sfence();  // the streamed lines visible before the call returns
    });
  }
  return 0;
}
#endif

}  // namespace

// Whether this build runs the kernel (AMX-BF16 targeted); the OS may still refuse the tiles (-2).
extern "C" int64_t linear_amx_available() { return LINEAR_AMX; }

// The weight's software prefetch (`weight_prefetch`) on (the default) or off (0: to measure it).
extern "C" void linear_amx_set_prefetch(int64_t on) {
#if LINEAR_AMX
  weight_prefetch = on != 0;
#else
  (void)on;
#endif
}

// w [N, K] bfloat16 (row-major) -> packed [N * K] in the kernel's order (see the top). N must be a
// multiple of 16 and K of 32 (the caller checks).
extern "C" void linear_amx_pack(const uint16_t* w, int64_t n, int64_t k, uint16_t* packed) {
  const int64_t blocks = n / kCols, slices = k / kDepth;
  for (int64_t nb = 0; nb < blocks; ++nb)
    for (int64_t kb = 0; kb < slices; ++kb) {
      uint16_t* t = packed + tile_offset(nb, kb, blocks, slices);
      for (int64_t p = 0; p < kRows; ++p)
        for (int64_t c = 0; c < kCols; ++c) {
          const uint16_t* src = w + (nb * kCols + c) * k + kb * kDepth + 2 * p;
          t[p * 2 * kCols + 2 * c] = src[0];
          t[p * 2 * kCols + 2 * c + 1] = src[1];
        }
    }
}

// The inverse, for rows `ids` [count] of the weight: out [count, K] bfloat16 (an embedding lookup
// in a tied head's layout).
extern "C" void linear_amx_rows(const uint16_t* packed, int64_t n, int64_t k, const int64_t* ids, int64_t count,
                                uint16_t* out) {
  const int64_t blocks = n / kCols, slices = k / kDepth;
  for (int64_t i = 0; i < count; ++i) {
    const int64_t row = ids[i], nb = row / kCols, c = row % kCols;
    for (int64_t kb = 0; kb < slices; ++kb) {
      const uint16_t* t = packed + tile_offset(nb, kb, blocks, slices);
      for (int64_t p = 0; p < kRows; ++p) {
        out[i * k + kb * kDepth + 2 * p] = t[p * 2 * kCols + 2 * c];
        out[i * k + kb * kDepth + 2 * p + 1] = t[p * 2 * kCols + 2 * c + 1];
      }
    }
  }
}

// out [M, N] = x [M, K] bfloat16 times the packed weight's transpose: bfloat16 (mode 0) or float32
// (mode 1); mode 2: the weight's 16-column blocks are (gate, up) pairs (a SwiGLU gate/up weight
// packed in that order, N a multiple of 64) and out [M, N / 2] bfloat16 is SiLU(gate) * up; mode 3:
// float32 out [M, N] holding mode 0's bfloat16 values, widened.
// Returns 0; -1 where this build has no AMX (or a mode is unknown); -2 where Linux refused the tile state.
extern "C" int64_t linear_amx_bfloat16(const void* x, int64_t m, int64_t k, const void* packed, int64_t n,
                                       void* out, int64_t mode, int64_t threads) {
#if LINEAR_AMX
  if (mode < kBf16 || mode > kWidened || (mode == kSiluMul && n % (kGroup * kCols))) return -1;
  const uint16_t* const xs = static_cast<const uint16_t*>(x);
  const uint16_t* const w = static_cast<const uint16_t*>(packed);
  const bool by_rows = m >= threads * kSplitRows || (m >= threads * kSplitRows / 2 && n * k * 2 <= kSplitWeightBytes);
  if (threads > 1 && by_rows) {
    // Many rows: each thread one run of row pairs, the whole call on its rows (one thread's path:
    // its own A tiles, no barrier per chunk), so every output value is computed as on one thread.
    const int64_t ldo = mode == kSiluMul ? n / 2 : n, esize = out_bytes(mode);
    int64_t status = 0;
    share_runs((m + 2 * kRows - 1) / (2 * kRows), threads, [&](int64_t begin, int64_t end) {
      const int64_t r0 = begin * 2 * kRows, r1 = std::min(m, end * 2 * kRows);
      const int64_t s = run(xs + r0 * k, r1 - r0, k, w, n, static_cast<char*>(out) + r0 * ldo * esize, mode, 1);
      if (s) {
#pragma omp atomic write
        status = s;
      }
    });
    return status;
  }
  return run(xs, m, k, w, n, out, mode, threads);
#else
  (void)x, (void)m, (void)k, (void)packed, (void)n, (void)out, (void)mode, (void)threads;
  return -1;
#endif
}
