// msl_runtime.h: GPU execution semantics on the host, for the MSL emulator.
//
// Each GPU thread of a threadgroup is a fiber with its own stack (a six-register stack switch on x86-64, ucontext
// elsewhere). A thread runs until it reaches a
// synchronisation point (threadgroup_barrier, a SIMD collective) or returns; when no thread can run, the scheduler
// completes the collectives whose SIMD group has fully arrived, or releases the barrier once every launched thread
// of the group waits at the same one. Anything else is a fault, reported instead of hanging: threads waiting at
// different barriers, a barrier some threads skipped by returning, a collective some lanes of the SIMD group never
// reach. Threadgroups run one after another, in forward or reverse order (threads inside them too), so two runs
// in opposite orders expose missing barriers and cross-threadgroup races.
//
// Device buffers are copies placed against PROT_NONE guard pages (inputs read-only), threadgroup arrays get pages
// of their own, and fiber stacks have a guard page: an out-of-range access raises SIGSEGV, which is caught and
// reported with the buffer and the thread.
#pragma once

#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include "msl_types.h"

// x86-64: switching fibers saves the callee-saved registers on the old stack and pops them from the new one, with
// no system call (ucontext's swapcontext also saves the signal mask, which costs one per switch).
#if defined(__x86_64__) && !defined(MSL_UCONTEXT)
#define MSL_FAST_SWITCH 1
extern "C" __attribute__((visibility("hidden"))) void msl_switch(void** save_sp, void* new_sp);
asm(R"(
  .text
  .p2align 4
  .hidden msl_switch
  .globl msl_switch
  .type msl_switch,@function
msl_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size msl_switch,.-msl_switch
)");
#else
#define MSL_FAST_SWITCH 0
#endif

