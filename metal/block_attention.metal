// block_attention.metal: the drafter's attention of B <= 16 block rows over [cached context ; the block].
//
// Bodies for mx.fast.metal_kernel (MLX writes the signatures); see block_attention.py for the reference and the
// dispatcher. Pass 1 splits the keys (context, then block) into chunks: one threadgroup per (row group, chunk,
// KV head), each SIMD group holding DFLASH_ATTN_ROWS query rows of that KV head (all GQA heads of a group read
// the same K/V), each lane head_dim/32 dimensions. It writes an unnormalized partial (acc, max, sum) per chunk;
// pass 2 merges the chunks. Masks are computed from absolute positions, never materialized:
//   context key at position c, row i (position n_ctx + i): visible iff window <= 0 or c > n_ctx + i - window
//   block key j, row i: visible iff not causal or j <= i
// The context is read in place through its strides (a cache view), and only keys the window can reach.

constant constexpr int DFLASH_ATTN_ROWS = 4;           // query rows per SIMD group
constant constexpr int DFLASH_ATTN_MAX_PER_LANE = 8;   // head_dim <= 256
// No score is this low; an empty partial keeps it, so its merge weight exp(m - M) is exactly 0.
constant constexpr float DFLASH_ATTN_EMPTY = -1e30f;

// ---- kernel: dflash_block_attn_partial
// q [Hq, B, D], blk_k/blk_v [Hkv, B, D] (row-contiguous); ctx_k/ctx_v [1, Hkv, L >= n_ctx, D] (any strides).
// Grid (32 * sgs * row_groups, n_chunks, Hkv), threadgroup (32 * sgs, 1, 1).
// Outputs part_o [n_chunks, Hq, B, D], part_m and part_l [n_chunks, Hq, B] (float32).
const int n_heads = q_shape[0];
const int n_blk = q_shape[1];
const int head_dim = q_shape[2];
const int group = n_heads / blk_k_shape[0];
const int per_lane = head_dim / 32;
const int lane = int(thread_index_in_simdgroup);
const int sgs = int(threads_per_threadgroup.x) / 32;
const int kv_head = int(threadgroup_position_in_grid.z);
const int chunk_id = int(threadgroup_position_in_grid.y);
const int row0 = (int(threadgroup_position_in_grid.x) * sgs + int(simdgroup_index_in_threadgroup)) * DFLASH_ATTN_ROWS;
const int rows = group * n_blk;
if (row0 >= rows) {
  return;  // a whole SIMD group with no rows: nothing to compute, nothing to write
}

const int first = window > 0 ? max(n_ctx - window + 1, 0) : 0;  // oldest context key any row can see
const int n_seen = n_ctx - first;
const int n_keys = n_seen + n_blk;
const int u_begin = chunk_id * chunk;
const int u_end = min(u_begin + chunk, n_keys);

bool live[DFLASH_ATTN_ROWS];
int head[DFLASH_ATTN_ROWS];
int slot[DFLASH_ATTN_ROWS];
float qv[DFLASH_ATTN_ROWS][DFLASH_ATTN_MAX_PER_LANE];
float acc[DFLASH_ATTN_ROWS][DFLASH_ATTN_MAX_PER_LANE];
float m[DFLASH_ATTN_ROWS];
float l[DFLASH_ATTN_ROWS];
for (int r = 0; r < DFLASH_ATTN_ROWS; ++r) {
  const int row = row0 + r;
  live[r] = row < rows;
  head[r] = kv_head * group + (live[r] ? row / n_blk : 0);
  slot[r] = live[r] ? row % n_blk : 0;
  m[r] = DFLASH_ATTN_EMPTY;
  l[r] = 0.0f;
  for (int e = 0; e < DFLASH_ATTN_MAX_PER_LANE; ++e) {
    acc[r][e] = 0.0f;
    qv[r][e] = 0.0f;
    if (live[r] && e < per_lane) {
      qv[r][e] = float(q[(head[r] * n_blk + slot[r]) * head_dim + lane + 32 * e]) * scale;
    }
  }
}

