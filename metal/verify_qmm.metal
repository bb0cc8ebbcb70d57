// verify_qmm.metal: y = x @ dequantize(w).T for the 2..16 rows of a verify block, reading each weight once.
//
// Body for mx.fast.metal_kernel; see verify_qmm.py for the reference (mx.quantized_matmul) and the dispatcher.
// mlx-lm's affine quantization: w [N, K * bits / 32] uint32, value j of a word in bits [bits*j, bits*(j+1)),
// w_hat = scale * q + bias with one (scale, bias) per group of group_size values along K.
// One SIMD group computes DFLASH_QMM_COLS output columns for all M rows: each lane walks the words of those
// columns (lane, lane + 32, ...), unpacks each word once and applies it to every row, keeping per row the
// group-local sum(x * q) and sum(x) (y = scale * sum(x q) + bias * sum(x)); simd_sum finishes each output.

constant constexpr int DFLASH_QMM_COLS = 4;      // output columns per SIMD group
constant constexpr int DFLASH_QMM_MAX_ROWS = 16;  // M <= 16
constant constexpr int DFLASH_QMM_MAX_VALUES = 8;  // values per uint32 word: 8 at 4 bits, 4 at 8 bits

// ---- kernel: dflash_verify_qmm
// x [M, K] (row-contiguous); w [N, K * bits / 32] uint32; scales, biases [N, K / group_size].
// Output y [M, N] (T). Grid (32, ceil(N / DFLASH_QMM_COLS), 1), threadgroup (32, SIMD groups per threadgroup, 1).
const int M = x_shape[0];
const int K = x_shape[1];
const int N = w_shape[0];
const int words = w_shape[1];
const int n_groups = scales_shape[1];
const int lane = int(thread_position_in_threadgroup.x);
const int col0 = int(thread_position_in_grid.y) * DFLASH_QMM_COLS;
const int per_word = 32 / bits;
const uint value_mask = (1u << bits) - 1u;

float acc[DFLASH_QMM_MAX_ROWS][DFLASH_QMM_COLS];
for (int m = 0; m < DFLASH_QMM_MAX_ROWS; ++m) {
  for (int c = 0; c < DFLASH_QMM_COLS; ++c) {
    acc[m][c] = 0.0f;
  }
}

for (int wi = lane; wi < words; wi += 32) {
  const int k0 = wi * per_word;
  const int grp = k0 / group_size;
  float qv[DFLASH_QMM_COLS][DFLASH_QMM_MAX_VALUES];
  float scale[DFLASH_QMM_COLS];
  float bias[DFLASH_QMM_COLS];
  for (int c = 0; c < DFLASH_QMM_COLS; ++c) {
    const int col = col0 + c;
    const bool live = col < N;
    const uint word = live ? w[col * words + wi] : 0u;
    scale[c] = live ? float(scales[col * n_groups + grp]) : 0.0f;
    bias[c] = live ? float(biases[col * n_groups + grp]) : 0.0f;
    for (int j = 0; j < DFLASH_QMM_MAX_VALUES; ++j) {
      qv[c][j] = j < per_word ? float((word >> (bits * j)) & value_mask) : 0.0f;
    }
  }
  for (int m = 0; m < DFLASH_QMM_MAX_ROWS; ++m) {
    if (m < M) {
      float xv[DFLASH_QMM_MAX_VALUES];
      float x_sum = 0.0f;
      for (int j = 0; j < DFLASH_QMM_MAX_VALUES; ++j) {
        xv[j] = j < per_word ? float(x[m * K + k0 + j]) : 0.0f;
        x_sum += xv[j];
      }
      for (int c = 0; c < DFLASH_QMM_COLS; ++c) {
        float xq = 0.0f;
        for (int j = 0; j < DFLASH_QMM_MAX_VALUES; ++j) {
          xq += xv[j] * qv[c][j];
        }
        acc[m][c] += scale[c] * xq + bias[c] * x_sum;
      }
    }
  }
}

for (int m = 0; m < DFLASH_QMM_MAX_ROWS; ++m) {
  if (m < M) {
    for (int c = 0; c < DFLASH_QMM_COLS; ++c) {
      const float total = simd_sum(acc[m][c]);
      if (lane == 0 && col0 + c < N) {
        y[m * N + col0 + c] = static_cast<T>(total);
      }
    }
  }
}
