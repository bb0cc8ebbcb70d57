// msl_shim.h: enough of the Metal Shading Language for g++ to compile an mx.fast.metal_kernel body on the host.
//
// The emulator (emulator.py) compiles every kernel as: this header, `using namespace metal;`, the kernel's header,
// the signature MLX generates, the body, and a small C entry point. Address-space qualifiers (device, constant,
// thread) mean nothing on the host and vanish; `threadgroup` declarations are rewritten by emulator.py into
// per-threadgroup storage (msl_rt::tg_alloc). Attributes such as [[buffer(0)]] are ignored by g++.
#pragma once

#include "msl_math.h"

// Address spaces: every pointer is a host pointer. Defined last, so that no system header sees them.
#define device
#define constant
#define thread
#define threadgroup
