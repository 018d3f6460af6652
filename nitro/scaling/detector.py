"""Boosting detection (the round's second step, paper §5.2): the extreme eigenvalues of the Hessian of the
surrogate objective with respect to the policy parameters, and the ratio ``R = -λmax/λmin`` (Eq. 2).

One function of ours does it, :func:`hessian_extremes`: a Lanczos run with full
reorthogonalisation over Hessian-vector products. The gradient is built once with
``create_graph=True``; every HVP is then one ``torch.autograd.grad`` of ``g·v`` through that one
graph (``retain_graph=True``), so a step costs about one backward pass. The extreme Ritz values of
the tridiagonal matrix are λmax and λmin (Ritz values always lie inside the spectrum, and the
extremes converge first). The Lanczos vectors live in float64 on the parameters' device (a
learner on ``cuda`` detects there), drawn from the same seeded start on every device; HVPs run in
the parameters' dtype.

Sign convention: the eigenvalues are those of the Hessian of whatever scalar ``loss_fn`` returns.
Eq. 2 is written for the surrogate *objective* L(θ) (maximised, paper Theorem 1). If the closure
returns a loss to minimise (−L), pass ``negate=True``: the Hessian of L is minus that of the loss,
so λmax(L) = −λmin(loss) and the ratio becomes the reciprocal one; getting this wrong silently
inverts the score.

Degenerate cases never raise; they give ``R=None`` with a status, and a log line:

* ``"ok"``: λmin < 0, R = −λmax/λmin (negative when λmax < 0 too: then the surface is concave in
  every direction explored; the formula is kept as written).
* ``"lambda_min_zero"``: |λmin| ≤ ``zero_tol``·max(|λmax|, |λmin|) (or the whole Hessian is zero):
  R would be ±inf or noise-dominated.
* ``"lambda_min_nonnegative"``: λmin > 0, the surface is convex in every direction. The formula
  would give R ≤ −1, which would read as the *lowest* score (strongest boost) although R → +∞ as
  λmin → 0⁻; so R is reported missing, and the scaler treats missing as "no boost" (I_min).
* ``"nan"``: the loss, the gradient, an HVP or a Ritz value is not finite.
* ``"no_params"``: nothing to differentiate (no parameter requires grad or is used by the loss).
* ``"error"``: anything else that went wrong inside (logged with its traceback).

Clean-up: autograd.grad never writes ``.grad``, and the module's train/eval mode is never touched
by this path. The optional PyHessian path (:func:`pyhessian_extremes`, benchmark comparison only)
does both, so it restores them.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from nitro.learners import Learner

log = logging.getLogger(__name__)

STATUS_OK = "ok"
STATUS_MIN_ZERO = "lambda_min_zero"
STATUS_MIN_NONNEG = "lambda_min_nonnegative"
STATUS_NAN = "nan"
STATUS_NO_PARAMS = "no_params"
STATUS_ERROR = "error"


@dataclass(frozen=True)
class Detection:
    """The outcome of one detection. ``R`` is None unless ``status == "ok"``."""

    lambda_max: float | None
    lambda_min: float | None
    R: float | None
    status: str
    seconds: float
    n_hvp: int
    n_samples: int | None = None
    message: str = ""

    @property
    def ratio_R(self) -> float | None:  # alias, the name used in some briefs
        return self.R

    @property
    def ok(self) -> bool:
        return self.status == STATUS_OK

    def to_dict(self) -> dict[str, Any]:
        """JSON-able (None for missing values, never NaN)."""
        return asdict(self)

    def metrics(self) -> dict[str, float]:
        """Numeric fields only, for MLflow (missing values left out)."""
        out = {"detect_seconds": self.seconds, "detect_n_hvp": float(self.n_hvp)}
        for key, value in (("lambda_max", self.lambda_max), ("lambda_min", self.lambda_min), ("R", self.R)):
            if value is not None:
                out[key] = value
        return out


def classify(lambda_max: float, lambda_min: float, zero_tol: float = 1e-5) -> tuple[float | None, str]:
    """(R, status) from the two extremes; see the module docstring for the cases."""
    if not (math.isfinite(lambda_max) and math.isfinite(lambda_min)):
        return None, STATUS_NAN
    scale = max(abs(lambda_max), abs(lambda_min))
    if scale == 0.0 or abs(lambda_min) <= zero_tol * scale:
        return None, STATUS_MIN_ZERO
    if lambda_min > 0:
        return None, STATUS_MIN_NONNEG
    return -lambda_max / lambda_min, STATUS_OK


def _flat(tensors: Sequence[Tensor | None], like: Sequence[Tensor]) -> Tensor:
    parts = [
        (t if t is not None else torch.zeros_like(p)).detach().reshape(-1).to(torch.float64)
        for t, p in zip(tensors, like)
    ]
    return torch.cat(parts)


def _unflat(vec: Tensor, like: Sequence[Tensor]) -> list[Tensor]:
    out, i = [], 0
    for p in like:
        n = p.numel()
        out.append(vec[i : i + n].reshape(p.shape).to(dtype=p.dtype, device=p.device))
        i += n
    return out


def lanczos_ritz(
    hvp: Callable[[Tensor], Tensor], dim: int, steps: int, seed: int, breakdown_tol: float = 1e-12,
    device: torch.device | str = "cpu",
) -> tuple[np.ndarray, int]:
    """Ritz values of ``steps`` Lanczos iterations (full reorthogonalisation, float64) of the
    symmetric operator ``hvp`` on R^dim, from a seeded Gaussian start. Stops early on an invariant
    subspace: when the next β falls below ``breakdown_tol``·max|α| (set it from the precision of
    the HVPs: below that, the residual is rounding noise). The vectors live on ``device``, where
    ``hvp`` takes and returns them. Returns (sorted Ritz values, number of operator applications)."""
    m = max(1, min(int(steps), dim))
    gen = torch.Generator().manual_seed(int(seed))  # on the CPU: one start vector whatever the device
    q = torch.randn(dim, generator=gen, dtype=torch.float64).to(device)
    q /= q.norm()
    Q = torch.zeros(m, dim, dtype=torch.float64, device=device)
    alphas: list[float] = []
    betas: list[float] = []
    n_apply = 0
    for j in range(m):
        Q[j] = q
        w = hvp(q)
        n_apply += 1
        alpha = float(torch.dot(w, q))
        alphas.append(alpha)
        if not math.isfinite(alpha):
            break
        w = w - alpha * q
        if j > 0:
            w = w - betas[-1] * Q[j - 1]
        basis = Q[: j + 1]
        for _ in range(2):  # full reorthogonalisation, twice is enough (Kahan-Parlett)
            w = w - basis.T @ (basis @ w)
        beta = float(w.norm())
        scale = max(abs(a) for a in alphas) if alphas else 0.0
        if j == m - 1 or not math.isfinite(beta) or beta <= breakdown_tol * max(scale, 1e-300):
            break
        betas.append(beta)
        q = w / beta
    k = len(alphas)
    T = torch.diag(torch.tensor(alphas, dtype=torch.float64))
    if k > 1:
        off = torch.tensor(betas[: k - 1], dtype=torch.float64)
        T += torch.diag(off, 1) + torch.diag(off, -1)
    if not torch.isfinite(T).all():
        return np.array([float("nan")]), n_apply
    return torch.linalg.eigvalsh(T).numpy(), n_apply


def hessian_extremes(
    loss_fn: Callable[[], Tensor],
    params: Sequence[Tensor],
    steps: int = 20,
    seed: int = 0,
    *,
    negate: bool = False,
    zero_tol: float = 1e-5,
    n_samples: int | None = None,
) -> Detection:
    """λmax, λmin of the Hessian of ``loss_fn()`` (or of ``-loss_fn()`` with ``negate``) w.r.t.
    ``params``, by ``steps`` Lanczos iterations over HVPs that reuse one autograd graph; and
    ``R = -λmax/λmin``. Never raises; see the module docstring for the statuses."""
    start = time.perf_counter()
    n_hvp = 0

    def done(lmax: float | None, lmin: float | None, R: float | None, status: str, msg: str = "") -> Detection:
        det = Detection(
            lambda_max=lmax, lambda_min=lmin, R=R, status=status,
            seconds=time.perf_counter() - start, n_hvp=n_hvp, n_samples=n_samples, message=msg,
        )
        if status == STATUS_OK:
            log.debug("detection: λmax=%.6g λmin=%.6g R=%.6g (%d HVPs, %.3fs)", lmax, lmin, R, n_hvp, det.seconds)
        else:
            log.warning("detection degenerate (%s): λmax=%s λmin=%s %s; R reported missing", status, lmax, lmin, msg)
        return det

    try:
        wanted = [p for p in params if p.requires_grad]
        if not wanted:
            return done(None, None, None, STATUS_NO_PARAMS, "no parameter requires grad")
        with torch.enable_grad():
            loss = loss_fn()
            if negate:
                loss = -loss
            if not torch.isfinite(loss).all():
                return done(None, None, None, STATUS_NAN, f"loss is {float(loss.detach())}")
            grads = torch.autograd.grad(loss, wanted, create_graph=True, allow_unused=True)
            used = [(p, g) for p, g in zip(wanted, grads) if g is not None]
            if len(used) < len(wanted):
                log.info("detection: %d parameter tensors unused by the loss, left out", len(wanted) - len(used))
            if not used:
                return done(None, None, None, STATUS_NO_PARAMS, "the loss uses none of the parameters")
            ps = [p for p, _ in used]
            gs = [g for _, g in used]
            if not all(torch.isfinite(g).all() for g in gs):
                return done(None, None, None, STATUS_NAN, "gradient is not finite")
            # gradient entries with no graph have zero second derivatives
            graph_idx = [i for i, g in enumerate(gs) if g.requires_grad]
            dim = sum(p.numel() for p in ps)
            device = ps[0].device

            def hvp(vec: Tensor) -> Tensor:
                if not graph_idx:
                    return torch.zeros(dim, dtype=torch.float64, device=device)
                vs = _unflat(vec, ps)
                dot = functools.reduce(torch.add, ((gs[i] * vs[i]).sum() for i in graph_idx))
                hv = torch.autograd.grad(dot, ps, retain_graph=True, allow_unused=True)
                return _flat(hv, ps)

            eps = max(torch.finfo(p.dtype).eps for p in ps)
            ritz, n_hvp = lanczos_ritz(hvp, dim, steps, seed, breakdown_tol=100 * eps, device=device)
            # free the graph now, not at the caller's next GC; hvp's closure holds the list gs itself
            gs.clear()
            del used, grads, loss
        lmax, lmin = float(ritz[-1]), float(ritz[0])
        R, status = classify(lmax, lmin, zero_tol)
        return done(lmax, lmin, R, status)
    except Exception as exc:  # never crash the round
        log.exception("detection failed")
        return done(None, None, None, STATUS_ERROR, f"{type(exc).__name__}: {exc}".splitlines()[0])


def detect_on_batch(
    learner: Learner,
    subset_size: int,
    steps: int = 20,
    seed: int = 0,
    *,
    negate: bool = True,
) -> Detection:
    """Detection on a random subset of the learner's last-update batch, through
    ``learner.objective(indices)`` and ``learner.policy_parameters()`` (the ``Learner`` contract).
    The subset is ``subset_size`` indices drawn without replacement from
    ``range(learner.trained_samples())`` by a numpy RNG seeded with ``seed`` (the whole batch when
    it is smaller). ``negate`` (default True): a learner's ``objective`` is the policy *loss*
    (e.g. PPO's −clipped surrogate + kl_coef·KL), so its Hessian is negated to get the
    objective's, as Eq. 2 wants."""
    start = time.perf_counter()
    n_total = int(learner.trained_samples())
    if n_total <= 0:
        return Detection(None, None, None, STATUS_NO_PARAMS, time.perf_counter() - start, 0, 0, "empty batch")
    rng = np.random.default_rng(seed)
    k = min(int(subset_size), n_total)
    indices = np.sort(rng.choice(n_total, size=k, replace=False)) if k < n_total else np.arange(n_total)
    try:
        closure = learner.objective(torch.as_tensor(indices))
        params = list(learner.policy_parameters())
    except Exception as exc:
        log.exception("detection: could not build the objective")
        return Detection(None, None, None, STATUS_ERROR, time.perf_counter() - start, 0, k,
                         f"{type(exc).__name__}: {exc}".splitlines()[0])
    det = hessian_extremes(closure, params, steps=steps, seed=seed, negate=negate, n_samples=k)
    # count the subset draw and closure construction in the reported time too
    return Detection(**{**det.to_dict(), "seconds": time.perf_counter() - start})


# -- PyHessian, for the benchmark comparison only ---------------------------------------------


@contextlib.contextmanager
def _torch_eig_shim():
    """PyHessian 0.1's density() calls ``torch.eig(T, eigenvectors=True)``; current torch keeps
    only a stub that raises. T is the symmetric Lanczos tridiagonal, so ``torch.linalg.eigh`` gives
    the same thing; it is returned in the old layout (eigenvalues as an (n, 2) real/imag tensor,
    eigenvectors as columns). Installed only for the duration of the call; the original attribute
    (or its absence) is put back afterwards."""
    missing = object()
    original = getattr(torch, "eig", missing)

    def eig(A: Tensor, eigenvectors: bool = False):
        vals, vecs = torch.linalg.eigh(A)
        return torch.stack([vals, torch.zeros_like(vals)], 1), (vecs if eigenvectors else torch.empty(0))

    torch.eig = eig  # type: ignore[assignment]  # the old signature PyHessian calls, not torch's stub's
    try:
        yield
    finally:
        if original is missing:
            del torch.eig
        else:
            torch.eig = original  # type: ignore[assignment]  # the attribute read above (typed object by getattr)


class _LossModule(nn.Module):
    """Adapts a closure to PyHessian's model(inputs) -> criterion(outputs, targets) interface; it
    holds the policy as a submodule so that ``parameters()`` are exactly the policy's."""

    def __init__(self, module: nn.Module, loss_fn: Callable[[], Tensor], sign: float):
        super().__init__()
        self.inner = module
        self._loss_fn = loss_fn
        self._sign = sign

    def forward(self, _x: Tensor) -> Tensor:
        return self._sign * self._loss_fn()


def pyhessian_extremes(
    loss_fn: Callable[[], Tensor],
    module: nn.Module,
    steps: int = 20,
    seed: int = 0,
    *,
    negate: bool = False,
    zero_tol: float = 1e-5,
) -> Detection:
    """The paper's path: PyHessian 0.1 ``hessian(...).density(iter=steps, n_v=1)`` on CPU with the
    torch.eig shim; extreme Ritz values -> λmax, λmin. ``module`` must hold only parameters the
    loss uses (a policy-only module). PyHessian leaves ``.grad`` (with a graph) on the parameters
    and the model in eval(): both are restored. Its Rademacher start uses torch's global RNG,
    which is forked and seeded here so the caller's stream is untouched."""
    from pyhessian import hessian as PyHessian

    start = time.perf_counter()
    params = [p for p in module.parameters()]
    saved_grads = [p.grad for p in params]
    was_training = [m.training for m in module.modules()]
    wrapper = _LossModule(module, loss_fn, -1.0 if negate else 1.0)
    try:
        for p in params:
            p.grad = None
        with torch.random.fork_rng(devices=[]), _torch_eig_shim(), torch.enable_grad(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Using backward\\(\\) with create_graph=True")
            torch.manual_seed(seed)
            hess = PyHessian(wrapper, lambda out, _t: out, data=(torch.zeros(1), torch.zeros(1)), cuda=False)
            eigs, _weights = hess.density(iter=steps, n_v=1)
        ritz = np.asarray(eigs[0], dtype=np.float64)
        lmax, lmin = float(ritz.max()), float(ritz.min())
        R, status = classify(lmax, lmin, zero_tol)
        return Detection(lmax, lmin, R, status, time.perf_counter() - start, steps + 0, None, "pyhessian density()")
    except Exception as exc:
        log.exception("pyhessian detection failed")
        return Detection(None, None, None, STATUS_ERROR, time.perf_counter() - start, 0, None,
                         f"{type(exc).__name__}: {exc}".splitlines()[0])
    finally:
        for p, g in zip(params, saved_grads):
            p.grad = g
        for m, t in zip(module.modules(), was_training):
            m.train(t)
