// msl_simd.h: Metal's SIMD-group functions and simdgroup_matrix, for the MSL emulator.
//
// Every collective is a synchronisation point: the calling lane parks its argument block and yields; the
// scheduler completes the collective once all launched lanes of the SIMD group wait at the same call (a lane that
// never arrives is reported as divergent control flow). Lanes the dispatch did not launch (the tail of a partial
// SIMD group) do not take part; reading their value through a shuffle gives a poison value (NaN, or a sentinel).
// simdgroup_matrix<T, 8, 8> (loads, stores and multiplies are collectives too) keeps Apple's fragment layout,
// the one MLX's steel kernels assume: lane l holds row (l / 4 & 4) + (l / 2 % 4), columns 2 * (l / 4 & 2) +
// 2 * (l % 2) and the next one. A multiply sums each 8-term product in float and rounds once to the element type.
#pragma once

#include "msl_runtime.h"

// The caller's file and line, as the #line directives name them: which call a waiting thread is at.
#define MSL_SITE unsigned line = __builtin_LINE(), const char* file = __builtin_FILE()

namespace msl_rt {

template <class T> inline T poison() {
  T v;
  memset(&v, 0xa5, sizeof(T));
  return v;
}
template <> inline float poison<float>() { return bit_cast<float>(0x7fc0a5a5u); }
template <> inline _Float16 poison<_Float16>() { return bit_cast<_Float16>(uint16_t(0x7ea5)); }
template <> inline metal::bfloat poison<metal::bfloat>() { return bit_cast<metal::bfloat>(uint16_t(0x7fa5)); }

template <class T> struct LaneArg {
  T in;
  T out;
  int param;
};

template <class T, class F> inline void reduce_lanes(void* const* args, F op) {
  // Butterfly order, as the hardware reduces; lanes that were not launched are skipped.
  T vals[kSimdWidth];
  bool have[kSimdWidth];
  for (int l = 0; l < kSimdWidth; ++l) {
    have[l] = args[l] != nullptr;
    if (have[l]) vals[l] = static_cast<LaneArg<T>*>(args[l])->in;
  }
  for (int step = 1; step < kSimdWidth; step *= 2)
    for (int l = 0; l + step < kSimdWidth; l += 2 * step) {
      if (have[l] && have[l + step]) vals[l] = op(vals[l], vals[l + step]);
      else if (have[l + step]) vals[l] = vals[l + step], have[l] = true;
    }
  for (int l = 0; l < kSimdWidth; ++l)
    if (args[l]) static_cast<LaneArg<T>*>(args[l])->out = vals[0];
}

template <class T> void complete_sum(void* const* a) { reduce_lanes<T>(a, [](T x, T y) { return T(x + y); }); }
template <class T> void complete_product(void* const* a) { reduce_lanes<T>(a, [](T x, T y) { return T(x * y); }); }
template <class T> void complete_max(void* const* a) {
  reduce_lanes<T>(a, [](T x, T y) { return (x != x) ? y : (y != y) ? x : (y > x ? y : x); });
}
template <class T> void complete_min(void* const* a) {
  reduce_lanes<T>(a, [](T x, T y) { return (x != x) ? y : (y != y) ? x : (y < x ? y : x); });
}
template <class T> void complete_and(void* const* a) { reduce_lanes<T>(a, [](T x, T y) { return T(x & y); }); }
template <class T> void complete_or(void* const* a) { reduce_lanes<T>(a, [](T x, T y) { return T(x | y); }); }
template <class T> void complete_xor(void* const* a) { reduce_lanes<T>(a, [](T x, T y) { return T(x ^ y); }); }

enum ShuffleKind { SHUFFLE, SHUFFLE_DOWN, SHUFFLE_UP, SHUFFLE_XOR, ROTATE_DOWN, ROTATE_UP };

template <class T, int K> void complete_shuffle(void* const* args) {
  T vals[kSimdWidth];
  for (int l = 0; l < kSimdWidth; ++l)
    if (args[l]) vals[l] = static_cast<LaneArg<T>*>(args[l])->in;
  for (int l = 0; l < kSimdWidth; ++l) {
    if (!args[l]) continue;
    LaneArg<T>* me = static_cast<LaneArg<T>*>(args[l]);
    int p = me->param, src;
    switch (K) {
      case SHUFFLE: src = p; break;
      case SHUFFLE_DOWN: src = l + p < kSimdWidth ? l + p : l; break;  // the upper lanes keep their value
      case SHUFFLE_UP: src = l - p >= 0 ? l - p : l; break;            // the lower lanes keep their value
      case SHUFFLE_XOR: src = l ^ p; break;
      case ROTATE_DOWN: src = (l + p) % kSimdWidth; break;
      default: src = ((l - p) % kSimdWidth + kSimdWidth) % kSimdWidth; break;
    }
    me->out = (src >= 0 && src < kSimdWidth && args[src]) ? vals[src] : poison<T>();
  }
}

template <class T, bool Inclusive, bool Product> void complete_prefix(void* const* args) {
  T acc = T(Product ? 1 : 0);
  for (int l = 0; l < kSimdWidth; ++l) {
    if (!args[l]) continue;
    LaneArg<T>* me = static_cast<LaneArg<T>*>(args[l]);
    T next = Product ? T(acc * me->in) : T(acc + me->in);
    me->out = Inclusive ? next : acc;
    acc = next;
  }
}

inline void complete_first(void* const* args) {
  int first = -1;
  for (int l = 0; l < kSimdWidth; ++l)
    if (args[l]) {
      if (first < 0) first = l;
      static_cast<LaneArg<bool>*>(args[l])->out = (l == first);
    }
}

inline void complete_nothing(void* const*) {}

template <class T, class F>
inline T collective(const char* op, unsigned line, const char* file, F fn, T x, int param = 0) {
  LaneArg<T> a{x, x, param};
  simd_wait(op, line, file, fn, &a);
  return a.out;
}

}  // namespace msl_rt

