// gdn_tape.metal: the Gated DeltaNet recurrence of a verify block, with a tape that makes rollback a short replay.
//
// Bodies for mx.fast.metal_kernel; see gdn_tape.py for the reference, the dispatcher and how RecurrentRollback
// uses them. Per value row of a head, per step t (state S [Dv, Dk] in float registers, rounded to its storage
// dtype once, at the end):
//   S = g_t * S;  delta_t = (v_t - S k_t) * beta_t;  S = fma(k_t, delta_t, S);  y_t = S q_t
// The forward pass is arithmetic-for-arithmetic mlx-lm's gated_delta_update kernel for the same shape (its generic
// simd_sum kernel, or its packed Dk = 128 kernel) as a compiler that contracts multiply-adds builds it: mlx-lm writes
// the update `S + k_t * delta_t` and leaves the fusing to the compiler, we write the fma. It also writes delta_t
// (float32) to the tape. The replay re-applies only the two state updates for the kept steps, through the same
// two functions (dflash_gdn_decay, dflash_gdn_update), so the state it returns is the state the forward pass held
// after those steps, bit for bit: nothing is recomputed that could round differently.

constant constexpr int DFLASH_GDN_MAX_PER_LANE = 8;  // Dk <= 256

// The state arithmetic the forward pass and the replay share, written once for all three bodies. The decay is one
// rounded product; the update is ONE fused multiply-add, spelled out with fma() rather than left to the compiler.
// Left as `s = s * g; s = s + k * delta`, a compiler that contracts across statements is free to fuse either
// product: in the forward pass the decayed state is also read by kv_mem, so only k * delta can fuse, but in the
// replay the decay product has no other use and may become fma(s, g, k * delta), which rounds differently and
// breaks the replay's bit-exactness. An fma's operands cannot be contracted any further, so both passes round the
// same two operations whatever the compiler does.
inline float dflash_gdn_decay(float s, float g) {
  return s * g;
}
inline float dflash_gdn_update(float decayed, float k, float delta) {
  return fma(k, delta, decayed);
}

// ---- kernel: dflash_gdn_tape
// q, k [B, T, Hk, Dk]; v [B, T, Hv, Dv]; g, beta [B, T, Hv] (g float32); state_in [B, Hv, Dv, Dk].
// Outputs y [B, T, Hv, Dv] (InT), state_out [B, Hv, Dv, Dk] (StT), delta [B, T, Hv, Dv] (float32).
// Grid (32, Dv, B * Hv), threadgroup (32, 4, 1): one SIMD group per value row, Dk / 32 state columns per lane.
const int Hk = k_shape[2];
const int Dk = k_shape[3];
const int Hv = v_shape[2];
const int Dv = v_shape[3];
const int n_per_t = Dk / 32;
const int n = int(thread_position_in_grid.z);
const int b_idx = n / Hv;
const int hv_idx = n % Hv;
const int hk_idx = hv_idx / (Hv / Hk);
const int dk_idx = int(thread_position_in_threadgroup.x);
const int dv_idx = int(thread_position_in_grid.y);

auto q_ = q + b_idx * steps * Hk * Dk + hk_idx * Dk;
auto k_ = k + b_idx * steps * Hk * Dk + hk_idx * Dk;
auto v_ = v + b_idx * steps * Hv * Dv + hv_idx * Dv;
auto g_ = g + b_idx * steps * Hv;
auto beta_ = beta + b_idx * steps * Hv;
const int yd = b_idx * steps * Hv * Dv + hv_idx * Dv;  // y and delta share a layout

float state[DFLASH_GDN_MAX_PER_LANE];
for (int i = 0; i < DFLASH_GDN_MAX_PER_LANE; ++i) {
  state[i] = i < n_per_t ? static_cast<float>(state_in[(n * Dv + dv_idx) * Dk + n_per_t * dk_idx + i]) : 0.0f;
}

for (int t = 0; t < steps; ++t) {
  float kv_mem = 0.0f;
  for (int i = 0; i < DFLASH_GDN_MAX_PER_LANE; ++i) {
    if (i < n_per_t) {
      const int s_idx = n_per_t * dk_idx + i;
      state[i] = dflash_gdn_decay(state[i], g_[hv_idx]);
      kv_mem += state[i] * static_cast<float>(k_[s_idx]);
    }
  }
  kv_mem = simd_sum(kv_mem);

  const float delta_t = (static_cast<float>(v_[dv_idx]) - kv_mem) * static_cast<float>(beta_[hv_idx]);

  float out = 0.0f;
  for (int i = 0; i < DFLASH_GDN_MAX_PER_LANE; ++i) {
    if (i < n_per_t) {
      const int s_idx = n_per_t * dk_idx + i;
      state[i] = dflash_gdn_update(state[i], static_cast<float>(k_[s_idx]), delta_t);
      out += state[i] * static_cast<float>(q_[s_idx]);
    }
  }
  out = simd_sum(out);
  if (thread_index_in_simdgroup == 0) {
    y[yd + t * Hv * Dv + dv_idx] = static_cast<InT>(out);
    delta[yd + t * Hv * Dv + dv_idx] = delta_t;
  }
  q_ += Hk * Dk;
  k_ += Hk * Dk;
  v_ += Hv * Dv;
  g_ += Hv;
  beta_ += Hv;
}
for (int i = 0; i < n_per_t; ++i) {
  state_out[(n * Dv + dv_idx) * Dk + n_per_t * dk_idx + i] = static_cast<StT>(state[i]);
}