const int64_t ck_head = int64_t(kv_head) * ctx_k_strides[1];
const int64_t cv_head = int64_t(kv_head) * ctx_v_strides[1];
for (int u = u_begin; u < u_end; ++u) {
  const bool in_ctx = u < n_seen;
  const int j = u - n_seen;  // block key index when !in_ctx
  const int c = first + u;   // context position when in_ctx
  float kf[DFLASH_ATTN_MAX_PER_LANE];
  float vf[DFLASH_ATTN_MAX_PER_LANE];
  for (int e = 0; e < DFLASH_ATTN_MAX_PER_LANE; ++e) {
    kf[e] = 0.0f;
    vf[e] = 0.0f;
    if (e < per_lane) {
      const int d = lane + 32 * e;
      if (in_ctx) {
        kf[e] = float(ctx_k[ck_head + int64_t(c) * ctx_k_strides[2] + int64_t(d) * ctx_k_strides[3]]);
        vf[e] = float(ctx_v[cv_head + int64_t(c) * ctx_v_strides[2] + int64_t(d) * ctx_v_strides[3]]);
      } else {
        kf[e] = float(blk_k[(kv_head * n_blk + j) * head_dim + d]);
        vf[e] = float(blk_v[(kv_head * n_blk + j) * head_dim + d]);
      }
    }
  }
  for (int r = 0; r < DFLASH_ATTN_ROWS; ++r) {
    float dot = 0.0f;
    for (int e = 0; e < DFLASH_ATTN_MAX_PER_LANE; ++e) {
      dot += qv[r][e] * kf[e];
    }
    const float s = simd_sum(dot);
    const bool visible = live[r] && (in_ctx ? (window <= 0 || c + window > n_ctx + slot[r])
                                            : (causal == 0 || j <= slot[r]));
    if (visible) {
      const float m_new = max(m[r], s);
      const float correction = metal::exp(m[r] - m_new);
      const float p = metal::exp(s - m_new);
      l[r] = l[r] * correction + p;
      for (int e = 0; e < DFLASH_ATTN_MAX_PER_LANE; ++e) {
        acc[r][e] = acc[r][e] * correction + p * vf[e];
      }
      m[r] = m_new;
    }
  }
}

for (int r = 0; r < DFLASH_ATTN_ROWS; ++r) {
  if (!live[r]) {
    continue;
  }
  const int at = (chunk_id * n_heads + head[r]) * n_blk + slot[r];
  for (int e = 0; e < per_lane; ++e) {
    part_o[at * head_dim + lane + 32 * e] = acc[r][e];
  }
  if (lane == 0) {
    part_m[at] = m[r];
    part_l[at] = l[r];
  }
}

// ---- kernel: dflash_block_attn_merge
// part_o [n_chunks, Hq, B, D], part_m/part_l [n_chunks, Hq, B] -> out [1, B, Hq, D] in T.
// Grid (D, Hq * B, 1): one thread per output element.
const int n_chunks = part_m_shape[0];
const int n_heads = part_m_shape[1];
const int n_blk = part_m_shape[2];
const int head_dim = part_o_shape[3];
const int d = int(thread_position_in_grid.x);
const int row = int(thread_position_in_grid.y);  // head * B + slot
const int stride = n_heads * n_blk;
float top = DFLASH_ATTN_EMPTY;
for (int s = 0; s < n_chunks; ++s) {
  top = max(top, part_m[s * stride + row]);
}
float num = 0.0f;
float den = 0.0f;
for (int s = 0; s < n_chunks; ++s) {
  const float w = metal::exp(part_m[s * stride + row] - top);
  num += w * part_o[(s * stride + row) * head_dim + d];
  den += w * part_l[s * stride + row];
}
out[((row % n_blk) * n_heads + row / n_blk) * head_dim + d] = static_cast<T>(num / den);
