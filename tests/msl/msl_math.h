// msl_math.h: metal:: and metal::fast:: math, numeric_limits, atomics, and the helpers MLX prepends to every
// custom kernel (its metal/kernels/utils.h: float16_t, bfloat16_t, Limits, elem_to_loc, ceildiv), for the MSL
// emulator. Math runs in float and rounds to the argument's type, as Metal's half and bfloat overloads do.
#pragma once

#include "msl_simd.h"

namespace metal {

template <class T> using msl_fp = typename std::enable_if<msl_rt::is_float<T>::value, T>::type;

#define MSL_UNARY(name, f)                                                                \
  template <class T> inline msl_fp<T> name(T x) { return T(f(float(x))); }                \
  template <class T, int N> inline vec<T, N> name(const vec<T, N>& v) {                   \
    vec<T, N> r;                                                                          \
    for (int i = 0; i < N; ++i) r[i] = name(v[i]);                                        \
    return r;                                                                             \
  }
MSL_UNARY(exp, __builtin_expf)
MSL_UNARY(exp2, __builtin_exp2f)
MSL_UNARY(log, __builtin_logf)
MSL_UNARY(log2, __builtin_log2f)
MSL_UNARY(log10, __builtin_log10f)
MSL_UNARY(log1p, __builtin_log1pf)
MSL_UNARY(expm1, __builtin_expm1f)
MSL_UNARY(sqrt, __builtin_sqrtf)
MSL_UNARY(sin, __builtin_sinf)
MSL_UNARY(cos, __builtin_cosf)
MSL_UNARY(tan, __builtin_tanf)
MSL_UNARY(asin, __builtin_asinf)
MSL_UNARY(acos, __builtin_acosf)
MSL_UNARY(atan, __builtin_atanf)
MSL_UNARY(sinh, __builtin_sinhf)
MSL_UNARY(cosh, __builtin_coshf)
MSL_UNARY(tanh, __builtin_tanhf)
MSL_UNARY(floor, __builtin_floorf)
MSL_UNARY(ceil, __builtin_ceilf)
MSL_UNARY(round, __builtin_roundf)
MSL_UNARY(rint, __builtin_rintf)
MSL_UNARY(trunc, __builtin_truncf)
MSL_UNARY(fabs, __builtin_fabsf)
#undef MSL_UNARY

inline float msl_rsqrt(float x) { return 1.0f / __builtin_sqrtf(x); }
inline float msl_exp10(float x) { return __builtin_powf(10.0f, x); }
inline float msl_fract(float x) { return x - __builtin_floorf(x); }
inline float msl_sigmoid(float x) { return 1.0f / (1.0f + __builtin_expf(-x)); }
template <class T> inline msl_fp<T> rsqrt(T x) { return T(msl_rsqrt(float(x))); }
template <class T> inline msl_fp<T> exp10(T x) { return T(msl_exp10(float(x))); }
template <class T> inline msl_fp<T> fract(T x) { return T(msl_fract(float(x))); }
template <class T, int N> inline vec<T, N> rsqrt(const vec<T, N>& v) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r[i] = rsqrt(v[i]);
  return r;
}

template <class T> inline msl_fp<T> pow(T x, T y) { return T(__builtin_powf(float(x), float(y))); }
template <class T> inline msl_fp<T> powr(T x, T y) { return T(__builtin_powf(float(x), float(y))); }
template <class T> inline msl_fp<T> atan2(T y, T x) { return T(__builtin_atan2f(float(y), float(x))); }
template <class T> inline msl_fp<T> fmod(T x, T y) { return T(__builtin_fmodf(float(x), float(y))); }
template <class T> inline msl_fp<T> copysign(T x, T y) { return T(__builtin_copysignf(float(x), float(y))); }
template <class T> inline msl_fp<T> fma(T a, T b, T c) { return T(__builtin_fmaf(float(a), float(b), float(c))); }
template <class T> inline msl_fp<T> fmax(T a, T b) { return T(__builtin_fmaxf(float(a), float(b))); }
template <class T> inline msl_fp<T> fmin(T a, T b) { return T(__builtin_fminf(float(a), float(b))); }
template <class T> inline msl_fp<T> mix(T a, T b, T t) { return T(float(a) + (float(b) - float(a)) * float(t)); }
template <class T> inline bool isnan(T x) { return float(x) != float(x); }
template <class T> inline bool isinf(T x) { return __builtin_isinf(float(x)); }
template <class T> inline bool isfinite(T x) { return __builtin_isfinite(float(x)); }
template <class T> inline bool signbit(T x) { return __builtin_signbit(float(x)); }
template <class T> inline T sign(T x) { return x > T(0) ? T(1) : x < T(0) ? T(-1) : T(0); }
template <class T> inline T step(T edge, T x) { return x < edge ? T(0) : T(1); }

