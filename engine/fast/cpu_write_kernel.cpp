// Storing a step's K/V rows into the paged pools when the rows are already in the pool's dtype:
// each row's bytes copied to its slot, nothing converted. (cpu_paged_kernel.cpp's write_kv_* take
// float32 rows for a bfloat16 pool and round them; a bfloat16 model whose matmuls run in bfloat16
// hands its rows over as bfloat16, and those come here.)
//
// The slot rules are the reference's write_kv: row r goes to slot slots[r]; -1 (a padding row) goes
// to the pool's last slot. Every slot is checked before anything is written: the entry returns the
// number of slots outside [-1, num_slots) and then writes nothing. Rows are shared by torch's
// OpenMP workers (cpu_kernel_share.h) when the caller asks for more than one thread.
#include <cstdint>
#include <cstring>

#include "cpu_kernel_share.h"

// k, v: row r starts at byte r * ldk_bytes (r * ldv_bytes); each row is row_bytes long (Hkv * D
// elements, contiguous); the pools hold num_slots rows of row_bytes each.
extern "C" int64_t write_kv_copy(const void* k, int64_t ldk_bytes, const void* v, int64_t ldv_bytes,
                                 const int64_t* slots, int64_t rows, int64_t row_bytes, void* k_pool, void* v_pool,
                                 int64_t num_slots, int64_t threads) {
  int64_t bad = 0;
  for (int64_t r = 0; r < rows; ++r) bad += slots[r] < -1 || slots[r] >= num_slots;
  if (bad) return bad;
  const char* ks = static_cast<const char*>(k);
  const char* vs = static_cast<const char*>(v);
  char* kd = static_cast<char*>(k_pool);
  char* vd = static_cast<char*>(v_pool);
  share(rows, threads, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t slot = slots[r] < 0 ? num_slots - 1 : slots[r];
      std::memcpy(kd + slot * row_bytes, ks + r * ldk_bytes, row_bytes);
      std::memcpy(vd + slot * row_bytes, vs + r * ldv_bytes, row_bytes);
    }
  });
  return 0;
}