namespace msl_rt {

using metal::uint;
using metal::uint3;

constexpr int kSimdWidth = 32;
constexpr int kMaxThreads = 1024;             // Metal's maxTotalThreadsPerThreadgroup on Apple GPUs
constexpr size_t kMaxThreadgroupBytes = 32768;  // Metal's threadgroup memory limit
// Below each fiber stack: unbacked, inaccessible address space, so a frame that outgrows its stack faults here
// instead of landing in a neighbour's stack.
constexpr size_t kStackGuard = size_t(4) << 20;

enum State : uint8_t { RUNNABLE, AT_BARRIER, AT_SIMD, DONE };

// Called once every lane of a SIMD group waits at the same collective: args[lane] is each lane's own argument
// block (nullptr for a lane the dispatch did not launch).
typedef void (*CompleteFn)(void* const* args);

struct Thread {
#if MSL_FAST_SWITCH
  void* sp;
#else
  ucontext_t ctx;
#endif
  char* stack;
  State state;
  const char* wait_op;
  unsigned wait_line;
  CompleteFn wait_fn;
  void* wait_arg;
  // Barriers and collectives passed, to tell iterations of one call site apart (SIMD groups may run different
  // numbers of collectives between two barriers, so the counts are kept apart).
  uint64_t barriers, collectives;
  // Attributes, named as MLX names the kernel parameters.
  uint3 thread_position_in_grid, thread_position_in_threadgroup, threadgroup_position_in_grid;
  uint3 threads_per_threadgroup, dispatch_threads_per_threadgroup, threads_per_grid, grid_size, grid_origin,
      threadgroups_per_grid;
  uint thread_index_in_threadgroup, thread_index_in_simdgroup, simdgroup_index_in_threadgroup;
  uint simdgroups_per_threadgroup, dispatch_simdgroups_per_threadgroup, threads_per_simdgroup,
      thread_execution_width;
  uint quadgroup_index_in_threadgroup, thread_index_in_quadgroup, quadgroups_per_threadgroup,
      dispatch_quadgroups_per_threadgroup;
};

// The launch as the Python side passes it (mirrored with ctypes in emulator.py).
struct LaunchArgs {
  int64_t grid[3];
  int64_t group[3];
  int32_t reverse;
  int32_t nbufs;
  void** host;
  int64_t* nbytes;
  int32_t* writable;
  const char** names;
  int64_t stack_bytes;
  char* err;
  int64_t err_len;
};

struct Buffer {
  char* map;
  size_t map_len;
  char* data;
  size_t nbytes;
  const char* name;
  bool writable;
};

struct TgSite {
  int site;
  size_t bytes;
  char* map;
  size_t map_len;
  char* data;
  int64_t epoch;
};

// One launch at a time per compiled kernel: the state is plain globals.
static Thread g_threads[kMaxThreads];
static int g_nthreads;
static int g_current = -1;
#if MSL_FAST_SWITCH
static void* g_sched_sp;
#else
static ucontext_t g_sched;
#endif
static void (*g_body)();
static void** g_bufs;
static Buffer g_buffers[64];
static int g_nbuffers;
static TgSite g_sites[64];
static int g_nsites;
static int64_t g_epoch;
static size_t g_page;
static size_t g_stack_bytes;
static char g_err[4096];
static bool g_failed;
static sigjmp_buf g_jmp;
static volatile void* g_fault_addr;
static volatile int g_fault_write;
static volatile int g_fault_thread;

inline Thread& cur() { return g_threads[g_current]; }

inline void describe_thread(char* out, size_t len, int idx) {
  const Thread& t = g_threads[idx];
  snprintf(out, len, "thread (%u,%u,%u) of threadgroup (%u,%u,%u)", t.thread_position_in_threadgroup.x,
           t.thread_position_in_threadgroup.y, t.thread_position_in_threadgroup.z, t.threadgroup_position_in_grid.x,
           t.threadgroup_position_in_grid.y, t.threadgroup_position_in_grid.z);
}

inline void set_error(const char* fmt, ...) {
  if (g_failed) return;
  g_failed = true;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(g_err, sizeof(g_err), fmt, ap);
  va_end(ap);
}

[[noreturn]] inline void exit_to_scheduler() {
#if MSL_FAST_SWITCH
  void* dead;
  msl_switch(&dead, g_sched_sp);
#else
  setcontext(&g_sched);
#endif
  __builtin_unreachable();
}

// A fault found by a running thread: record it and never resume that thread.
[[noreturn]] inline void fail(const char* fmt, ...) {
  if (!g_failed) {
    char who[128];
    describe_thread(who, sizeof(who), g_current);
    char what[3000];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof(what), fmt, ap);
    va_end(ap);
    set_error("%s (%s)", what, who);
  }
  exit_to_scheduler();
}

inline void yield_to_scheduler() {
#if MSL_FAST_SWITCH
  msl_switch(&cur().sp, g_sched_sp);
#else
  swapcontext(&cur().ctx, &g_sched);
#endif
}

// ---- synchronisation points ----

inline void barrier(const char* op, unsigned line) {
  Thread& t = cur();
  t.state = AT_BARRIER;
  t.wait_op = op;
  t.wait_line = line;
  yield_to_scheduler();
}

inline void simd_wait(const char* op, unsigned line, CompleteFn fn, void* arg) {
  Thread& t = cur();
  t.state = AT_SIMD;
  t.wait_op = op;
  t.wait_line = line;
  t.wait_fn = fn;
  t.wait_arg = arg;
  yield_to_scheduler();
}

// ---- memory ----

