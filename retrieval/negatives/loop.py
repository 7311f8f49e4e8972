"""LoOp: optimal hard negatives between two geodesic arcs (or two line segments).

Given a positive pair (x1, x2) and a pair (y1, y2) of another class, LoOp looks for the closest points
p1 on the shortest arc x1 -> x2 and p2 on the arc y1 -> y2 (LoOp paper, section 3.1, eq. 1-8):

    p1 = n1 cos(a) + n2 sin(a),  a in [0, a0],   p2 = n3 cos(b) + n4 sin(b),  b in [0, b0]    (eq. 3-4)

and minimises d(p1, p2) = sqrt(2 (1 - p1 . p2)), i.e. maximises s(a, b) = [cos a, sin a] G [cos b, sin b]^T
with G the 2x2 matrix of basis inner products (G = -[[d, b], [c, a]] in the paper's eq. 5 notation).

The KKT analysis (section 3.2, supplementary 4.1) leaves nine cases, solved exactly here:
  case 0     interior: a local maximum of a bilinear form on the torus is a top singular pair of G;
             (u, v) and (-u, -v) are both candidates;
  cases 1-4  one angle on its bound: s = A cos t + B sin t is maximal at t = atan2(B, A);
  cases 5-8  both on a bound: the four endpoint pairs.
Infeasible candidates are dropped and the best feasible one is kept; the corners are always feasible, so a
result always exists, and every candidate is evaluated exactly, so the answer is never below the optimum.

Degenerate geometry: an arc whose endpoints coincide or are antipodal has no Gram-Schmidt basis (eq. 2);
such an "arc" is represented by its two endpoints only (for antipodal points the shortest arc is not
unique). Both arcs on one great circle make G a scaled rotation whose maxima form a ridge; the ridge
always crosses the box boundary, where cases 1-8 find it.

Gradients: the optimum is found on detached values and re-expressed as fractions t = a / a0 in [0, 1];
the box [0, 1]^2 does not depend on the embeddings, so by Danskin's theorem the gradient of the minimum
is the gradient of d(p1(t), p2(t)) with t held fixed. It reaches all four embeddings through p1 and p2
(supplementary eq. 27-30), including the endpoint cases (t = 1 gives p1 = x2 exactly).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from retrieval.distances import dot_similarity_matrix, l2_normalize, safe_sqrt
from retrieval.negatives.base import HardNegativeMethod
from retrieval.negatives.pairs import PositivePairs
from retrieval.utils.reads import Stat, device_constant

# An arc shorter (or a pair closer to antipodal) than this, in sin(a0), has no usable basis (eq. 2).
DEGENERATE_SIN = 1e-6
# Slack on the feasibility test of a candidate angle; a candidate accepted by it is clamped into the box.
_ANGLE_TOL = 1e-9

# Names of the candidates in the order the solver stacks them (the paper's case numbers in brackets).
ARC_CASES = (
    "interior(0)",
    "interior-flipped(0)",
    "a=0(1)",
    "a=a0(2)",
    "b=0(3)",
    "b=b0(4)",
    "corner a=0,b=0(5)",
    "corner a=0,b=b0(6)",
    "corner a=a0,b=0(7)",
    "corner a=a0,b=b0(8)",
)


@dataclass(frozen=True)
class Solution:
    """Optimum of one batch of problems: fractions along each arc/segment and the KKT case chosen."""

    t_x: torch.Tensor  # [M] in [0, 1]: p1 = point at fraction t_x of the way from x1 to x2
    t_y: torch.Tensor  # [M] in [0, 1]
    case: torch.Tensor  # [M] int64: ARC_CASES index, or the segment solver's case number (its docstring)


def at_endpoint(t: torch.Tensor) -> torch.Tensor:
    """Bool of ``t``'s shape: the fraction along an arc or segment is at one end, the point is an embedding (the
    solver's corners and edges give 0 and 1 exactly)."""
    return (t == 0) | (t == 1)


# ----------------------------------------------------------------------------------------------------
# Arc solver on inner products (no gradient; float64)
# ----------------------------------------------------------------------------------------------------


