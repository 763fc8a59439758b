// Emulator runtime, the part kernels compile against: GPU threads are ucontext fibers;
// threadgroup_barrier and simd_* park the fiber and yield to the scheduler (runtime.cpp), which
// releases a barrier only when every thread of the group waits at the same call site, and a simd
// op only when every lane of the simdgroup does, else it reports divergence.
#pragma once
#include <stddef.h>
#include <stdint.h>
#include <ucontext.h>

namespace __emu {

enum State { RUNNABLE, AT_BARRIER, AT_SIMD, DONE };

struct Thread {
  ucontext_t ctx;
  State state;
  long site;
  unsigned simd_gen;
  uint3 pos_grid, pos_tg, tg_pos, tg_size;
  uint index_tg, lane, sg;
};

static const int SLOT = 32;  // bytes per lane per simd exchange

// Shared with the runtime library (runtime.cpp), compiled once per shim version.
extern Thread* cur;
extern ucontext_t sched_ctx;
extern unsigned char* simd_slot_base;
extern uint3 grid_dims, group_dims, groups_dims;
void* tg_alloc(int id, size_t nbytes);
typedef void (*Body)(Thread&, void**);
int launch(Body b, int nbuf, void** host, const int64_t* nbytes, const int* kinds,
           const char** names, const unsigned* grid, const unsigned* tgs, int order,
           unsigned seed, int at_end, char* err, int errlen);

inline void yield() { swapcontext(&cur->ctx, &sched_ctx); }

template <class T>
inline T* lane_slots(uint sg, unsigned gen) {
  static_assert(sizeof(T) <= SLOT, "simd value too large");
  return (T*)&simd_slot_base[((size_t(sg) * 2 + (gen & 1)) * 32) * SLOT];
}

template <class T>
inline T& slot(uint sg, unsigned gen, uint lane) {
  return *(T*)&simd_slot_base[((size_t(sg) * 2 + (gen & 1)) * 32 + lane) * SLOT];
}

inline uint lanes_in(uint sg) {
  uint n = cur->tg_size.x * cur->tg_size.y * cur->tg_size.z;
  uint first = sg * 32;
  return std::min<uint>(32, n - first);
}

template <class T>
inline unsigned exchange(T x, long site) {
  Thread* me = cur;
  unsigned gen = me->simd_gen++;
  slot<T>(me->sg, gen, me->lane) = x;
  me->state = AT_SIMD;
  me->site = site;
  yield();
  return gen;
}

}  // namespace __emu

