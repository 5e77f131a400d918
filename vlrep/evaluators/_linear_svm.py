"""Many L2-regularised squared-hinge linear SVMs on one feature matrix, solved together in JAX.

Every VOC07 probe fits 20 classes x 4 costs x (3 folds + refit) SVMs on the same features: they differ only
in their labels, their costs and which samples they train on. Stacked as the columns of one weight matrix
[D + 1, P], all P problems advance together and each step is a matrix product over the shared features,
which is what CPUs and accelerators do best.

Each problem is exactly scikit-learn's `LinearSVC(penalty='l2', loss='squared_hinge', dual=True)` objective
(liblinear regularises the intercept too: intercept_scaling=1 appends a constant feature):

  min_w  0.5 ||w||^2 + sum_i s_i max(0, 1 - y_i <w, [x_i, 1]>)^2,    s_i = C * class_weight[y_i] (0: not in set)

The objective is strongly convex and piecewise quadratic, so we solve its primal with truncated Newton steps
(as liblinear's TRON does): the Newton direction from preconditioned conjugate gradients (each problem to
residual 0.1 of its gradient, liblinear's choice) with Hessian-vector products v + 2 X^T (a * X v), then an
exact line search (the 1-D problem is piecewise quadratic and needs no further products with X).
`solve` expects features rotated into the eigenbasis of X^T X (`eigenbasis`; any rotation leaves the L2
problem unchanged): there the Hessian is close to diagonal and a Jacobi preconditioner cuts the conjugate-
gradient iterations at large C (a Jacobi preconditioner in the raw basis, or a low-rank one from the top
eigenpairs, does not help). Costs are solved in ascending order, each warm-started from
the previous solution.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np


def eigenbasis(xa) -> np.ndarray:
  """Eigenvectors of xa^T xa [D, D]: the rotation in which `solve`'s Jacobi preconditioner works well.

  LAPACK's divide-and-conquer driver on the host: the faster one for ResNet feature sizes (D ~ 2k).
  """
  import scipy.linalg

  xa = np.asarray(xa, np.float32)
  gram = xa.T @ xa
  return scipy.linalg.eigh((gram + gram.T) / 2, driver="evd")[1]


@functools.partial(jax.jit, static_argnames=("max_newton", "max_cg", "jacobi", "append_bias"))
def solve(
  x: jax.Array,
  y: jax.Array,
  s: jax.Array,
  tol: float = 1e-3,
  max_newton: int = 50,
  max_cg: int = 200,
  jacobi: bool = True,
  append_bias: bool = True,
  w_init: jax.Array | None = None,
  forcing: float = 0.1,
) -> tuple[jax.Array, jax.Array, dict]:
  """Solves P squared-hinge SVMs sharing features.

  Args:
    x: [N, D] features.
    y: [N, P] labels in {+1, -1} per problem.
    s: [N, P] per-sample costs (C times the class weight), 0 for samples outside a problem's training set.
    tol: stop when every problem's gradient norm is below tol times its initial one (liblinear's criterion).
  Returns:
    (w [D, P], b [P], info) with info = {'newton_iters', 'cg_iters', 'grad_ratio' [P]}.
  """
  x = x.astype(jnp.float32)
  y = y.astype(jnp.float32)
  s = s.astype(jnp.float32)
  n, _ = x.shape
  p = y.shape[1]
  xa = jnp.concatenate([x, jnp.ones((n, 1), x.dtype)], axis=1) if append_bias else x
  d = xa.shape[1]
  hp = jax.lax.Precision.HIGHEST
  mm = functools.partial(jnp.matmul, precision=hp)
  xa_sq = xa * xa

  def grad(w, z):
    margin = jnp.maximum(0.0, 1.0 - y * z)
    return w - 2.0 * mm(xa.T, s * y * margin), margin

  def newton_step(carry):
    w, z, it, cg_total, g0_norm, _ = carry
    g, margin = grad(w, z)
    g_norm = jnp.linalg.norm(g, axis=0)
    active = s * (margin > 0)  # curvature weights [N, P]
    inv_diag = 1.0 / (1.0 + 2.0 * mm(xa_sq.T, active)) if jacobi else 1.0  # Jacobi preconditioner [D, P]

    def precond(v):
      return inv_diag * v

    def hess(v):
      return v + 2.0 * mm(xa.T, active * mm(xa, v))

    # Conjugate gradients on H d = -g, each problem to relative residual 0.1 (inexact Newton).
    r = -g
    zr = precond(r)
    cg_tol = forcing * g_norm

    def cg_cond(c):
      _, r, _, _, _, i = c
      return (i < max_cg) & jnp.any(jnp.linalg.norm(r, axis=0) > cg_tol)

    def cg_body(c):
      dvec, r, zr, pdir, rz, i = c
      live = jnp.linalg.norm(r, axis=0) > cg_tol
      hpd = hess(pdir)
      alpha = jnp.where(live, rz / jnp.maximum(jnp.sum(pdir * hpd, axis=0), 1e-30), 0.0)
      dvec = dvec + alpha * pdir
      r = r - alpha * hpd
      zr_new = precond(r)
      rz_new = jnp.sum(r * zr_new, axis=0)
      pdir = jnp.where(live, zr_new + (rz_new / jnp.maximum(rz, 1e-30)) * pdir, pdir)
      return dvec, r, zr_new, pdir, jnp.where(live, rz_new, rz), i + 1

    rz = jnp.sum(r * zr, axis=0)
    dvec, _, _, _, _, cg_iters = jax.lax.while_loop(cg_cond, cg_body, (jnp.zeros_like(w), r, zr, zr, rz, 0))

    # Exact line search on the piecewise-quadratic 1-D objective, by Newton's method on t from t = 1.
    zd = mm(xa, dvec)
    wd, dd = jnp.sum(w * dvec, axis=0), jnp.sum(dvec * dvec, axis=0)

    def line_newton(_, t):
      m = 1.0 - y * (z + t * zd)
      on = m > 0
      d1 = t * dd + wd - 2.0 * jnp.sum(s * y * zd * jnp.where(on, m, 0.0), axis=0)
      d2 = dd + 2.0 * jnp.sum(s * zd * zd * on, axis=0)
      return jnp.maximum(t - d1 / jnp.maximum(d2, 1e-30), 0.0)

    t = jax.lax.fori_loop(0, 8, line_newton, jnp.ones((p,), w.dtype))
    done = g_norm <= tol * g0_norm
    t = jnp.where(done, 0.0, t)
    return w + t * dvec, z + t * zd, it + 1, cg_total + cg_iters, g0_norm, jnp.all(done)

  def newton_cond(carry):
    _, _, it, _, _, all_done = carry
    return (it < max_newton) & ~all_done

  w0 = jnp.zeros((d, p), jnp.float32) if w_init is None else w_init.astype(jnp.float32)
  z0 = mm(xa, w0)
  # The stopping rule is relative to the gradient at zero, so a warm start does not change it.
  g0_norm = jnp.linalg.norm(grad(jnp.zeros_like(w0), jnp.zeros_like(z0))[0], axis=0)
  w, z, it, cg_total, _, _ = jax.lax.while_loop(newton_cond, newton_step, (w0, z0, 0, 0, g0_norm, False))
  g_ratio = jnp.linalg.norm(grad(w, z)[0], axis=0) / jnp.maximum(g0_norm, 1e-30)
  return w[:-1], w[-1], {"newton_iters": it, "cg_iters": cg_total, "grad_ratio": g_ratio}


def squared_hinge_objective(x, y, s, w, b) -> np.ndarray:
  """The primal objective per problem, in float64 (to compare solvers)."""
  x, y, s, w, b = (np.asarray(a, np.float64) for a in (x, y, s, w, b))
  z = x @ w + b
  return 0.5 * (np.sum(w * w, axis=0) + b * b) + np.sum(s * np.maximum(0.0, 1.0 - y * z) ** 2, axis=0)