// ---- kernel: dflash_gdn_tape_packed
// The Dk = 128 layout of mlx-lm's packed kernel (the one it runs for these shapes), with the same arithmetic:
// 4 lanes per value row, 8 rows per SIMD group, 32 state columns per lane; each lane sums its columns in 4-element
// chains combined pairwise, then shuffle_xor 1 and 2 finish the row. Inputs and outputs as dflash_gdn_tape.
// Grid (32, Dv / 8, B * Hv), threadgroup (32, 2, 1).
constexpr int lanes_per_row = 4;
constexpr int rows_per_simdgroup = 32 / lanes_per_row;
constexpr int Dk = 128;
constexpr int values_per_lane = Dk / lanes_per_row;
constexpr int partials_per_lane = values_per_lane / 4;
const int Hk = k_shape[2];
const int Hv = v_shape[2];
const int Dv = v_shape[3];
const int n = int(thread_position_in_grid.z);
const int b_idx = n / Hv;
const int hv_idx = n % Hv;
const int hk_idx = hv_idx / (Hv / Hk);
const int lane = int(thread_index_in_simdgroup);
const int lane_in_row = lane & (lanes_per_row - 1);
const int dv_idx = int(thread_position_in_grid.y) * rows_per_simdgroup + lane / lanes_per_row;

auto q_ = q + (b_idx * steps * Hk + hk_idx) * Dk + lane_in_row * values_per_lane;
auto k_ = k + (b_idx * steps * Hk + hk_idx) * Dk + lane_in_row * values_per_lane;
auto v_ = v + (b_idx * steps * Hv + hv_idx) * Dv;
auto g_ = g + b_idx * steps * Hv;
auto beta_ = beta + b_idx * steps * Hv;
const int yd = b_idx * steps * Hv * Dv + hv_idx * Dv;
const int s_at = (n * Dv + dv_idx) * Dk + lane_in_row * values_per_lane;

float state[values_per_lane];
for (int i = 0; i < values_per_lane; ++i) {
  state[i] = static_cast<float>(state_in[s_at + i]);
}

for (int t = 0; t < steps; ++t) {
  const float gt = static_cast<float>(g_[hv_idx]);
  float part[partials_per_lane];
  for (int pb = 0; pb < partials_per_lane; ++pb) {
    float acc = 0.0f;
    for (int i = 0; i < 4; ++i) {
      const int e = pb * 4 + i;
      state[e] = dflash_gdn_decay(state[e], gt);
      acc += state[e] * static_cast<float>(k_[e]);
    }
    part[pb] = acc;
  }
  float kv_mem = ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
  kv_mem += simd_shuffle_xor(kv_mem, 1);
  kv_mem += simd_shuffle_xor(kv_mem, 2);

  const float delta_t = (static_cast<float>(v_[dv_idx]) - kv_mem) * static_cast<float>(beta_[hv_idx]);

  for (int pb = 0; pb < partials_per_lane; ++pb) {
    float acc = 0.0f;
    for (int i = 0; i < 4; ++i) {
      const int e = pb * 4 + i;
      state[e] = dflash_gdn_update(state[e], static_cast<float>(k_[e]), delta_t);
      acc += state[e] * static_cast<float>(q_[e]);
    }
    part[pb] = acc;
  }
  float out = ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
  out += simd_shuffle_xor(out, 1);
  out += simd_shuffle_xor(out, 2);
  if (lane_in_row == 0) {
    y[yd + t * Hv * Dv + dv_idx] = static_cast<InT>(out);
    delta[yd + t * Hv * Dv + dv_idx] = delta_t;
  }
  q_ += Hk * Dk;
  k_ += Hk * Dk;
  v_ += Hv * Dv;
  g_ += Hv;
  beta_ += Hv;
}
for (int i = 0; i < values_per_lane; ++i) {
  state_out[s_at + i] = static_cast<StT>(state[i]);
}

// ---- kernel: dflash_gdn_replay
// k [B, T, Hk, Dk]; g [B, T, Hv] float32; delta [B, T, Hv, Dv] float32 (the tape); state_in [B, Hv, Dv, Dk].
// Output state_out [B, Hv, Dv, Dk] (StT): the state after the first `keep` steps.
// Grid (Dk, Dv, B * Hv): one thread per state element, no cross-thread work.
const int T = k_shape[1];
const int Hk = k_shape[2];
const int Dk = k_shape[3];
const int Hv = delta_shape[2];
const int Dv = delta_shape[3];
const int dk_idx = int(thread_position_in_grid.x);
const int dv_idx = int(thread_position_in_grid.y);
const int n = int(thread_position_in_grid.z);
const int b_idx = n / Hv;
const int hv_idx = n % Hv;
const int hk_idx = hv_idx / (Hv / Hk);

float s = static_cast<float>(state_in[(n * Dv + dv_idx) * Dk + dk_idx]);
for (int t = 0; t < keep; ++t) {
  const float g_t = g[(b_idx * T + t) * Hv + hv_idx];
  const float k_t = static_cast<float>(k[((b_idx * T + t) * Hk + hk_idx) * Dk + dk_idx]);
  const float delta_t = delta[((b_idx * T + t) * Hv + hv_idx) * Dv + dv_idx];
  s = dflash_gdn_update(dflash_gdn_decay(s, g_t), k_t, delta_t);
}
state_out[(n * Dv + dv_idx) * Dk + dk_idx] = static_cast<StT>(s);