// max/min: both arguments of one type, as Metal's overloads are; floats follow fmax (a NaN loses).
template <class T> inline T max(T a, T b) {
  if (msl_rt::is_float<T>::value) return T(__builtin_fmaxf(float(a), float(b)));
  return a > b ? a : b;
}
template <class T> inline T min(T a, T b) {
  if (msl_rt::is_float<T>::value) return T(__builtin_fminf(float(a), float(b)));
  return a < b ? a : b;
}
template <class T, int N> inline vec<T, N> max(const vec<T, N>& a, const vec<T, N>& b) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r[i] = max(a[i], b[i]);
  return r;
}
template <class T, int N> inline vec<T, N> min(const vec<T, N>& a, const vec<T, N>& b) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r[i] = min(a[i], b[i]);
  return r;
}
template <class T> inline T clamp(T x, T lo, T hi) { return min(max(x, lo), hi); }
template <class T> inline T abs(T x) {
  if (msl_rt::is_float<T>::value) return T(__builtin_fabsf(float(x)));
  return x < T(0) ? T(-x) : x;
}
template <class T> inline T select(T a, T b, bool c) { return c ? b : a; }
template <class T, int N> inline T dot(const vec<T, N>& a, const vec<T, N>& b) {
  T s = T(0);
  for (int i = 0; i < N; ++i) s = T(s + a[i] * b[i]);
  return s;
}
template <class T> inline T ceildiv(T n, T m) { return (n + m - 1) / m; }
template <class T> inline msl_fp<T> divide(T a, T b) { return T(float(a) / float(b)); }

namespace fast {
using metal::cos;
using metal::exp;
using metal::exp2;
using metal::log;
using metal::log2;
using metal::max;
using metal::min;
using metal::pow;
using metal::rsqrt;
using metal::sin;
using metal::sqrt;
using metal::tanh;
using metal::abs;
using metal::fma;
using metal::fmax;
using metal::fmin;
using metal::clamp;
using metal::floor;
using metal::ceil;
using metal::divide;
}  // namespace fast
namespace precise {
using namespace metal::fast;
}

// ---- numeric limits ----
template <class T> struct numeric_limits;
template <> struct numeric_limits<float> {
  static constexpr float max() { return 3.40282347e+38f; }
  static constexpr float min() { return 1.17549435e-38f; }
  static constexpr float lowest() { return -3.40282347e+38f; }
  static constexpr float infinity() { return __builtin_inff(); }
  static constexpr float quiet_NaN() { return __builtin_nanf(""); }
  static constexpr float epsilon() { return 1.1920929e-07f; }
};
template <> struct numeric_limits<half> {
  static constexpr half max() { return half(65504.0f); }
  static constexpr half min() { return half(6.103515625e-05f); }
  static constexpr half lowest() { return half(-65504.0f); }
  static constexpr half infinity() { return half(__builtin_inff()); }
  static constexpr half quiet_NaN() { return half(__builtin_nanf("")); }
  static constexpr half epsilon() { return half(0.0009765625f); }
};
template <> struct numeric_limits<bfloat> {
  static constexpr bfloat from(uint16_t b) { return bfloat(b, bfloat::bits_tag{}); }
  static constexpr bfloat max() { return from(0x7f7f); }
  static constexpr bfloat min() { return from(0x0080); }
  static constexpr bfloat lowest() { return from(0xff7f); }
  static constexpr bfloat infinity() { return from(0x7f80); }
  static constexpr bfloat quiet_NaN() { return from(0x7fc0); }
  static constexpr bfloat epsilon() { return from(0x3c00); }
};
#define MSL_INT_LIMITS(T, lo, hi)                  \
  template <> struct numeric_limits<T> {           \
    static constexpr T max() { return hi; }        \
    static constexpr T min() { return lo; }        \
    static constexpr T lowest() { return lo; }     \
  };
MSL_INT_LIMITS(int, int(-2147483647 - 1), 2147483647)
MSL_INT_LIMITS(uint, 0u, 4294967295u)
MSL_INT_LIMITS(short, short(-32768), short(32767))
MSL_INT_LIMITS(ushort, ushort(0), ushort(65535))
MSL_INT_LIMITS(char, char(-128), char(127))
MSL_INT_LIMITS(signed char, (signed char)(-128), (signed char)(127))
MSL_INT_LIMITS(uchar, uchar(0), uchar(255))
MSL_INT_LIMITS(long, (-9223372036854775807L - 1), 9223372036854775807L)
MSL_INT_LIMITS(ulong, 0ul, 18446744073709551615ul)
#undef MSL_INT_LIMITS

// ---- atomics (a fiber is never preempted inside one call, so plain operations are atomic here) ----
enum memory_order { memory_order_relaxed, memory_order_acquire, memory_order_release, memory_order_acq_rel,
                    memory_order_seq_cst };
