// msl_types.h: Metal's scalar and vector types on the host, for the MSL emulator.
//
// half is _Float16 (every operation rounds to half, as on the GPU); bfloat is a 16-bit struct that converts from
// float with round-to-nearest-even and computes through float; vectors are small structs with x/y/z/w fields and
// Metal's sizes (a 3-vector occupies 4 slots, as float3 does in Metal).
#pragma once

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <type_traits>

namespace metal {

typedef _Float16 half;
typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;
typedef unsigned long ulong;

struct bfloat;

}  // namespace metal

namespace msl_rt {

// Metal's scalar types, the only ones vector and math templates accept.
template <class T> struct is_scalar : std::false_type {};
#define MSL_SCALAR(T) template <> struct is_scalar<T> : std::true_type {};
MSL_SCALAR(bool)
MSL_SCALAR(char)
MSL_SCALAR(signed char)
MSL_SCALAR(unsigned char)
MSL_SCALAR(short)
MSL_SCALAR(unsigned short)
MSL_SCALAR(int)
MSL_SCALAR(unsigned int)
MSL_SCALAR(long)
MSL_SCALAR(unsigned long)
MSL_SCALAR(long long)
MSL_SCALAR(unsigned long long)
MSL_SCALAR(float)
MSL_SCALAR(_Float16)
MSL_SCALAR(metal::bfloat)
MSL_SCALAR(double)  // only so float literals mix with vectors; the lint rejects `double` in kernel text
#undef MSL_SCALAR

template <class T> struct is_float : std::false_type {};
template <> struct is_float<float> : std::true_type {};
template <> struct is_float<_Float16> : std::true_type {};
template <> struct is_float<metal::bfloat> : std::true_type {};

template <class To, class From> constexpr To bit_cast(const From& x) {
  static_assert(sizeof(To) == sizeof(From), "as_type needs types of the same size");
  return __builtin_bit_cast(To, x);
}

// float -> bfloat bits with round-to-nearest-even; NaN stays a (quiet) NaN.
constexpr uint16_t float_to_bfloat_bits(float f) {
  uint32_t u = bit_cast<uint32_t>(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

constexpr float bfloat_bits_to_float(uint16_t b) { return bit_cast<float>(uint32_t(b) << 16); }

}  // namespace msl_rt

namespace metal {

struct bfloat {
  struct bits_tag {};
  uint16_t bits;
  bfloat() = default;
  constexpr bfloat(uint16_t b, bits_tag) : bits(b) {}
  constexpr bfloat(float f) : bits(msl_rt::float_to_bfloat_bits(f)) {}
  template <class S, class = typename std::enable_if<msl_rt::is_scalar<S>::value &&
                                                     !std::is_same<S, bfloat>::value>::type>
  constexpr bfloat(S s) : bfloat(float(s)) {}
  constexpr operator float() const { return msl_rt::bfloat_bits_to_float(bits); }
  constexpr bfloat operator-() const { return bfloat(uint16_t(bits ^ 0x8000u), bits_tag{}); }
  constexpr bfloat operator+() const { return *this; }
};
static_assert(sizeof(bfloat) == 2, "bfloat must be 16 bits");

}  // namespace metal

namespace msl_rt {

// Result type of a binary operation with a bfloat operand: bfloat with bfloat or an integer, float otherwise.
template <class A, class B> struct bf_result {
  static constexpr bool a_bf = std::is_same<A, metal::bfloat>::value;
  static constexpr bool b_bf = std::is_same<B, metal::bfloat>::value;
  static constexpr bool other_int = (a_bf ? std::is_integral<B>::value : std::is_integral<A>::value);
  typedef typename std::conditional<(a_bf && b_bf) || other_int, metal::bfloat, float>::type type;
};
template <class A, class B>
using bf_enable = typename std::enable_if<
    (std::is_same<A, metal::bfloat>::value || std::is_same<B, metal::bfloat>::value) && is_scalar<A>::value &&
        is_scalar<B>::value,
    typename bf_result<A, B>::type>::type;
template <class A, class B>
using bf_cmp = typename std::enable_if<
    (std::is_same<A, metal::bfloat>::value || std::is_same<B, metal::bfloat>::value) && is_scalar<A>::value &&
        is_scalar<B>::value,
    bool>::type;

}  // namespace msl_rt

namespace metal {

#define MSL_BF_OP(op)                                                                      \
  template <class A, class B> inline msl_rt::bf_enable<A, B> operator op(A a, B b) {      \
    return typename msl_rt::bf_result<A, B>::type(float(a) op float(b));                  \
  }
MSL_BF_OP(+)
MSL_BF_OP(-)
MSL_BF_OP(*)
MSL_BF_OP(/)
#undef MSL_BF_OP
#define MSL_BF_CMP(op) \
  template <class A, class B> inline msl_rt::bf_cmp<A, B> operator op(A a, B b) { return float(a) op float(b); }
MSL_BF_CMP(<)
MSL_BF_CMP(>)
MSL_BF_CMP(<=)
MSL_BF_CMP(>=)
MSL_BF_CMP(==)
MSL_BF_CMP(!=)
#undef MSL_BF_CMP
#define MSL_BF_ASSIGN(op)                                                               \
  template <class S, class = typename std::enable_if<msl_rt::is_scalar<S>::value>::type> \
  inline bfloat& operator op##=(bfloat& a, S b) {                                       \
    a = bfloat(float(a) op float(b));                                                   \
    return a;                                                                           \
  }
MSL_BF_ASSIGN(+)
MSL_BF_ASSIGN(-)
MSL_BF_ASSIGN(*)
MSL_BF_ASSIGN(/)
#undef MSL_BF_ASSIGN

typedef half float16_t;
typedef bfloat bfloat16_t;

// ---- vectors ----
template <class T, int N> struct vec_fields;
template <class T> struct vec_fields<T, 2> { T x, y; };
template <class T> struct vec_fields<T, 3> { T x, y, z, pad_; };
template <class T> struct vec_fields<T, 4> { T x, y, z, w; };

template <class T, int N>
struct alignas(sizeof(T) * (N == 3 ? 4 : N)) vec : vec_fields<T, N> {
  vec() = default;
  template <class S, class = typename std::enable_if<msl_rt::is_scalar<S>::value>::type>
  vec(S s) {
    for (int i = 0; i < N; ++i) (*this)[i] = T(s);
  }
  vec(T a, T b) {
    static_assert(N == 2, "two components need a 2-vector");
    (*this)[0] = a, (*this)[1] = b;
  }
  vec(T a, T b, T c) {
    static_assert(N == 3, "three components need a 3-vector");
    (*this)[0] = a, (*this)[1] = b, (*this)[2] = c;
  }
  vec(T a, T b, T c, T d) {
    static_assert(N == 4, "four components need a 4-vector");
    (*this)[0] = a, (*this)[1] = b, (*this)[2] = c, (*this)[3] = d;
  }
  vec(vec<T, 2> a, vec<T, 2> b) {
    static_assert(N == 4, "two 2-vectors make a 4-vector");
    (*this)[0] = a[0], (*this)[1] = a[1], (*this)[2] = b[0], (*this)[3] = b[1];
  }
  template <class U> explicit vec(const vec<U, N>& o) {
    for (int i = 0; i < N; ++i) (*this)[i] = T(o[i]);
  }
  T& operator[](int i) { return (&this->x)[i]; }
  const T& operator[](int i) const { return (&this->x)[i]; }
};

#define MSL_VEC_TYPES(T)      \
  typedef vec<T, 2> T##2;     \
  typedef vec<T, 3> T##3;     \
  typedef vec<T, 4> T##4;
MSL_VEC_TYPES(float)
MSL_VEC_TYPES(half)
MSL_VEC_TYPES(bfloat)
MSL_VEC_TYPES(int)
MSL_VEC_TYPES(uint)
MSL_VEC_TYPES(short)
MSL_VEC_TYPES(ushort)
MSL_VEC_TYPES(char)
MSL_VEC_TYPES(uchar)
MSL_VEC_TYPES(bool)
MSL_VEC_TYPES(long)
MSL_VEC_TYPES(ulong)
#undef MSL_VEC_TYPES

#define MSL_VEC_BINOP(op)                                                                             \
  template <class T, int N> inline vec<T, N> operator op(const vec<T, N>& a, const vec<T, N>& b) {  \
    vec<T, N> r;                                                                                      \
    for (int i = 0; i < N; ++i) r[i] = T(a[i] op b[i]);                                               \
    return r;                                                                                         \
  }                                                                                                   \
  template <class T, int N, class S, class = typename std::enable_if<msl_rt::is_scalar<S>::value>::type> \
  inline vec<T, N> operator op(const vec<T, N>& a, S s) {                                             \
    return a op vec<T, N>(T(s));                                                                      \
  }                                                                                                   \
  template <class T, int N, class S, class = typename std::enable_if<msl_rt::is_scalar<S>::value>::type> \
  inline vec<T, N> operator op(S s, const vec<T, N>& a) {                                             \
    return vec<T, N>(T(s)) op a;                                                                      \
  }                                                                                                   \
  template <class T, int N, class S> inline vec<T, N>& operator op##=(vec<T, N>& a, const S& b) {     \
    a = a op b;                                                                                       \
    return a;                                                                                         \
  }
MSL_VEC_BINOP(+)
MSL_VEC_BINOP(-)
MSL_VEC_BINOP(*)
MSL_VEC_BINOP(/)
MSL_VEC_BINOP(%)
MSL_VEC_BINOP(&)
MSL_VEC_BINOP(|)
MSL_VEC_BINOP(^)
MSL_VEC_BINOP(<<)
MSL_VEC_BINOP(>>)
#undef MSL_VEC_BINOP

#define MSL_VEC_CMP(op)                                                                                  \
  template <class T, int N> inline vec<bool, N> operator op(const vec<T, N>& a, const vec<T, N>& b) {    \
    vec<bool, N> r;                                                                                      \
    for (int i = 0; i < N; ++i) r[i] = a[i] op b[i];                                                     \
    return r;                                                                                            \
  }                                                                                                      \
  template <class T, int N, class S, class = typename std::enable_if<msl_rt::is_scalar<S>::value>::type> \
  inline vec<bool, N> operator op(const vec<T, N>& a, S s) {                                             \
    return a op vec<T, N>(T(s));                                                                         \
  }
MSL_VEC_CMP(<)
MSL_VEC_CMP(>)
MSL_VEC_CMP(<=)
MSL_VEC_CMP(>=)
MSL_VEC_CMP(==)
MSL_VEC_CMP(!=)
#undef MSL_VEC_CMP

template <class T, int N> inline vec<T, N> operator-(const vec<T, N>& a) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r[i] = T(-a[i]);
  return r;
}

template <int N> inline bool all(const vec<bool, N>& v) {
  for (int i = 0; i < N; ++i)
    if (!v[i]) return false;
  return true;
}
template <int N> inline bool any(const vec<bool, N>& v) {
  for (int i = 0; i < N; ++i)
    if (v[i]) return true;
  return false;
}
inline bool all(bool b) { return b; }
inline bool any(bool b) { return b; }

template <class T, class U> inline T as_type(const U& x) { return msl_rt::bit_cast<T>(x); }

}  // namespace metal