# which of the 10 candidate cases leave the x (row 0) and y (row 1) fraction free (not at an endpoint)
_FREE_CASES = ((1, 1, 0, 0, 1, 1, 0, 0, 0, 0), (1, 1, 1, 1, 0, 0, 0, 0, 0, 0))
# the fraction (0 or 1) each of the other cases fixes (unused where the case leaves it free)
_CASE_ENDS = ((0, 0, 0, 1, 0, 0, 0, 0, 1, 1), (0, 0, 0, 0, 0, 1, 0, 1, 0, 1))


def _wrap(angle: torch.Tensor) -> torch.Tensor:
    return torch.atan2(torch.sin(angle), torch.cos(angle))


def solve_arcs(
    cx: torch.Tensor,
    sx: torch.Tensor,
    cy: torch.Tensor,
    sy: torch.Tensor,
    h: torch.Tensor,
    dtype: torch.dtype = torch.float64,
) -> Solution:
    """Solve the arc problem from inner products only.

    cx = x1.x2, sx = |x2 - cx x1| (= sin a0), likewise cy, sy; h[..., m, n] = <x_m, y_n> for m, n in {1, 2}.
    Shapes [M] and [M, 2, 2]. Runs in ``dtype`` (float64 by default) without gradient.
    """
    with torch.no_grad():
        c = torch.stack([cx, cy]).detach().to(dtype)  # [2, M]: the x arc, then the y arc
        sn = torch.stack([sx, sy]).detach().to(dtype)
        h = h.detach().to(dtype)
        deg = sn <= DEGENERATE_SIN  # no Gram-Schmidt basis: the arc is its two endpoints
        sn = sn.masked_fill(deg, 0.0)
        arc = torch.atan2(sn, c)  # arc lengths a0, b0 in [0, pi]
        sn_safe = sn.masked_fill(deg, 1.0)
        h11, h12, h21, h22 = h[..., 0, 0], h[..., 0, 1], h[..., 1, 0], h[..., 1, 1]
        # Basis inner products (eq. 2, 5): n1 = x1, n2 = (x2 - cx x1) / sx, n3 = y1, n4 = (y2 - cy y1) / sy.
        g11 = h11
        g12 = ((h12 - c[1] * h11) / sn_safe[1]).masked_fill(deg[1], 0.0)
        g21 = ((h21 - c[0] * h11) / sn_safe[0]).masked_fill(deg[0], 0.0)
        g22 = ((h22 - c[1] * h21 - c[0] * h12 + c[0] * c[1] * h11) / (sn_safe[0] * sn_safe[1])).masked_fill(
            deg[0] | deg[1], 0.0
        )
        # Case 0: top right singular vector of G = top eigenvector of G^T G (angle via atan2), u ~ G v.
        p = g11 * g11 + g21 * g21
        q = g11 * g12 + g21 * g22
        r = g12 * g12 + g22 * g22
        b_int = 0.5 * torch.atan2(2.0 * q, p - r)
        cb_int, sb_int = torch.cos(b_int), torch.sin(b_int)
        a_int = torch.atan2(g21 * cb_int + g22 * sb_int, g11 * cb_int + g12 * sb_int)
        # Cases 1-4: A cos t + B sin t is maximal at t = atan2(B, A), along each edge of the box.
        ca0, sa0 = torch.cos(arc), torch.sin(arc)
        edge = torch.atan2(
            torch.stack([g12, ca0[0] * g12 + sa0[0] * g22, g21, ca0[1] * g21 + sa0[1] * g22]),
            torch.stack([g11, ca0[0] * g11 + sa0[0] * g21, g11, ca0[1] * g11 + sa0[1] * g12]),
        )  # b at a = 0, b at a = a0 (row of G), a at b = 0, a at b = b0 (column of G)
        a0, b0 = arc[0], arc[1]
        zero = torch.zeros_like(a0)
        alphas = torch.stack([a_int, _wrap(a_int + math.pi), zero, a0, edge[2], edge[3], zero, zero, a0, a0], -1)
        betas = torch.stack([b_int, _wrap(b_int + math.pi), edge[0], edge[1], zero, b0, zero, b0, zero, b0], -1)
        free, ends = device_constant(_FREE_CASES, torch.bool, c.device), device_constant(_CASE_ENDS, dtype, c.device)
        # Fractions along each arc; a candidate is feasible when both lie in [0, 1] (constraints 6-7). A corner's or
        # an edge's fixed fraction is set, not divided out: compiled, a0 / a0 need not give exactly 1, and an
        # endpoint must stay an embedding (at_endpoint).
        arc_safe = arc.masked_fill(arc <= 0, 1.0).unsqueeze(-1)
        t_xs = torch.where(free[0], alphas / arc_safe[0], ends[0])
        t_ys = torch.where(free[1], betas / arc_safe[1], ends[1])
        tol = _ANGLE_TOL if dtype == torch.float64 else 1e-5
        feasible = (
            (t_xs >= -tol)
            & (t_xs <= 1 + tol)
            & (t_ys >= -tol)
            & (t_ys <= 1 + tol)
            & ~((free[0] & deg[0].unsqueeze(-1)) | (free[1] & deg[1].unsqueeze(-1)))
        )
        ca, sa, cb, sb = torch.cos(alphas), torch.sin(alphas), torch.cos(betas), torch.sin(betas)
        value = ca * (cb * g11.unsqueeze(-1) + sb * g12.unsqueeze(-1)) + sa * (
            cb * g21.unsqueeze(-1) + sb * g22.unsqueeze(-1)
        )  # p1 . p2 = -f (eq. 5)
        case = value.masked_fill(~feasible, -math.inf).argmax(dim=-1, keepdim=True)
        t_x = t_xs.gather(-1, case).squeeze(-1).clamp(0.0, 1.0)
        t_y = t_ys.gather(-1, case).squeeze(-1).clamp(0.0, 1.0)
        case = case.squeeze(-1)
    return Solution(t_x=t_x, t_y=t_y, case=case)