template <class T> struct atomic {
  T value;
};
typedef atomic<int> atomic_int;
typedef atomic<uint> atomic_uint;
typedef atomic<float> atomic_float;
typedef atomic<bool> atomic_bool;

template <class T> struct msl_same { typedef T type; };
template <class T> inline T atomic_load_explicit(const atomic<T>* o, memory_order) { return o->value; }
template <class T> inline void atomic_store_explicit(atomic<T>* o, typename msl_same<T>::type v, memory_order) {
  o->value = v;
}
template <class T> inline T atomic_exchange_explicit(atomic<T>* o, typename msl_same<T>::type v, memory_order) {
  T old = o->value;
  o->value = v;
  return old;
}
#define MSL_ATOMIC_RMW(name, expr)                                                                  \
  template <class T> inline T name(atomic<T>* o, typename msl_same<T>::type v, memory_order) {     \
    T old = o->value;                                                                               \
    o->value = (expr);                                                                              \
    return old;                                                                                     \
  }
MSL_ATOMIC_RMW(atomic_fetch_add_explicit, T(old + v))
MSL_ATOMIC_RMW(atomic_fetch_sub_explicit, T(old - v))
MSL_ATOMIC_RMW(atomic_fetch_max_explicit, (v > old ? v : old))
MSL_ATOMIC_RMW(atomic_fetch_min_explicit, (v < old ? v : old))
MSL_ATOMIC_RMW(atomic_fetch_and_explicit, T(old & v))
MSL_ATOMIC_RMW(atomic_fetch_or_explicit, T(old | v))
MSL_ATOMIC_RMW(atomic_fetch_xor_explicit, T(old ^ v))
#undef MSL_ATOMIC_RMW
template <class T>
inline bool atomic_compare_exchange_weak_explicit(atomic<T>* o, T* expected, typename msl_same<T>::type desired,
                                                  memory_order, memory_order) {
  if (memcmp(&o->value, expected, sizeof(T)) == 0) {
    o->value = desired;
    return true;
  }
  *expected = o->value;
  return false;
}

}  // namespace metal

// ---- what MLX's utils.h gives every custom kernel ----
template <typename U> struct WorkPerThread {
  static_assert(sizeof(U) <= 8, "Type too large");
  static constexpr int n = 8 / sizeof(U);
};
template <class U> struct Limits {
  static constexpr U max = metal::numeric_limits<U>::max();
  static constexpr U min = metal::numeric_limits<U>::min();
  static constexpr U finite_max = metal::numeric_limits<U>::max();
  static constexpr U finite_min = metal::numeric_limits<U>::min();
};
#define MSL_FLOAT_LIMITS(T)                                                   \
  template <> struct Limits<T> {                                              \
    static constexpr T max = metal::numeric_limits<T>::infinity();            \
    static constexpr T min = T(-metal::numeric_limits<T>::infinity());        \
    static constexpr T finite_max = metal::numeric_limits<T>::max();          \
    static constexpr T finite_min = T(-metal::numeric_limits<T>::max());      \
  };
MSL_FLOAT_LIMITS(float)
MSL_FLOAT_LIMITS(metal::half)
MSL_FLOAT_LIMITS(metal::bfloat)
#undef MSL_FLOAT_LIMITS
template <> struct Limits<bool> {
  static constexpr bool max = true;
  static constexpr bool min = false;
};

template <typename IdxT = int64_t>
inline IdxT elem_to_loc(IdxT elem, const int* shape, const int64_t* strides, int ndim) {
  IdxT loc = 0;
  for (int i = ndim - 1; i >= 0 && elem > 0; --i) {
    loc += (elem % shape[i]) * IdxT(strides[i]);
    elem /= shape[i];
  }
  return loc;
}
template <typename IdxT = int64_t>
inline IdxT elem_to_loc(metal::uint3 elem, const int* shape, const int64_t* strides, int ndim) {
  IdxT loc = IdxT(elem.x) * IdxT(strides[ndim - 1]) + IdxT(elem.y) * IdxT(strides[ndim - 2]);
  for (int d = ndim - 3; d >= 0; --d) {
    loc += (elem.z % shape[d]) * IdxT(strides[d]);
    elem.z /= shape[d];
  }
  return loc;
}

#define INFINITY (__builtin_inff())
#define NAN (__builtin_nanf(""))
#define MAXFLOAT 3.40282347e+38f
#define FLT_MAX 3.40282347e+38f
#define FLT_MIN 1.17549435e-38f
#define FLT_EPSILON 1.1920929e-07f
#define HALF_MAX 65504.0f
#define M_PI_F 3.14159265358979323846f
#define M_LN2_F 0.69314718055994530942f
#define M_LOG2E_F 1.44269504088896340736f
#define M_SQRT2_F 1.41421356237309504880f
#define METAL_FUNC inline
#define MLX_MTL_PRAGMA_UNROLL
