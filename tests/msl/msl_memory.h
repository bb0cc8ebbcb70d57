// msl_memory.h: device buffers, threadgroup storage and fault reports for the MSL emulator.
//
// Device buffers are copies placed against PROT_NONE guard pages (inputs read-only), threadgroup arrays get pages
// of their own, and fiber stacks sit above a guard region: an out-of-range access raises SIGSEGV, which is caught
// and reported with the buffer and the thread.
#pragma once

#include "msl_state.h"

namespace msl_rt {

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

static void on_timeout(int, siginfo_t*, void*) {
  g_fault_thread = g_current;
  siglongjmp(g_jmp, 2);
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

}  // namespace msl_rt
