// Metal Shading Language shim: lets g++ compile an MLX custom-kernel body as C++20.
// Address spaces vanish, half is _Float16, bfloat16_t rounds to nearest even after every op,
// and barriers / simd_* functions are scheduling points of cooperative fibers (runtime.h).
#pragma once
#include <math.h>
#include <stdint.h>
#include <stddef.h>
#include <string.h>
#include <limits>
#include <type_traits>

#define device
#define constant
#define thread
#define threadgroup
#define ray_data
#define object_data

typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;
typedef _Float16 half;
typedef _Float16 float16_t;

// bfloat16 as Metal has it: storage 16 bits, arithmetic in float, rounded to nearest even after each op.
struct bfloat16_t {
  uint16_t bits;
  static uint16_t round_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // quiet NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return uint16_t(u >> 16);
  }
  bfloat16_t() = default;
  bfloat16_t(float f) : bits(round_bits(f)) {}
  bfloat16_t(double f) : bits(round_bits(float(f))) {}
  bfloat16_t(int i) : bits(round_bits(float(i))) {}
  bfloat16_t(uint i) : bits(round_bits(float(i))) {}
  bfloat16_t(half h) : bits(round_bits(float(h))) {}
  operator float() const {
    uint32_t u = uint32_t(bits) << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
  }
};
#define BF_BINOP(op)                                                                      \
  inline bfloat16_t operator op(bfloat16_t a, bfloat16_t b) { return bfloat16_t(float(a) op float(b)); } \
  inline float operator op(bfloat16_t a, float b) { return float(a) op b; }               \
  inline float operator op(float a, bfloat16_t b) { return a op float(b); }               \
  inline bfloat16_t operator op(bfloat16_t a, int b) { return bfloat16_t(float(a) op float(b)); } \
  inline bfloat16_t operator op(int a, bfloat16_t b) { return bfloat16_t(float(a) op float(b)); } \
  inline bfloat16_t& operator op##=(bfloat16_t& a, bfloat16_t b) { return a = a op b; }
BF_BINOP(+)
BF_BINOP(-)
BF_BINOP(*)
BF_BINOP(/)
#undef BF_BINOP
#define BF_CMP(op)                                                                        \
  inline bool operator op(bfloat16_t a, bfloat16_t b) { return float(a) op float(b); }    \
  inline bool operator op(bfloat16_t a, float b) { return float(a) op b; }                \
  inline bool operator op(float a, bfloat16_t b) { return a op float(b); }
BF_CMP(<)
BF_CMP(>)
BF_CMP(<=)
BF_CMP(>=)
BF_CMP(==)
BF_CMP(!=)
#undef BF_CMP
inline bfloat16_t operator-(bfloat16_t a) { bfloat16_t r; r.bits = a.bits ^ 0x8000; return r; }
typedef bfloat16_t bfloat;

// Vector types with .x .y .z .w and elementwise arithmetic.
template <class T, int N>
struct vec;
template <class T>
struct vec<T, 2> { T x, y; };
template <class T>
struct vec<T, 3> { T x, y, z; };
template <class T>
struct vec<T, 4> { T x, y, z, w; };
template <class T, int N>
inline T* vdata(vec<T, N>& v) { return &v.x; }
template <class T, int N>
inline const T* vdata(const vec<T, N>& v) { return &v.x; }
#define VEC_BINOP(op)                                                                     \
  template <class T, int N>                                                               \
  inline vec<T, N> operator op(vec<T, N> a, vec<T, N> b) {                                \
    for (int i = 0; i < N; i++) vdata(a)[i] = vdata(a)[i] op vdata(b)[i];                 \
    return a;                                                                             \
  }                                                                                       \
  template <class T, int N>                                                               \
  inline vec<T, N> operator op(vec<T, N> a, T b) {                                        \
    for (int i = 0; i < N; i++) vdata(a)[i] = vdata(a)[i] op b;                           \
    return a;                                                                             \
  }
VEC_BINOP(+)
VEC_BINOP(-)
VEC_BINOP(*)
VEC_BINOP(/)
#undef VEC_BINOP
#define VEC_TYPES(T)                                                                      \
  typedef vec<T, 2> T##2;                                                                 \
  typedef vec<T, 3> T##3;                                                                 \
  typedef vec<T, 4> T##4;
VEC_TYPES(float)
VEC_TYPES(half)
VEC_TYPES(int)
VEC_TYPES(uint)
VEC_TYPES(short)
VEC_TYPES(ushort)
VEC_TYPES(uchar)
#undef VEC_TYPES

namespace metal {

namespace mem_flags {
enum : int { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };
}

#define UNARY(name, fn)                                                                   \
  inline float name(float x) { return fn(x); }                                            \
  inline half name(half x) { return half(fn(float(x))); }                                 \
  inline bfloat16_t name(bfloat16_t x) { return bfloat16_t(fn(float(x))); }
inline float rsqrt_(float x) { return 1.0f / sqrtf(x); }
UNARY(exp, expf)
UNARY(exp2, exp2f)
UNARY(log, logf)
UNARY(log2, log2f)
UNARY(sqrt, sqrtf)
UNARY(rsqrt, rsqrt_)
UNARY(abs, fabsf)
UNARY(fabs, fabsf)
UNARY(floor, floorf)
UNARY(ceil, ceilf)
UNARY(round, roundf)
UNARY(rint, rintf)
UNARY(trunc, truncf)
UNARY(tanh, tanhf)
UNARY(sin, sinf)
UNARY(cos, cosf)
#undef UNARY
inline int abs(int x) { return x < 0 ? -x : x; }
template <class T>
inline T max(T a, T b) { return a > b ? a : b; }
template <class T>
inline T min(T a, T b) { return a < b ? a : b; }
inline float fmax(float a, float b) { return fmaxf(a, b); }
inline float fmin(float a, float b) { return fminf(a, b); }
inline float pow(float a, float b) { return powf(a, b); }
inline float fma(float a, float b, float c) { return fmaf(a, b, c); }
template <class T>
inline T clamp(T x, T lo, T hi) { return min(max(x, lo), hi); }
template <class T>
inline T select(T a, T b, bool c) { return c ? b : a; }
inline bool isinf(float x) { return ::isinf(x); }
inline bool isnan(float x) { return ::isnan(x); }
inline bool isfinite(float x) { return ::isfinite(x); }
template <class To, class From>
inline To as_type(From f) {
  static_assert(sizeof(To) == sizeof(From), "as_type needs equal sizes");
  To t;
  memcpy(&t, &f, sizeof(To));
  return t;
}
using std::numeric_limits;

namespace fast {
using metal::exp; using metal::exp2; using metal::log; using metal::log2; using metal::sqrt;
using metal::rsqrt; using metal::tanh; using metal::pow; using metal::abs;
}
namespace precise {
using metal::exp; using metal::exp2; using metal::log; using metal::log2; using metal::sqrt;
using metal::rsqrt; using metal::tanh; using metal::pow; using metal::abs;
}

}  // namespace metal

using namespace metal;

#include "runtime.h"