def arc_coefficients(c: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(w1, w2) with w1 x1 + w2 x2 the point at fraction t along the arc x1 -> x2 (unit x1, x2; c = x1.x2).

    Differentiable in c (t is a constant). Exact endpoints: t = 0 gives (1, 0) and t = 1 gives (0, 1).
    """
    t = t.to(c.dtype)
    sin_a0_sq = (1.0 - c * c).clamp_min(0.0)
    sin_a0 = safe_sqrt(sin_a0_sq)
    usable = sin_a0 > DEGENERATE_SIN
    sin_safe = torch.where(usable, sin_a0, torch.ones_like(sin_a0))
    a0 = torch.atan2(sin_a0, c)
    alpha = t * a0
    w2 = torch.sin(alpha) / sin_safe
    w1 = torch.cos(alpha) - c * w2  # p1 = cos(a) n1 + sin(a) n2 with n2 = (x2 - c x1) / sin(a0)
    one, zero = torch.ones_like(c), torch.zeros_like(c)
    at_start = (t == 0) | (~usable & (t < 0.5))
    at_end = (t == 1) | (~usable & (t >= 0.5))
    w1 = torch.where(at_start, one, torch.where(at_end, zero, w1))
    w2 = torch.where(at_start, zero, torch.where(at_end, one, w2))
    return w1, w2


# ----------------------------------------------------------------------------------------------------
# Segment solver (section 4.2, eq. 17-21; supplementary 4.2)
# ----------------------------------------------------------------------------------------------------


def solve_segments(
    uu: torch.Tensor, vv: torch.Tensor, uv: torch.Tensor, uw: torch.Tensor, vw: torch.Tensor, ww: torch.Tensor
) -> Solution:
    """Closest points of p1 = x1 + k1 u and p2 = y1 + k2 v, k in [0, 1]^2, with w = x1 - y1.

    f(k1, k2) = |w + k1 u - k2 v|^2 is a convex quadratic; the nine KKT cases (supplementary 4.2) are its
    stationary point, the minimiser along each edge and the corners. Float64, no gradient. ``case`` numbers them:
    0 stationary, 1 k1=0, 2 k1=1, 3 k2=0, 4 k2=1, corners (k1, k2) 5 (0,0), 6 (0,1), 7 (1,0), 8 (1,1).
    """
    with torch.no_grad():
        uu, vv, uv, uw, vw, ww = (v.detach().double() for v in (uu, vv, uv, uw, vw, ww))
        scale = (uu * vv).clamp_min(1e-300)
        det = uu * vv - uv * uv
        has_u = uu > 1e-24
        has_v = vv > 1e-24
        det_ok = det > 1e-12 * scale
        det_safe = torch.where(det_ok, det, torch.ones_like(det))
        uu_safe = torch.where(has_u, uu, torch.ones_like(uu))
        vv_safe = torch.where(has_v, vv, torch.ones_like(vv))
        zero, one = torch.zeros_like(uu), torch.ones_like(uu)
        # Case 0: grad f = 0 (eq. 21 with u = x2 - x1, v = y2 - y1, w = x1 - y1).
        k1_int = (uv * vw - vv * uw) / det_safe
        k2_int = (uu * vw - uv * uw) / det_safe
        k1s = torch.stack([k1_int, zero, one, -uw / uu_safe, (uv - uw) / uu_safe, zero, zero, one, one], dim=-1)
        k2s = torch.stack([k2_int, vw / vv_safe, (vw + uv) / vv_safe, zero, one, zero, one, zero, one], dim=-1)
        usable = torch.stack(
            [
                det_ok & has_u & has_v,
                has_v,
                has_v,
                has_u,
                has_u,
                one.bool(),
                one.bool(),
                one.bool(),
                one.bool(),
            ],
            dim=-1,
        )
        feasible = (
            usable & (k1s >= -_ANGLE_TOL) & (k1s <= 1 + _ANGLE_TOL) & (k2s >= -_ANGLE_TOL) & (k2s <= 1 + _ANGLE_TOL)
        )
        k1s, k2s = k1s.clamp(0.0, 1.0), k2s.clamp(0.0, 1.0)
        f = (
            ww.unsqueeze(-1)
            + k1s * k1s * uu.unsqueeze(-1)
            + k2s * k2s * vv.unsqueeze(-1)
            + 2 * k1s * uw.unsqueeze(-1)
            - 2 * k2s * vw.unsqueeze(-1)
            - 2 * k1s * k2s * uv.unsqueeze(-1)
        )
        f = torch.where(feasible, f, torch.full_like(f, math.inf))
        case = f.argmin(dim=-1)
        t_x = k1s.gather(-1, case.unsqueeze(-1)).squeeze(-1)
        t_y = k2s.gather(-1, case.unsqueeze(-1)).squeeze(-1)
    return Solution(t_x=t_x, t_y=t_y, case=case)


# ----------------------------------------------------------------------------------------------------
# Public row-wise API
# ----------------------------------------------------------------------------------------------------


def _check_rows(x1: torch.Tensor, x2: torch.Tensor, y1: torch.Tensor, y2: torch.Tensor, unit: bool) -> None:
    shapes = {t.shape for t in (x1, x2, y1, y2)}
    if len(shapes) != 1 or x1.dim() != 2:
        raise ValueError(f"x1, x2, y1, y2 must all have the same shape [M, D]; got {[tuple(s) for s in shapes]}")
    for name, t in (("x1", x1), ("x2", x2), ("y1", y1), ("y2", y2)):
        if not torch.isfinite(t).all():
            raise ValueError(f"{name} contains NaN or inf")
        if unit and t.shape[0] > 0:
            norms = t.detach().norm(dim=1)
            if ((norms - 1).abs() > 1e-3).any():
                raise ValueError(
                    f"{name} must be unit-norm rows (got norms in [{norms.min():.4g}, {norms.max():.4g}]); "
                    "l2-normalise first, e.g. retrieval.distances.l2_normalize"
                )


def _rowdot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a * b).sum(dim=-1)


def optimal_arc_distance(
    x1: torch.Tensor,
    x2: torch.Tensor,
    y1: torch.Tensor,
    y2: torch.Tensor,
    return_points: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Minimum Euclidean distance between a point of the arc x1 -> x2 and one of the arc y1 -> y2.

    Inputs [M, D], unit-norm rows. Returns d [M] (and p1, p2 [M, D] with ``return_points``), differentiable
    in all four inputs. Exact (KKT case analysis, see the module docstring); never NaN.
    """
    _check_rows(x1, x2, y1, y2, unit=True)
    xs = [t.detach().double() for t in (x1, x2, y1, y2)]
    cx, cy = _rowdot(xs[0], xs[1]), _rowdot(xs[2], xs[3])
    sx = (xs[1] - cx.unsqueeze(-1) * xs[0]).norm(dim=-1)  # |x2 - cx x1|: accurate for close points
    sy = (xs[3] - cy.unsqueeze(-1) * xs[2]).norm(dim=-1)
    h = torch.stack(
        [
            torch.stack([_rowdot(xs[0], xs[2]), _rowdot(xs[0], xs[3])], dim=-1),
            torch.stack([_rowdot(xs[1], xs[2]), _rowdot(xs[1], xs[3])], dim=-1),
        ],
        dim=-2,
    )
    sol = solve_arcs(cx, sx, cy, sy, h)
    p1 = _arc_point(x1, x2, sol.t_x)
    p2 = _arc_point(y1, y2, sol.t_y)
    d = safe_sqrt(((p1 - p2) ** 2).sum(dim=-1))
    return (d, p1, p2) if return_points else d


def _arc_point(x1: torch.Tensor, x2: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """Point at fraction t (constant) along the arc x1 -> x2, eq. 3, differentiable in x1, x2."""
    t = t.to(x1.dtype).unsqueeze(-1)
    c = _rowdot(x1, x2).unsqueeze(-1)
    resid = x2 - c * x1
    sin_a0 = safe_sqrt((resid * resid).sum(dim=-1, keepdim=True))
    usable = sin_a0 > DEGENERATE_SIN
    n2 = resid / torch.where(usable, sin_a0, torch.ones_like(sin_a0))
    alpha = t * torch.atan2(sin_a0, c)
    general = torch.cos(alpha) * x1 + torch.sin(alpha) * n2
    start = (t == 0) | (~usable & (t < 0.5))
    end = (t == 1) | (~usable & (t >= 0.5))
    return torch.where(start, x1, torch.where(end, x2, general))


def optimal_segment_distance(
    x1: torch.Tensor,
    x2: torch.Tensor,
    y1: torch.Tensor,
    y2: torch.Tensor,
    return_points: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Minimum distance between the segments [x1, x2] and [y1, y2] (no l2-normalisation, eq. 17-21).

    Inputs [M, D] (any norm). Returns d [M] (and p1, p2 with ``return_points``), differentiable.
    """
    _check_rows(x1, x2, y1, y2, unit=False)
    a1, a2, b1, b2 = (t.detach().double() for t in (x1, x2, y1, y2))
    u, v, w = a2 - a1, b2 - b1, a1 - b1
    sol = solve_segments(_rowdot(u, u), _rowdot(v, v), _rowdot(u, v), _rowdot(u, w), _rowdot(v, w), _rowdot(w, w))
    k1 = sol.t_x.to(x1.dtype).unsqueeze(-1)
    k2 = sol.t_y.to(x1.dtype).unsqueeze(-1)
    p1 = (1 - k1) * x1 + k1 * x2  # eq. 17
    p2 = (1 - k2) * y1 + k2 * y2
    d = safe_sqrt(((p1 - p2) ** 2).sum(dim=-1))
    return (d, p1, p2) if return_points else d


# ----------------------------------------------------------------------------------------------------
# Batched pair-of-pairs distances from a Gram matrix (used by the losses)
# ----------------------------------------------------------------------------------------------------


def pair_of_pairs_distances(
    gram: torch.Tensor,
    i: torch.Tensor,
    j: torch.Tensor,
    k: torch.Tensor,
    l: torch.Tensor,  # noqa: E741 - the paper's index name
    geometry: str = "arc",
) -> tuple[torch.Tensor, Solution]:
    """LoOp distance d_{i,j,k,l} for C combinations at once, from the Gram matrix of the batch.

    ``geometry="arc"`` expects unit-norm embeddings (gram = cosine matrix); ``"segment"`` any embeddings.
    The squared distance |p1 - p2|^2 is a quadratic form of the coefficients of p1 = w1 x_i + w2 x_j and
    p2 = v1 x_k + v2 x_l against Gram entries, so no [C, D] tensor is ever built. The optimum is solved in
    the dtype of ``gram`` (float64 in the tests; float32 is accurate enough to pick the KKT case).
    """
    if geometry not in ("arc", "segment"):
        raise ValueError(f"geometry must be 'arc' or 'segment', got {geometry!r}")
    d, t_x, t_y, case = _pair_of_pairs(gram, i, j, k, l, geometry)
    return d, Solution(t_x=t_x, t_y=t_y, case=case)


def _pair_of_pairs(
    gram: torch.Tensor, i: torch.Tensor, j: torch.Tensor, k: torch.Tensor, l: torch.Tensor, geometry: str,  # noqa: E741
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``pair_of_pairs_distances`` as plain tensors (d, t_x, t_y, case): what torch.compile fuses."""
    n = gram.shape[0]
    # Gram entries (i,j) (k,l) (i,k) (i,l) (j,k) (j,l) [+ (i,i) (j,j) (k,k) (l,l)], one flat gather.
    rows = [i, k, i, i, j, j] + ([i, j, k, l] if geometry == "segment" else [])
    cols = [j, l, k, l, k, l] + ([i, j, k, l] if geometry == "segment" else [])
    flat = torch.stack(rows) * n + torch.stack(cols)
    g = gram.reshape(-1).index_select(0, flat.reshape(-1)).view(len(rows), -1)
    cx, cy, h11, h12, h21, h22 = g[:6]
    if geometry == "arc":
        sx = safe_sqrt((1.0 - cx * cx).clamp_min(0.0))
        sy = safe_sqrt((1.0 - cy * cy).clamp_min(0.0))
        h = torch.stack([torch.stack([h11, h12], -1), torch.stack([h21, h22], -1)], -2)
        sol = solve_arcs(cx, sx, cy, sy, h, dtype=gram.dtype)
        (w1, v1), (w2, v2) = arc_coefficients(torch.stack([cx, cy]), torch.stack([sol.t_x, sol.t_y]))
        nx1 = nx2 = ny1 = ny2 = torch.ones_like(cx)  # unit norms
    else:
        nx1, nx2, ny1, ny2 = g[6:]
        gd = g.detach()
        # u = x_j - x_i, v = x_l - x_k, w = x_i - x_k
        uu = gd[7] - 2 * gd[0] + gd[6]
        vv = gd[9] - 2 * gd[1] + gd[8]
        uv = gd[5] - gd[4] - gd[3] + gd[2]
        uw = gd[0] - gd[4] - gd[6] + gd[2]
        vw = gd[3] - gd[1] - gd[2] + gd[8]
        ww = gd[6] - 2 * gd[2] + gd[8]
        sol = solve_segments(uu, vv, uv, uw, vw, ww)
        t_x, t_y = sol.t_x.to(gram.dtype), sol.t_y.to(gram.dtype)
        w1, w2, v1, v2 = 1 - t_x, t_x, 1 - t_y, t_y
    p1_sq = w1 * w1 * nx1 + w2 * w2 * nx2 + 2 * w1 * w2 * cx
    p2_sq = v1 * v1 * ny1 + v2 * v2 * ny2 + 2 * v1 * v2 * cy
    cross = w1 * (v1 * h11 + v2 * h12) + w2 * (v1 * h21 + v2 * h22)
    return safe_sqrt((p1_sq + p2_sq - 2 * cross).clamp_min(0.0)), sol.t_x, sol.t_y, sol.case


def _hardest_grid(
    gram: torch.Tensor, first: torch.Tensor, second: torch.Tensor, other_first: torch.Tensor,
    other_second: torch.Tensor, p: torch.Tensor, q: torch.Tensor, symmetric: bool, geometry: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``LoOp.hardest`` as plain tensors, what torch.compile fuses: ([Pp, Q] d_{i,j,k,l} of pair p = (first[p],
    second[p]) and q = (other_first[q], other_second[q]) at the combinations (p, q), also at (q, p) when
    ``symmetric``, zero elsewhere; the share of closest points p1, p2 that are not an embedding)."""
    d, t_x, t_y, _ = _pair_of_pairs(gram, first[p], second[p], other_first[q], other_second[q], geometry)
    synthetic = (~at_endpoint(t_x)).sum() + (~at_endpoint(t_y)).sum()
    share = synthetic.to(gram.dtype) / (2 * d.numel())
    full = gram.new_zeros(first.shape[0], other_first.shape[0])
    if symmetric:  # each problem solved once, for p < q
        return full.index_put((torch.cat([p, q]), torch.cat([q, p])), torch.cat([d, d])), share
    return full.index_put((p, q), d), share


@functools.cache
def _compiled_hardest_grid():
    """``_hardest_grid`` compiled once per process: its ~240 small kernels forward and ~130 backward (on arcs)
    become a few fused ones (on a GPU the eager form is bound by kernel launches). Compiled for the first batch's
    sizes, which a class-balanced sampler repeats (kernels of fixed sizes call ~20 % faster than dynamic ones); torch
    compiles again, with that size dynamic, the first time a size changes (a dropped sample, a filling memory)."""
    return torch.compile(_hardest_grid, dynamic=None)


# ----------------------------------------------------------------------------------------------------
# The hard-negative methods (section 3.3): the LoOp distance of every two pairs of different classes
# ----------------------------------------------------------------------------------------------------


class LoOp(HardNegativeMethod):
    """LoOp on arcs (Algorithm 1): the hardest negative of pairs p = (i, j) and q = (k, l) is d_{i,j,k,l}, the
    distance of the closest points of the arc x_i -> x_j and the arc x_k -> x_l, on unit embeddings.

    ``synthetic_negative_share``: the share of closest points p1, p2 that are not an embedding;
    ``loop_combinations``: the number of LoOp problems, C = B (B - N) / 8 (section 3.4).
    """

    geometry = "arc"
    compiled = False  # True: the solver and its grid run through torch.compile (``compile_solver``)
    unit_only = True  # Algorithm 1, step 3: unit embeddings (the segment form normalises too)
    supports_all_pairs = True
    hardest_is_distance = True
    empty_stats = {"synthetic_negative_share": 0.0, "loop_combinations": 0.0}

    def gram(self, embeddings: torch.Tensor, unit: bool) -> torch.Tensor:
        return dot_similarity_matrix(l2_normalize(embeddings))

    def compile_solver(self) -> LoOp:
        """Solve and fill the grid through torch.compile from now on: the same values, in a few fused kernels
        instead of ~240 small ones forward and ~130 backward (on arcs; on a GPU the eager form is bound by kernel
        launches); the first batch pays the compilation."""
        self.compiled = True
        return self

    def hardest(
        self, gram: torch.Tensor, pairs: PositivePairs, negative: torch.Tensor, rows: object | None, *,
        columns: PositivePairs | None = None, combinations: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, dict[str, Stat]]:
        """[Pp, Q] matrix of d_{i,j,k,l} (zero where ``negative`` is False): against the positive pairs
        themselves (symmetric, each problem solved once) or against every pair of ``columns``; one problem per
        entry of ``combinations``."""
        if combinations is None:
            raise ValueError("LoOp solves the pairs of pairs it is given: pass combinations (pair_terms does)")
        p, q = combinations
        if p.numel() == 0:  # no pair of pairs of different classes (a shape: known on the host)
            return gram.new_zeros(negative.shape), dict(self.empty_stats)
        others = pairs if columns is None else columns
        kernel = _compiled_hardest_grid() if self.compiled else _hardest_grid
        full, share = kernel(gram, pairs.first, pairs.second, others.first, others.second, p, q, columns is None,
                             self.geometry)
        return full, {"synthetic_negative_share": share.detach(), "loop_combinations": float(p.numel())}


class LoOpLinear(LoOp):
    """LoOp on line segments (section 4.2, eq. 17-21): the closest points of the segments [x_i, x_j] and
    [x_k, x_l] of the unit embeddings."""

    geometry = "segment"
