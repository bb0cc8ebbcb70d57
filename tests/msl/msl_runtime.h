// msl_runtime.h: GPU execution semantics on the host, for the MSL emulator.
//
// When no thread of a threadgroup can run, the scheduler completes the collectives whose SIMD group has fully
// arrived, or releases the barrier once every launched thread of the group waits at the same one. Anything else is
// a fault, reported instead of hanging: threads waiting at different barriers, a barrier some threads skipped by
// returning, a collective some lanes of the SIMD group never reach. Threadgroups run one after another, in forward
// or reverse order (SIMD groups and threads inside them too), so two runs in opposite orders expose missing
// barriers and cross-threadgroup races.
#pragma once

#include "msl_memory.h"

namespace msl_rt {

// The same call: operation, file and line.
inline bool same_wait(const Thread& a, const Thread& b) {
  return a.wait_line == b.wait_line && strcmp(a.wait_op, b.wait_op) == 0 && strcmp(a.wait_file, b.wait_file) == 0;
}

// "threads 0-15 wait at simd_sum (k.source:2); threads 16-31 returned" for threads [lo, hi) of the group.
inline void describe_waits(char* out, size_t len, int lo = 0, int hi = -1) {
  if (hi < 0) hi = g_nthreads;
  size_t used = 0;
  out[0] = 0;
  int i = lo;
  while (i < hi && used + 200 < len) {
    const Thread& t = g_threads[i];
    bool waits = t.state == AT_BARRIER || t.state == AT_SIMD;
    int j = i + 1;
    while (j < hi && g_threads[j].state == t.state &&
           (!waits || same_wait(g_threads[j], t)))
      ++j;
    const char* sep = used ? "; " : "";
    if (waits)
      used += snprintf(out + used, len - used, "%sthreads %d-%d wait at %s (%s:%u)", sep, i, j - 1, t.wait_op,
                       t.wait_file, t.wait_line);
    else
      used += snprintf(out + used, len - used, "%sthreads %d-%d %s", sep, i, j - 1,
                       t.state == DONE ? "returned" : "have not run yet");
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
    if (t.state != AT_SIMD || lead.state != AT_SIMD || !same_wait(t, lead) || t.wait_fn != lead.wait_fn ||
        t.collectives != lead.collectives) {
      char states[2048];
      describe_waits(states, sizeof(states), g0, g1);
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
    else if (!same_wait(t, *lead) || t.barriers != lead->barriers)
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
    bufs[i] = b.data + a->offsets[i];
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
  // The watchdog: SIGALRM aimed at this thread only (MLX's own threads must never take it).
  struct sigaction alarm_act = act, old_alarm;
  alarm_act.sa_sigaction = on_timeout;
  sigaction(SIGALRM, &alarm_act, &old_alarm);
  struct sigevent sev;
  memset(&sev, 0, sizeof(sev));
  sev.sigev_notify = SIGEV_THREAD_ID;
  sev.sigev_signo = SIGALRM;
  sev._sigev_un._tid = (pid_t)syscall(SYS_gettid);
  timer_t timer;
  bool timer_on = a->timeout_ms > 0 && timer_create(CLOCK_MONOTONIC, &sev, &timer) == 0;
  if (timer_on) {
    struct itimerspec spec;
    memset(&spec, 0, sizeof(spec));
    spec.it_value.tv_sec = a->timeout_ms / 1000;
    spec.it_value.tv_nsec = (a->timeout_ms % 1000) * 1000000;
    timer_settime(timer, 0, &spec, nullptr);
  }

  int jumped = sigsetjmp(g_jmp, 1);
  if (jumped == 0) {
    int64_t n[3];
    for (int d = 0; d < 3; ++d) n[d] = (a->grid[d] + a->group[d] - 1) / a->group[d];
    int64_t total = n[0] * n[1] * n[2];
    for (int64_t k = 0; k < total && !g_failed; ++k) {
      int64_t g = a->reverse ? total - 1 - k : k;
      uint3 tg = uint3(uint(g % n[0]), uint((g / n[0]) % n[1]), uint(g / (n[0] * n[1])));
      setup_group(a->grid, a->group, tg);
      if (!run_group(a->reverse != 0)) break;
    }
  } else if (jumped == 1) {
    describe_fault();
  } else {
    char who[128] = "no thread";
    if (g_fault_thread >= 0) describe_thread(who, sizeof(who), g_fault_thread);
    set_error("the launch ran for more than %lld ms, stopped in %s: an endless loop?", (long long)a->timeout_ms,
              who);
  }
  if (timer_on) timer_delete(timer);
  sigaction(SIGALRM, &old_alarm, nullptr);
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
