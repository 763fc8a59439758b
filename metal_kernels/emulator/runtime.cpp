// Emulator runtime library: fiber scheduler, guarded buffers, fault reporting, the launch.
// Compiled once per shim version and linked by every kernel object (see build.py).
#include <setjmp.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>
#include <algorithm>
#include <random>
#include <vector>

#include "shim.h"  // after the system headers: it defines address-space macros

namespace __emu {

struct Region {  // a guarded allocation: [guard][data pages][guard], data placed at one end
  char* base;
  size_t total;
  char* data;
  size_t nbytes;
  const char* name;
  int kind;  // 0 input, 1 output, 2 threadgroup, 3 stack
};

static const size_t PAGE = size_t(sysconf(_SC_PAGESIZE));  // 16 KiB on Apple Silicon
static const size_t STACK = 128 * 1024;
static const size_t POISON = 16 * 1024;  // top of each fiber stack, refilled per threadgroup

ucontext_t sched_ctx;
static sigjmp_buf fault_jmp;
Thread* cur = nullptr;
static std::vector<Thread> threads;
static std::vector<Region> regions;
static std::vector<Region> stacks;
static std::vector<Region> tg_regions;  // by declaration id
static std::vector<int> tg_fresh;       // 1 once poisoned in the current threadgroup
static std::vector<unsigned char> simd_slots;
static char errbuf[1024];
static bool failed = false;
static bool align_end = true;
uint3 grid_dims, group_dims, groups_dims;
static void** buffers = nullptr;
unsigned char* simd_slot_base = nullptr;

static Region make_region(size_t nbytes, const char* name, int kind, bool at_end) {
  size_t data_pages = (nbytes + PAGE - 1) / PAGE;
  if (data_pages == 0) data_pages = 1;
  size_t total = (data_pages + 2) * PAGE;
  char* base = (char*)mmap(nullptr, total, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  mprotect(base + PAGE, data_pages * PAGE, PROT_READ | PROT_WRITE);
  char* data = at_end ? base + PAGE + data_pages * PAGE - nbytes : base + PAGE;
  return Region{base, total, data, nbytes, name, kind};
}

static void free_region(Region& r) {
  if (r.base) munmap(r.base, r.total);
  r.base = nullptr;
}

static void fail(const char* msg) {
  if (!failed) snprintf(errbuf, sizeof(errbuf), "%s", msg);
  failed = true;
}


// Threadgroup memory: one guarded region per declaration, poisoned (0xFF: NaN) when a group first uses it.
void* tg_alloc(int id, size_t nbytes) {
  if ((int)tg_regions.size() <= id) {
    tg_regions.resize(id + 1, Region{nullptr, 0, nullptr, 0, "threadgroup", 2});
    tg_fresh.resize(id + 1, 0);
  }
  Region& r = tg_regions[id];
  if (!r.base) r = make_region(nbytes, "threadgroup memory", 2, align_end);
  if (!tg_fresh[id]) {
    memset(r.data, 0xFF, nbytes);
    tg_fresh[id] = 1;
  }
  return r.data;
}


static Body body = nullptr;

static void fiber_main() {
  body(*cur, buffers);
  cur->state = DONE;
  swapcontext(&cur->ctx, &sched_ctx);
}

static const char* describe(void* addr, long* offset, const char** part) {
  char* a = (char*)addr;
  auto look = [&](std::vector<Region>& rs) -> const char* {
    for (auto& r : rs) {
      if (!r.base || a < r.base || a >= r.base + r.total) continue;
      *offset = long(a - r.data);
      *part = (a >= r.data && a < r.data + r.nbytes) ? "inside" : "outside";
      return r.name;
    }
    return nullptr;
  };
  const char* n = look(regions);
  if (!n) n = look(tg_regions);
  if (!n && look(stacks)) n = "a fiber stack (stack overflow)";
  return n;
}

static void on_fault(int sig, siginfo_t* info, void* uctx) {
  long off = 0;
  const char* part = "?";
  const char* name = describe(info->si_addr, &off, &part);
  bool write = false;
#if defined(__x86_64__)
  write = (((ucontext_t*)uctx)->uc_mcontext.gregs[REG_ERR] & 2) != 0;
#endif
  char who[160];
  if (cur)
    snprintf(who, sizeof(who), "thread_position_in_grid=(%u,%u,%u)", cur->pos_grid.x,
             cur->pos_grid.y, cur->pos_grid.z);
  else
    snprintf(who, sizeof(who), "the scheduler");
  if (sig != SIGSEGV && sig != SIGBUS)
    snprintf(errbuf, sizeof(errbuf), "signal %d (arithmetic fault) in %s", sig, who);
  else if (name && strcmp(part, "inside") == 0)
    snprintf(errbuf, sizeof(errbuf), "write to read-only input '%s' at byte offset %ld by %s", name,
             off, who);
  else if (name)
    snprintf(errbuf, sizeof(errbuf), "out-of-bounds %s of '%s' at byte offset %ld by %s",
             write ? "write" : "read", name, off, who);
  else
    snprintf(errbuf, sizeof(errbuf), "invalid %s at address %p by %s", write ? "write" : "read",
             info->si_addr, who);
  failed = true;
  siglongjmp(fault_jmp, 1);
}

// Release simdgroups whose lanes all wait at one simd op; report lanes that diverged.
static bool release_simd(std::vector<Thread*>& group) {
  bool released = false;
  for (size_t first = 0; first < group.size(); first += 32) {
    size_t last = std::min(group.size(), first + 32);
    int at_simd = 0;
    for (size_t i = first; i < last; i++) at_simd += group[i]->state == AT_SIMD;
    if (!at_simd) continue;
    for (size_t i = first; i < last; i++) {
      Thread* t = group[i];
      if (t->state != AT_SIMD || t->site != group[first]->site) {
        char msg[300];
        snprintf(msg, sizeof(msg), "simd op in divergent code: lanes of simdgroup %ld of threadgroup "
                 "(%u,%u,%u) wait at different points (a simd_* call not reached by every lane, or "
                 "lanes exited early)", long(first / 32), t->tg_pos.x, t->tg_pos.y, t->tg_pos.z);
        fail(msg);
        return false;
      }
    }
    for (size_t i = first; i < last; i++) group[i]->state = RUNNABLE;
    released = true;
  }
  return released;
}

static bool release_barrier(std::vector<Thread*>& group) {
  int done = 0;
  for (auto* t : group) done += t->state == DONE;
  if (done == (int)group.size()) return false;
  for (auto* t : group) {
    if (t->state != AT_BARRIER || t->site != group[0]->site) {
      char msg[300];
      snprintf(msg, sizeof(msg), "threadgroup_barrier in divergent code: not every thread of "
               "threadgroup (%u,%u,%u) reaches the same barrier (early return, or a barrier inside "
               "a branch)", t->tg_pos.x, t->tg_pos.y, t->tg_pos.z);
      fail(msg);
      return false;
    }
  }
  for (auto* t : group) t->state = RUNNABLE;
  return true;
}

static void run_group(uint3 tg, int order, std::mt19937& rng) {
  std::vector<Thread*> group;
  uint3 size;
  size.x = std::min(group_dims.x, grid_dims.x - tg.x * group_dims.x);
  size.y = std::min(group_dims.y, grid_dims.y - tg.y * group_dims.y);
  size.z = std::min(group_dims.z, grid_dims.z - tg.z * group_dims.z);
  uint n = size.x * size.y * size.z;
  for (auto& f : tg_fresh) f = 0;
  for (uint i = 0; i < n; i++) {
    Thread& t = threads[i];
    t.tg_size = size;
    t.tg_pos = tg;
    t.pos_tg = uint3{i % size.x, (i / size.x) % size.y, i / (size.x * size.y)};
    t.pos_grid = uint3{tg.x * group_dims.x + t.pos_tg.x, tg.y * group_dims.y + t.pos_tg.y,
                       tg.z * group_dims.z + t.pos_tg.z};
    t.index_tg = i;
    t.lane = i % 32;
    t.sg = i / 32;
    t.state = RUNNABLE;
    t.simd_gen = 0;
    memset(stacks[i].data + STACK - POISON, align_end ? 0xFF : 0x7F, POISON);  // stale locals
    getcontext(&t.ctx);
    t.ctx.uc_stack.ss_sp = stacks[i].data;
    t.ctx.uc_stack.ss_size = STACK;
    t.ctx.uc_link = nullptr;
    makecontext(&t.ctx, fiber_main, 0);
    group.push_back(&t);
  }
  std::vector<Thread*> run_order = group;
  if (order == 1) std::reverse(run_order.begin(), run_order.end());
  if (order == 2) std::shuffle(run_order.begin(), run_order.end(), rng);
  while (!failed) {
    for (auto* t : run_order) {
      if (t->state != RUNNABLE) continue;
      cur = t;
      swapcontext(&sched_ctx, &t->ctx);
      if (failed) return;
    }
    cur = nullptr;
    if (order == 2) std::shuffle(run_order.begin(), run_order.end(), rng);
    if (release_simd(group)) continue;
    if (failed || !release_barrier(group)) return;
  }
}

// Run the whole grid once. buf_ptrs: host copies in buffer order; kinds: 0 input, 1 output.
int launch(Body b, int nbuf, void** host, const int64_t* nbytes, const int* kinds,
                  const char** names, const unsigned* grid, const unsigned* tgs, int order,
                  unsigned seed, int at_end, char* err, int errlen) {
  body = b;
  failed = false;
  errbuf[0] = 0;
  align_end = at_end != 0;
  grid_dims = uint3{grid[0], grid[1], grid[2]};
  group_dims = uint3{std::min(tgs[0], grid[0]), std::min(tgs[1], grid[1]), std::min(tgs[2], grid[2])};
  groups_dims = uint3{(grid[0] + group_dims.x - 1) / group_dims.x,
                      (grid[1] + group_dims.y - 1) / group_dims.y,
                      (grid[2] + group_dims.z - 1) / group_dims.z};
  uint n = group_dims.x * group_dims.y * group_dims.z;
  regions.clear();
  std::vector<void*> dev(nbuf);
  for (int i = 0; i < nbuf; i++) {
    regions.push_back(make_region(nbytes[i], names[i], kinds[i], align_end));
    memcpy(regions[i].data, host[i], nbytes[i]);
    if (kinds[i] == 0) mprotect(regions[i].base + PAGE, regions[i].total - 2 * PAGE, PROT_READ);
    dev[i] = regions[i].data;
  }
  buffers = dev.data();
  while (stacks.size() < n) {
    stacks.push_back(make_region(STACK, "stack", 3, false));
  }
  threads.assign(n, Thread{});
  simd_slots.assign(size_t((n + 31) / 32) * 2 * 32 * SLOT, 0);
  simd_slot_base = simd_slots.data();
  stack_t alt, old_alt;
  static std::vector<char> altstack(1 << 16);
  alt.ss_sp = altstack.data();
  alt.ss_size = altstack.size();
  alt.ss_flags = 0;
  sigaltstack(&alt, &old_alt);
  struct sigaction sa, old_segv, old_bus, old_fpe;
  memset(&sa, 0, sizeof(sa));
  sa.sa_sigaction = on_fault;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigaction(SIGSEGV, &sa, &old_segv);
  sigaction(SIGBUS, &sa, &old_bus);
  sigaction(SIGFPE, &sa, &old_fpe);
  std::mt19937 rng(seed);
  std::vector<uint3> order_groups;
  for (uint z = 0; z < groups_dims.z; z++)
    for (uint y = 0; y < groups_dims.y; y++)
      for (uint x = 0; x < groups_dims.x; x++) order_groups.push_back(uint3{x, y, z});
  if (order == 1) std::reverse(order_groups.begin(), order_groups.end());
  if (order == 2) std::shuffle(order_groups.begin(), order_groups.end(), rng);
  if (sigsetjmp(fault_jmp, 1) == 0) {
    for (auto& g : order_groups) {
      run_group(g, order, rng);
      if (failed) break;
    }
  }
  sigaction(SIGSEGV, &old_segv, nullptr);
  sigaction(SIGBUS, &old_bus, nullptr);
  sigaction(SIGFPE, &old_fpe, nullptr);
  sigaltstack(&old_alt, nullptr);
  cur = nullptr;
  for (int i = 0; i < nbuf; i++) {
    if (kinds[i] == 1 && !failed) memcpy(host[i], regions[i].data, nbytes[i]);
    free_region(regions[i]);
  }
  regions.clear();
  for (auto& r : tg_regions) free_region(r);
  tg_regions.clear();
  tg_fresh.clear();
  snprintf(err, errlen, "%s", errbuf);
  return failed ? 1 : 0;
}

}  // namespace __emu
