// msl_state.h: the MSL emulator's per-launch state, its fibers, and the points where a GPU thread yields.
//
// Each GPU thread of a threadgroup is a fiber with its own stack (a six-register stack switch on x86-64, ucontext
// elsewhere). A thread runs until it reaches a synchronisation point (barrier, simd_wait) or returns; msl_runtime.h
// decides who runs next. One launch at a time per compiled kernel, so the state is plain globals.
#pragma once

#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
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
  const char* wait_file;  // the kernel's "<name>.source" or "<name>.header", as the #line directives name them
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
  int64_t* offsets;  // bytes from a buffer's start to where the kernel's pointer points (negative strides)
  const char** names;
  int64_t stack_bytes;
  int64_t timeout_ms;  // a launch running longer is stopped and reported (an endless loop would hang CI)
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

inline void barrier(const char* op, unsigned line, const char* file) {
  Thread& t = cur();
  t.state = AT_BARRIER;
  t.wait_op = op;
  t.wait_line = line;
  t.wait_file = file;
  yield_to_scheduler();
}

inline void simd_wait(const char* op, unsigned line, const char* file, CompleteFn fn, void* arg) {
  Thread& t = cur();
  t.state = AT_SIMD;
  t.wait_op = op;
  t.wait_line = line;
  t.wait_file = file;
  t.wait_fn = fn;
  t.wait_arg = arg;
  yield_to_scheduler();
}


static void fiber_main() {
  g_body();
  cur().state = DONE;
#if MSL_FAST_SWITCH
  exit_to_scheduler();
#endif
}

// Thread-private memory starts as garbage on a GPU: the top of each fresh stack is filled with all-ones bits (NaN
// for floats), so a private variable read before it is set shows up in the results instead of reading as 0.
constexpr size_t kStackPoison = 4096;

inline void start_fiber(Thread& t) {
  char* top = t.stack + kStackGuard + g_stack_bytes;
  memset(top - kStackPoison, 0xff, kStackPoison);
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

}  // namespace msl_rt