namespace metal {

// Each textual call site gets its own id (the macros at the end pass __COUNTER__), so lanes
// waiting at different simd_* calls or barriers are told apart even after inlining.
#define EMU_NOINLINE

EMU_NOINLINE inline void threadgroup_barrier_at(int flags, long site) {
  (void)flags;
  __emu::cur->state = __emu::AT_BARRIER;
  __emu::cur->site = site;
  __emu::yield();
}

EMU_NOINLINE inline void simdgroup_barrier_at(int flags, long site) {
  (void)flags;
  __emu::exchange<int>(0, site);
}

// Reductions add in a fixed butterfly order so every lane gets the same bits.
template <class T, class Op>
inline T simd_reduce(T x, long site, Op op) {
  unsigned g = __emu::exchange<T>(x, site);
  uint n = __emu::lanes_in(__emu::cur->sg);
  T v[32];
  for (uint i = 0; i < n; i++) v[i] = __emu::slot<T>(__emu::cur->sg, g, i);
  for (uint w = 1; w < n; w *= 2)
    for (uint i = 0; i + w < n; i += 2 * w) v[i] = op(v[i], v[i + w]);
  return v[0];
}

template <class T>
EMU_NOINLINE T simd_sum_at(T x, long site) { return simd_reduce(x, site, [](T a, T b) { return T(a + b); }); }
template <class T>
EMU_NOINLINE T simd_product_at(T x, long site) { return simd_reduce(x, site, [](T a, T b) { return T(a * b); }); }
template <class T>
EMU_NOINLINE T simd_max_at(T x, long site) { return simd_reduce(x, site, [](T a, T b) { return a > b ? a : b; }); }
template <class T>
EMU_NOINLINE T simd_min_at(T x, long site) { return simd_reduce(x, site, [](T a, T b) { return a < b ? a : b; }); }
EMU_NOINLINE inline bool simd_all_at(bool x, long site) { return simd_reduce<int>(x, site, [](int a, int b) { return a & b; }); }
EMU_NOINLINE inline bool simd_any_at(bool x, long site) { return simd_reduce<int>(x, site, [](int a, int b) { return a | b; }); }

template <class T>
inline T simd_read(T x, long site, long src) {
  unsigned g = __emu::exchange<T>(x, site);
  uint n = __emu::lanes_in(__emu::cur->sg);
  if (src < 0 || src >= (long)n) return x;  // inactive source lane: keep own value
  return __emu::slot<T>(__emu::cur->sg, g, uint(src));
}

template <class T>
EMU_NOINLINE T simd_shuffle_at(T x, ushort lane, long site) { return simd_read(x, site, lane); }
template <class T>
EMU_NOINLINE T simd_broadcast_at(T x, ushort lane, long site) { return simd_read(x, site, lane); }
template <class T>
EMU_NOINLINE T simd_broadcast_first_at(T x, long site) { return simd_read(x, site, 0); }
template <class T>
EMU_NOINLINE T simd_shuffle_xor_at(T x, ushort mask, long site) {
  return simd_read(x, site, long(__emu::cur->lane ^ mask));
}
template <class T>
EMU_NOINLINE T simd_shuffle_down_at(T x, ushort delta, long site) {
  return simd_read(x, site, long(__emu::cur->lane) + delta);
}
template <class T>
EMU_NOINLINE T simd_shuffle_up_at(T x, ushort delta, long site) {
  return simd_read(x, site, long(__emu::cur->lane) - delta);
}

template <class T>
inline T simd_prefix(T x, long site, bool inclusive) {
  unsigned g = __emu::exchange<T>(x, site);
  T acc = T(0);
  uint me = __emu::cur->lane;
  for (uint i = 0; i < me; i++) acc = T(acc + __emu::slot<T>(__emu::cur->sg, g, i));
  return inclusive ? T(acc + x) : acc;
}
template <class T>
EMU_NOINLINE T simd_prefix_inclusive_sum_at(T x, long site) { return simd_prefix(x, site, true); }
template <class T>
EMU_NOINLINE T simd_prefix_exclusive_sum_at(T x, long site) { return simd_prefix(x, site, false); }

}  // namespace metal

#define threadgroup_barrier(...) threadgroup_barrier_at(__VA_ARGS__ + 0, __COUNTER__)
#define simdgroup_barrier(...) simdgroup_barrier_at(__VA_ARGS__ + 0, __COUNTER__)
#define simd_sum(x) simd_sum_at(x, __COUNTER__)
#define simd_product(x) simd_product_at(x, __COUNTER__)
#define simd_max(x) simd_max_at(x, __COUNTER__)
#define simd_min(x) simd_min_at(x, __COUNTER__)
#define simd_all(x) simd_all_at(x, __COUNTER__)
#define simd_any(x) simd_any_at(x, __COUNTER__)
#define simd_broadcast_first(x) simd_broadcast_first_at(x, __COUNTER__)
#define simd_prefix_inclusive_sum(x) simd_prefix_inclusive_sum_at(x, __COUNTER__)
#define simd_prefix_exclusive_sum(x) simd_prefix_exclusive_sum_at(x, __COUNTER__)
#define simd_shuffle(x, i) simd_shuffle_at(x, i, __COUNTER__)
#define simd_broadcast(x, i) simd_broadcast_at(x, i, __COUNTER__)
#define simd_shuffle_xor(x, i) simd_shuffle_xor_at(x, i, __COUNTER__)
#define simd_shuffle_down(x, i) simd_shuffle_down_at(x, i, __COUNTER__)
#define simd_shuffle_up(x, i) simd_shuffle_up_at(x, i, __COUNTER__)