namespace metal {

enum mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4, mem_threadgroup_imageblock = 8 };
inline mem_flags operator|(mem_flags a, mem_flags b) { return mem_flags(int(a) | int(b)); }

inline void threadgroup_barrier(mem_flags, MSL_SITE) {
  msl_rt::barrier("threadgroup_barrier", line, file);
}
inline void simdgroup_barrier(mem_flags, MSL_SITE) {
  msl_rt::collective<int>("simdgroup_barrier", line, file, msl_rt::complete_nothing, 0);
}

#define MSL_REDUCE(name, fn)                                             \
  template <class T> inline T name(T x, MSL_SITE) {                      \
    return msl_rt::collective<T>(#name, line, file, msl_rt::fn<T>, x);   \
  }
MSL_REDUCE(simd_sum, complete_sum)
MSL_REDUCE(simd_product, complete_product)
MSL_REDUCE(simd_max, complete_max)
MSL_REDUCE(simd_min, complete_min)
MSL_REDUCE(simd_and, complete_and)
MSL_REDUCE(simd_or, complete_or)
MSL_REDUCE(simd_xor, complete_xor)
#undef MSL_REDUCE

#define MSL_SHUFFLE(name, kind)                                                                                  \
  template <class T> inline T name(T x, ushort p, MSL_SITE) {                                                    \
    return msl_rt::collective<T>(#name, line, file, msl_rt::complete_shuffle<T, msl_rt::kind>, x, int(p));       \
  }
MSL_SHUFFLE(simd_shuffle, SHUFFLE)
MSL_SHUFFLE(simd_broadcast, SHUFFLE)
MSL_SHUFFLE(simd_shuffle_down, SHUFFLE_DOWN)
MSL_SHUFFLE(simd_shuffle_up, SHUFFLE_UP)
MSL_SHUFFLE(simd_shuffle_xor, SHUFFLE_XOR)
MSL_SHUFFLE(simd_shuffle_rotate_down, ROTATE_DOWN)
MSL_SHUFFLE(simd_shuffle_rotate_up, ROTATE_UP)
#undef MSL_SHUFFLE

template <class T> inline T simd_broadcast_first(T x, MSL_SITE) {
  // Lane 0 is launched in every SIMD group, so it is the first active lane.
  return msl_rt::collective<T>("simd_broadcast_first", line, file, msl_rt::complete_shuffle<T, msl_rt::SHUFFLE>, x,
                               0);
}

template <class T> inline T simd_prefix_inclusive_sum(T x, MSL_SITE) {
  return msl_rt::collective<T>("simd_prefix_inclusive_sum", line, file, msl_rt::complete_prefix<T, true, false>, x);
}
template <class T> inline T simd_prefix_exclusive_sum(T x, MSL_SITE) {
  return msl_rt::collective<T>("simd_prefix_exclusive_sum", line, file, msl_rt::complete_prefix<T, false, false>,
                               x);
}
template <class T> inline T simd_prefix_inclusive_product(T x, MSL_SITE) {
  return msl_rt::collective<T>("simd_prefix_inclusive_product", line, file, msl_rt::complete_prefix<T, true, true>,
                               x);
}
template <class T> inline T simd_prefix_exclusive_product(T x, MSL_SITE) {
  return msl_rt::collective<T>("simd_prefix_exclusive_product", line, file,
                               msl_rt::complete_prefix<T, false, true>, x);
}

inline bool simd_all(bool x, MSL_SITE) {
  return msl_rt::collective<int>("simd_all", line, file, msl_rt::complete_and<int>, x ? 1 : 0) != 0;
}
inline bool simd_any(bool x, MSL_SITE) {
  return msl_rt::collective<int>("simd_any", line, file, msl_rt::complete_or<int>, x ? 1 : 0) != 0;
}
inline bool simd_is_first(MSL_SITE) {
  return msl_rt::collective<bool>("simd_is_first", line, file, msl_rt::complete_first, false);
}

// ---- simdgroup_matrix ----

template <class T, int Rows, int Cols> struct simdgroup_matrix {
  static_assert(Rows == 8 && Cols == 8, "the emulator supports 8x8 simdgroup matrices");
  vec<T, 2> e;
  simdgroup_matrix() = default;
  // A diagonal matrix with `d` on its diagonal, as Metal's scalar constructor makes.
  explicit simdgroup_matrix(T d) {
    int r, c;
    coord(r, c);
    e[0] = (r == c) ? d : T(0);
    e[1] = (r == c + 1) ? d : T(0);
  }
  vec<T, 2>& thread_elements() { return e; }
  const vec<T, 2>& thread_elements() const { return e; }
  // Row and first column of the two elements the calling lane holds.
  static void coord(int& row, int& col) { lane_coord(int(msl_rt::cur().thread_index_in_simdgroup), row, col); }
  static void lane_coord(int lane, int& row, int& col) {
    int qid = lane / 4;
    row = (qid & 4) + ((lane / 2) % 4);
    col = (qid & 2) * 2 + (lane % 2) * 2;
  }
};

typedef simdgroup_matrix<float, 8, 8> simdgroup_float8x8;
typedef simdgroup_matrix<half, 8, 8> simdgroup_half8x8;
typedef simdgroup_matrix<bfloat, 8, 8> simdgroup_bfloat8x8;

template <class T, int R, int C> inline simdgroup_matrix<T, R, C> make_filled_simdgroup_matrix(T v) {
  simdgroup_matrix<T, R, C> m;
  m.e = vec<T, 2>(v);
  return m;
}

}  // namespace metal

namespace msl_rt {

// One lane's part of a simdgroup_load or simdgroup_store.
template <class T, class P> struct MatrixIo {
  metal::simdgroup_matrix<T, 8, 8>* m;
  P ptr;
  metal::ulong elements_per_row;
  metal::ulong2 origin;
  bool transpose;
};

// Memory offset of element `j` of the two `lane` holds.
template <class IO> inline metal::ulong matrix_offset(const IO& io, int lane, int j) {
  int r, c;
  metal::simdgroup_matrix<float, 8, 8>::lane_coord(lane, r, c);
  metal::ulong row = io.transpose ? metal::ulong(c + j) : metal::ulong(r);
  metal::ulong col = io.transpose ? metal::ulong(r) : metal::ulong(c + j);
  return (io.origin.y + row) * io.elements_per_row + io.origin.x + col;
}

template <class T, class P> void complete_load(void* const* args) {
  for (int l = 0; l < kSimdWidth; ++l) {
    if (!args[l]) continue;
    auto* io = static_cast<MatrixIo<T, P>*>(args[l]);
    for (int j = 0; j < 2; ++j) io->m->e[j] = io->ptr[matrix_offset(*io, l, j)];
  }
}

template <class T, class P> void complete_store(void* const* args) {
  for (int l = 0; l < kSimdWidth; ++l) {
    if (!args[l]) continue;
    auto* io = static_cast<MatrixIo<T, P>*>(args[l]);
    for (int j = 0; j < 2; ++j) io->ptr[matrix_offset(*io, l, j)] = io->m->e[j];
  }
}

}  // namespace msl_rt

namespace metal {

// Loads and stores are SIMD-group operations: every lane takes part, and all of them finish before any lane goes
// on (as the hardware runs them). Sharing the memory with other SIMD groups still needs a threadgroup_barrier.
template <class T, class U>
inline void simdgroup_load(simdgroup_matrix<T, 8, 8>& d, const U* src, ulong elements_per_row = 8,
                           ulong2 matrix_origin = ulong2(0ul), bool transpose_matrix = false,
                           MSL_SITE) {
  static_assert(std::is_same<T, typename std::remove_cv<U>::type>::value, "simdgroup_load: element types differ");
  msl_rt::MatrixIo<T, const U*> io{&d, src, elements_per_row, matrix_origin, transpose_matrix};
  msl_rt::simd_wait("simdgroup_load", line, file, msl_rt::complete_load<T, const U*>, &io);
}

template <class T, class U>
inline void simdgroup_store(const simdgroup_matrix<T, 8, 8>& a, U* dst, ulong elements_per_row = 8,
                            ulong2 matrix_origin = ulong2(0ul), bool transpose_matrix = false,
                            MSL_SITE) {
  static_assert(std::is_same<T, U>::value, "simdgroup_store: element types differ");
  msl_rt::MatrixIo<T, U*> io{const_cast<simdgroup_matrix<T, 8, 8>*>(&a), dst, elements_per_row, matrix_origin,
                             transpose_matrix};
  msl_rt::simd_wait("simdgroup_store", line, file, msl_rt::complete_store<T, U*>, &io);
}

}  // namespace metal

namespace msl_rt {

template <class TD, class TA, class TB, class TC> struct MmaArg {
  metal::simdgroup_matrix<TD, 8, 8>* d;
  const metal::simdgroup_matrix<TA, 8, 8>* a;
  const metal::simdgroup_matrix<TB, 8, 8>* b;
  const metal::simdgroup_matrix<TC, 8, 8>* c;  // nullptr: D = A * B
};

template <class TD, class TA, class TB, class TC> void complete_mma(void* const* args) {
  float A[8][8], B[8][8], C[8][8];
  for (int l = 0; l < kSimdWidth; ++l) {
    if (!args[l]) {
      set_error("%s in a SIMD group with fewer than 32 launched lanes", "simdgroup_matrix operation");
      return;
    }
    auto* m = static_cast<MmaArg<TD, TA, TB, TC>*>(args[l]);
    int r, c;
    metal::simdgroup_matrix<TA, 8, 8>::lane_coord(l, r, c);
    for (int j = 0; j < 2; ++j) {
      A[r][c + j] = float(m->a->e[j]);
      B[r][c + j] = float(m->b->e[j]);
      C[r][c + j] = m->c ? float(m->c->e[j]) : 0.0f;
    }
  }
  for (int l = 0; l < kSimdWidth; ++l) {
    auto* m = static_cast<MmaArg<TD, TA, TB, TC>*>(args[l]);
    int r, c;
    metal::simdgroup_matrix<TD, 8, 8>::lane_coord(l, r, c);
    for (int j = 0; j < 2; ++j) {
      float acc = C[r][c + j];
      for (int k = 0; k < 8; ++k) acc += A[r][k] * B[k][c + j];
      m->d->e[j] = TD(acc);
    }
  }
}

}  // namespace msl_rt

namespace metal {

template <class TD, class TA, class TB, class TC>
inline void simdgroup_multiply_accumulate(simdgroup_matrix<TD, 8, 8>& d, const simdgroup_matrix<TA, 8, 8>& a,
                                          const simdgroup_matrix<TB, 8, 8>& b, const simdgroup_matrix<TC, 8, 8>& c,
                                          MSL_SITE) {
  // Metal's overloads take one element type for all four matrices (MLX converts before its mma, too).
  static_assert(std::is_same<TD, TA>::value && std::is_same<TD, TB>::value && std::is_same<TD, TC>::value,
                "simdgroup_multiply_accumulate: all four matrices must have the same element type");
  msl_rt::MmaArg<TD, TA, TB, TC> arg{&d, &a, &b, &c};
  msl_rt::simd_wait("simdgroup_multiply_accumulate", line, file, msl_rt::complete_mma<TD, TA, TB, TC>, &arg);
}

template <class TD, class TA, class TB>
inline void simdgroup_multiply(simdgroup_matrix<TD, 8, 8>& d, const simdgroup_matrix<TA, 8, 8>& a,
                               const simdgroup_matrix<TB, 8, 8>& b, MSL_SITE) {
  static_assert(std::is_same<TD, TA>::value && std::is_same<TD, TB>::value,
                "simdgroup_multiply: all three matrices must have the same element type");
  msl_rt::MmaArg<TD, TA, TB, TD> arg{&d, &a, &b, nullptr};
  msl_rt::simd_wait("simdgroup_multiply", line, file, msl_rt::complete_mma<TD, TA, TB, TD>, &arg);
}

}  // namespace metal
