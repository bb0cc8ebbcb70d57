// dflash_common.h: what every DFlash Metal kernel shares.
//
// Kernels are compiled through mx.fast.metal_kernel, which takes a kernel body plus a `header` string;
// dflash_mlx.metal.read_source("dflash_common.h") is passed as (the start of) that header, so this file
// holds only the includes and constants the kernels have in common. The guard keeps a double include harmless.
#ifndef DFLASH_COMMON_H
#define DFLASH_COMMON_H

#include <metal_stdlib>
using namespace metal;

// Threads per SIMD-group on every Apple GPU; reductions are written for this width.
constant constexpr uint DFLASH_SIMD_SIZE = 32;

// Number of size-`tile` tiles needed to cover `n` elements.
inline uint dflash_ceil_div(uint n, uint tile) {
    return (n + tile - 1) / tile;
}

#endif  // DFLASH_COMMON_H
