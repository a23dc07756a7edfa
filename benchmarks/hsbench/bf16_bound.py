"""How far a bf16 mixed-precision loss on a mesh may be from one device's at TRUE size (bench
section true_size, the dense Qwen3.5-0.8B runs).

tests/python/level1/test_mixed_precision.py argues 5e-4 for its 2-layer, hidden-32 models. The
same argument, with the model's depth, width and token count left as parameters:

- Both runs do the same recipe (fp32 masters rounded to bf16 identically, bf16 compute, fp32 sums);
  they differ in WHERE activations are rounded to bf16 (a tp rank rounds its partial product before
  the sum; kernels of other shapes). Each such rounding is a relative error of at most u = 2^-8,
  zero-mean with std u / sqrt 3, independent of the others (Higham's statistical bound: they add
  in quadrature). Along one layer's path there are ~6 (mixer output and its tp sum, MLP output and
  its tp sum, two residual adds): k = 6 L for L layers, and the last hidden state h (RMS-normalised,
  elements ~1) carries relative errors of std s = sqrt(k) u / sqrt 3.
- Step 1. One token's loss logsumexp(z) - z_y moves by <p - onehot(y), dz>; with z = W h and dh_i =
  h_i e_i that is sum_i e_i h_i (W^T (p - onehot))_i. At random init the softmax over V = 248k
  classes is near uniform (loss 12.67 ~ ln V), so W^T (p - onehot) ~ -W_y, elements ~ sigma_W (the
  initializer range): the token's loss is off by s sigma_W sqrt(H) (std), and the mean over T
  trained tokens by sigma_L = s sigma_W sqrt(H) / sqrt(T). Bound: 4.5 sigma_L (as the tiny test).
  For Qwen3.5-0.8B (L = 24, H = 1024, sigma_W = 0.02, T = 4 x 127): s = 2.7e-2, sigma_L = 7.7e-4,
  bound 3.5e-3 (measured 2.6e-3 on dp2 x tp2). The tiny models' L = 2, H = 32, T = 58 give the
  tests' sigma_L = 1.1e-4 again.
- Step n > 1 adds the parameters' difference. AdamW's first update is -lr sign(g) per element; the
  runs' gradients differ by a relative r = sqrt(2k) u / sqrt 3 per element (the backward retraces
  the forward's roundings and adds as many), so the elements with |g| < |dg| may move opposite
  ways: 2 lr apart, and the loss, to first order, by 2 lr |g| for each. For gradients distributed
  like a normal of std sigma_g the expected sum is (r^2 / 2) lr ||g||_1 -- r^2 / 2 of the step's
  first-order decrease lr ||g||_1 (E[|g| Phi(-|g| / (r sigma_g))] = r^2 sigma_g / (2 sqrt(2 pi)),
  against E|g| = sigma_g sqrt(2 / pi)); a gradient distribution peaked at 0 (Laplace-like: sqrt(pi)
  times a normal's density at 0) has more such elements: the bound takes twice, r^2 lr ||g||_1,
  with ||g||_1 measured on the one-device run at the step before. At L = 24: r^2 = 1.5e-3. The
  measured step-2 loss fell 4.17 (12.67 -> 8.50), so lr ||g||_1 >= 4.17 to first order would put
  the step-2 bound at >= 3.5e-3 + 6.1e-3 = 9.6e-3 (measured 6.6e-3).

Not covered: the MoE cut runs in bf16 without masters and routes tokens by a top-k of bf16 scores,
which a rounding can flip (a different expert for that token): its difference is reported, not
bounded.
"""

from __future__ import annotations

import math

U_BF16 = 2.0**-8
ROUNDINGS_PER_LAYER = 6
SIGMAS = 4.5


def loss_bounds(layers: int, hidden: int, init_std: float, tokens: int, first_order_decreases: list) -> list:
    """Bound on |loss(mesh) - loss(one device)| at each step. `first_order_decreases[m]`: lr_m *
    ||g_m||_1 of the one-device run's step m (only the steps before the last are used)."""
    k = ROUNDINGS_PER_LAYER * layers
    s = math.sqrt(k) * U_BF16 / math.sqrt(3)
    sigma_loss = s * init_std * math.sqrt(hidden) / math.sqrt(tokens)
    r2 = 2 * k * U_BF16**2 / 3
    bounds, flips = [], 0.0
    for decrease in first_order_decreases:
        bounds.append(SIGMAS * sigma_loss + flips)
        flips += r2 * decrease
    return bounds