inline char* guarded_map(size_t nbytes, size_t* map_len, char** data) {
  size_t rounded = (nbytes + 15) & ~size_t(15);
  size_t pages = (rounded + g_page - 1) / g_page;
  *map_len = (pages + 2) * g_page;
  char* m = (char*)mmap(nullptr, *map_len, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (m == MAP_FAILED) return nullptr;
  if (pages) mprotect(m + g_page, pages * g_page, PROT_READ | PROT_WRITE);
  *data = m + g_page + pages * g_page - rounded;  // the end of the data touches the upper guard page
  return m;
}

// Storage of one `threadgroup` declaration: shared by the threads of a group, poisoned (all bits set: NaN for
// floats) when a new group starts, on pages of its own so an overrun faults.
template <class T> inline T* tg_alloc(int site) {
  for (int i = 0; i < g_nsites; ++i) {
    TgSite& s = g_sites[i];
    if (s.site != site) continue;
    if (s.epoch != g_epoch) {
      memset(s.data, 0xff, s.bytes);
      s.epoch = g_epoch;
    }
    return reinterpret_cast<T*>(s.data);
  }
  size_t total = sizeof(T);
  for (int i = 0; i < g_nsites; ++i) total += g_sites[i].bytes;
  if (total > kMaxThreadgroupBytes)
    fail("threadgroup memory of %zu bytes exceeds Metal's limit of %zu", total, kMaxThreadgroupBytes);
  if (g_nsites == 64) fail("more than 64 threadgroup declarations");
  TgSite& s = g_sites[g_nsites++];
  s.site = site;
  s.bytes = sizeof(T);
  s.map = guarded_map(sizeof(T), &s.map_len, &s.data);
  memset(s.data, 0xff, s.bytes);
  s.epoch = g_epoch;
  return reinterpret_cast<T*>(s.data);
}

// ---- fault handling ----

static void on_fault(int, siginfo_t* info, void* uctx) {
  g_fault_addr = info->si_addr;
  g_fault_thread = g_current;
#if defined(__x86_64__)
  g_fault_write = (((ucontext_t*)uctx)->uc_mcontext.gregs[REG_ERR] & 2) ? 1 : 0;
#else
  (void)uctx;
  g_fault_write = -1;
#endif
  siglongjmp(g_jmp, 1);
}

inline void describe_fault() {
  char* a = (char*)g_fault_addr;
  const char* access = g_fault_write == 1 ? "write" : g_fault_write == 0 ? "read" : "access";
  char what[1024];
  snprintf(what, sizeof(what), "invalid memory %s at %p", access, (void*)a);
  for (int i = 0; i < g_nbuffers; ++i) {
    const Buffer& b = g_buffers[i];
    if (a < b.map || a >= b.map + b.map_len) continue;
    if (a >= b.data + b.nbytes || a < b.data)
      snprintf(what, sizeof(what), "out-of-range %s at byte %lld of '%s' (%zu bytes long)", access,
               (long long)(a - b.data), b.name, b.nbytes);
    else
      snprintf(what, sizeof(what), "%s to input '%s', which is read-only", access, b.name);
  }
  for (int i = 0; i < g_nsites; ++i) {
    const TgSite& s = g_sites[i];
    if (a >= s.map && a < s.map + s.map_len)
      snprintf(what, sizeof(what), "out-of-range %s of a threadgroup array (%zu bytes)", access, s.bytes);
  }
  for (int i = 0; i < g_nthreads; ++i) {
    char* st = g_threads[i].stack;
    if (st && a >= st && a < st + kStackGuard)
      snprintf(what, sizeof(what), "stack overflow (recursion, or private arrays over %zu bytes)", g_stack_bytes);
  }
  if (g_fault_thread >= 0 && g_fault_thread < g_nthreads) {
    char who[128];
    describe_thread(who, sizeof(who), g_fault_thread);
    set_error("%s (%s)", what, who);
  } else {
    set_error("%s", what);
  }
}

// ---- scheduling ----

static void fiber_main() {
  g_body();
  cur().state = DONE;
#if MSL_FAST_SWITCH
  exit_to_scheduler();
#endif
}

inline void start_fiber(Thread& t) {
#if MSL_FAST_SWITCH
  void** sp = (void**)(t.stack + kStackGuard + g_stack_bytes);  // 16-byte aligned top
  *--sp = nullptr;                                          // fiber_main's return address: it never returns
  *--sp = (void*)&fiber_main;                               // where msl_switch's `ret` lands
  for (int r = 0; r < 6; ++r) *--sp = nullptr;              // rbp, rbx, r12-r15
  t.sp = sp;
#else
  getcontext(&t.ctx);
  t.ctx.uc_stack.ss_sp = t.stack + kStackGuard;
  t.ctx.uc_stack.ss_size = g_stack_bytes;
  t.ctx.uc_link = &g_sched;
  makecontext(&t.ctx, fiber_main, 0);
#endif
}

inline void switch_to(Thread& t) {
#if MSL_FAST_SWITCH
  msl_switch(&g_sched_sp, t.sp);
#else
  swapcontext(&g_sched, &t.ctx);
#endif
}

inline void describe_waits(char* out, size_t len) {
  size_t used = 0;
  int i = 0;
  while (i < g_nthreads && used + 200 < len) {
    const Thread& t = g_threads[i];
    int j = i + 1;
    while (j < g_nthreads && g_threads[j].state == t.state &&
           (t.state == DONE || (g_threads[j].wait_line == t.wait_line && g_threads[j].wait_op == t.wait_op)))
      ++j;
    if (t.state == DONE)
      used += snprintf(out + used, len - used, "%sthreads %d-%d returned", used ? "; " : "", i, j - 1);
    else
      used += snprintf(out + used, len - used, "%sthreads %d-%d wait at %s (line %u)", used ? "; " : "", i, j - 1,
                       t.wait_op, t.wait_line);
    i = j;
  }
}

// Completes the collective the SIMD group starting at thread g0 waits at, once all its launched lanes wait at the
// same one. A group whose lanes are all blocked but not at one collective can never get there: divergence.
inline bool complete_collective(int g0) {
  int g1 = g0 + kSimdWidth < g_nthreads ? g0 + kSimdWidth : g_nthreads;
  const Thread& lead = g_threads[g0];
  int waiting = 0;
  for (int i = g0; i < g1; ++i) waiting += g_threads[i].state == AT_SIMD;
  if (!waiting) return false;
  for (int i = g0; i < g1; ++i) {
    const Thread& t = g_threads[i];
    if (t.state != AT_SIMD || t.wait_line != lead.wait_line || t.wait_op != lead.wait_op ||
        t.wait_fn != lead.wait_fn || t.collectives != lead.collectives || lead.state != AT_SIMD) {
      char states[2048];
      describe_waits(states, sizeof(states));
      set_error(
          "SIMD collective under divergent control flow in SIMD group %d of threadgroup (%u,%u,%u): not every "
          "lane reaches the same collective [%s]",
          g0 / kSimdWidth, lead.threadgroup_position_in_grid.x, lead.threadgroup_position_in_grid.y,
          lead.threadgroup_position_in_grid.z, states);
      return false;
    }
  }
  void* args[kSimdWidth] = {nullptr};
  for (int i = g0; i < g1; ++i) args[i - g0] = g_threads[i].wait_arg;
  lead.wait_fn(args);
  for (int i = g0; i < g1; ++i) {
    g_threads[i].state = RUNNABLE;
    g_threads[i].collectives++;
  }
  return true;
}

inline bool release_barrier() {
  const Thread* lead = nullptr;
  bool mismatch = false, returned = false;
  for (int i = 0; i < g_nthreads; ++i) {
    const Thread& t = g_threads[i];
    if (t.state == DONE) {
      returned = true;
      continue;
    }
    if (t.state != AT_BARRIER) return false;
    if (!lead) lead = &t;
    else if (t.wait_line != lead->wait_line || t.wait_op != lead->wait_op || t.barriers != lead->barriers)
      mismatch = true;
  }
  if (!lead) return false;
  if (mismatch || returned) {
    char states[2048];
    describe_waits(states, sizeof(states));
    set_error("deadlock in threadgroup (%u,%u,%u): %s [%s]", lead->threadgroup_position_in_grid.x,
              lead->threadgroup_position_in_grid.y, lead->threadgroup_position_in_grid.z,
              returned ? "a barrier not reached by every thread of the group"
                       : "threads wait at different barriers",
              states);
    return false;
  }
  for (int i = 0; i < g_nthreads; ++i) {
    g_threads[i].state = RUNNABLE;
    g_threads[i].barriers++;
  }
  return true;
}

inline bool run_group(bool reverse) {
  ++g_epoch;
  for (int i = 0; i < g_nthreads; ++i) {
    Thread& t = g_threads[i];
    if (!t.stack) {
      t.stack = (char*)mmap(nullptr, kStackGuard + g_stack_bytes, PROT_READ | PROT_WRITE,
                            MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
      if (t.stack == MAP_FAILED) {
        t.stack = nullptr;
        set_error("cannot map a fiber stack");
        return false;
      }
      mprotect(t.stack, kStackGuard, PROT_NONE);  // stacks grow down into this guard
    }
    start_fiber(t);
    t.state = RUNNABLE;
    t.barriers = t.collectives = 0;
  }
  // Each SIMD group runs as far as it can (through its collectives) before the next one starts, as independent
  // SIMD groups may on a GPU: only a threadgroup_barrier orders memory between them.
  int ngroups = (g_nthreads + kSimdWidth - 1) / kSimdWidth;
  for (;;) {
    bool all_done = true;
    for (int gk = 0; gk < ngroups; ++gk) {
      int g0 = (reverse ? ngroups - 1 - gk : gk) * kSimdWidth;
      int n = g0 + kSimdWidth < g_nthreads ? kSimdWidth : g_nthreads - g0;
      do {
        for (int k = 0; k < n; ++k) {
          int i = g0 + (reverse ? n - 1 - k : k);
          if (g_threads[i].state != RUNNABLE) continue;
          g_current = i;
          switch_to(g_threads[i]);
          g_current = -1;
          if (g_failed) return false;
        }
      } while (complete_collective(g0));
      if (g_failed) return false;
      for (int k = 0; k < n; ++k) all_done &= g_threads[g0 + k].state == DONE;
    }
    if (all_done) return true;
    if (release_barrier()) continue;
    if (!g_failed) {
      char states[2048];
      describe_waits(states, sizeof(states));
      set_error("deadlock: [%s]", states);
    }
    return false;
  }
}

// Sets the attributes of every launched thread of threadgroup `tg` (edge groups hold only the threads inside the
// grid, as Metal's dispatchThreads does).
inline void setup_group(const int64_t* grid, const int64_t* group, const uint3& tg) {
  uint3 full = uint3(uint(group[0]), uint(group[1]), uint(group[2]));
  uint3 size;
  for (int d = 0; d < 3; ++d) {
    int64_t start = int64_t(tg[d]) * group[d];
    int64_t left = grid[d] - start;
    size[d] = uint(left < group[d] ? left : group[d]);
  }
  uint3 ngroups;
  for (int d = 0; d < 3; ++d) ngroups[d] = uint((grid[d] + group[d] - 1) / group[d]);
  g_nthreads = int(size.x * size.y * size.z);
  uint full_n = full.x * full.y * full.z;
  for (int i = 0; i < g_nthreads; ++i) {
    Thread& t = g_threads[i];
    uint3 p = uint3(uint(i % size.x), uint((i / size.x) % size.y), uint(i / (size.x * size.y)));
    t.thread_position_in_threadgroup = p;
    t.threadgroup_position_in_grid = tg;
    t.thread_position_in_grid = uint3(tg.x * full.x + p.x, tg.y * full.y + p.y, tg.z * full.z + p.z);
    t.threads_per_threadgroup = size;
    t.dispatch_threads_per_threadgroup = full;
    t.threads_per_grid = uint3(uint(grid[0]), uint(grid[1]), uint(grid[2]));
    t.grid_size = t.threads_per_grid;
    t.grid_origin = uint3(0u, 0u, 0u);
    t.threadgroups_per_grid = ngroups;
    t.thread_index_in_threadgroup = uint(i);
    t.thread_index_in_simdgroup = uint(i % kSimdWidth);
    t.simdgroup_index_in_threadgroup = uint(i / kSimdWidth);
    t.simdgroups_per_threadgroup = uint((g_nthreads + kSimdWidth - 1) / kSimdWidth);
    t.dispatch_simdgroups_per_threadgroup = (full_n + kSimdWidth - 1) / kSimdWidth;
    t.threads_per_simdgroup = kSimdWidth;
    t.thread_execution_width = kSimdWidth;
    t.quadgroup_index_in_threadgroup = uint(i / 4);
    t.thread_index_in_quadgroup = uint(i % 4);
    t.quadgroups_per_threadgroup = uint((g_nthreads + 3) / 4);
    t.dispatch_quadgroups_per_threadgroup = (full_n + 3) / 4;
  }
}

// Everything a launch mapped goes back, stacks included: each loaded kernel has its own globals, and mappings
// kept per kernel would add up against the process's limit on memory maps.
inline void release_memory() {
  for (int i = 0; i < g_nbuffers; ++i) munmap(g_buffers[i].map, g_buffers[i].map_len);
  g_nbuffers = 0;
  for (int i = 0; i < g_nsites; ++i) munmap(g_sites[i].map, g_sites[i].map_len);
  g_nsites = 0;
  for (int i = 0; i < kMaxThreads; ++i)
    if (g_threads[i].stack) {
      munmap(g_threads[i].stack, kStackGuard + g_stack_bytes);
      g_threads[i].stack = nullptr;
    }
}

// Runs the whole grid; 0 on success, 1 with a message in a->err on a fault.
inline int launch(const LaunchArgs* a, void (*body)()) {
  g_page = (size_t)sysconf(_SC_PAGESIZE);
  g_failed = false;
  g_err[0] = 0;
  g_body = body;
  g_nthreads = 0;
  g_fault_thread = -1;
  int64_t per_group = a->group[0] * a->group[1] * a->group[2];
  if (per_group > kMaxThreads || per_group < 1) {
    snprintf(a->err, a->err_len, "threadgroup of %lld threads: Metal allows 1 to %d", (long long)per_group,
             kMaxThreads);
    return 1;
  }
  g_stack_bytes = (size_t)a->stack_bytes;
  static void* bufs[64];
  g_nbuffers = 0;
  for (int i = 0; i < a->nbufs; ++i) {
    Buffer& b = g_buffers[g_nbuffers++];
    b.nbytes = (size_t)a->nbytes[i];
    b.name = a->names[i];
    b.writable = a->writable[i] != 0;
    b.map = guarded_map(b.nbytes, &b.map_len, &b.data);
    if (!b.map) {
      release_memory();
      snprintf(a->err, a->err_len, "cannot map buffer '%s'", b.name);
      return 1;
    }
    memcpy(b.data, a->host[i], b.nbytes);
    if (!b.writable && b.nbytes) mprotect(b.map + g_page, b.map_len - 2 * g_page, PROT_READ);
    bufs[i] = b.data;
  }
  g_bufs = bufs;

  struct sigaction act, old_segv, old_bus;
  memset(&act, 0, sizeof(act));
  act.sa_sigaction = on_fault;
  act.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigemptyset(&act.sa_mask);
  static char alt_stack[1 << 16];
  stack_t alt, old_alt;
  alt.ss_sp = alt_stack;
  alt.ss_size = sizeof(alt_stack);
  alt.ss_flags = 0;
  sigaltstack(&alt, &old_alt);
  sigaction(SIGSEGV, &act, &old_segv);
  sigaction(SIGBUS, &act, &old_bus);

  if (sigsetjmp(g_jmp, 1) == 0) {
    int64_t n[3];
    for (int d = 0; d < 3; ++d) n[d] = (a->grid[d] + a->group[d] - 1) / a->group[d];
    int64_t total = n[0] * n[1] * n[2];
    for (int64_t k = 0; k < total && !g_failed; ++k) {
      int64_t g = a->reverse ? total - 1 - k : k;
      uint3 tg = uint3(uint(g % n[0]), uint((g / n[0]) % n[1]), uint(g / (n[0] * n[1])));
      setup_group(a->grid, a->group, tg);
      if (!run_group(a->reverse != 0)) break;
    }
  } else {
    describe_fault();
  }
  g_current = -1;
  sigaction(SIGSEGV, &old_segv, nullptr);
  sigaction(SIGBUS, &old_bus, nullptr);
  sigaltstack(&old_alt, nullptr);

  if (!g_failed)
    for (int i = 0; i < a->nbufs; ++i)
      if (g_buffers[i].writable) memcpy(a->host[i], g_buffers[i].data, g_buffers[i].nbytes);
  release_memory();
  if (g_failed) {
    snprintf(a->err, a->err_len, "%s", g_err);
    return 1;
  }
  return 0;
}

}  // namespace msl_rt
