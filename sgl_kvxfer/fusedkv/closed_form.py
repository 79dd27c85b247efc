"""Closed-form start of a FusedKV retrofit: the reconstruction layers' fusion weights, q_proj and
o_proj fitted from calibration activations by least squares, so that step 0 already reproduces
most of the teacher's attention.

Keys (RoPE-aware). Write a rotary pair (channels j, j + D/2 of our half-split RoPE) as one complex
number z = k_j + i k_{j+D/2}; RoPE multiplies it by e^{i theta t}. The engine's key weight is one
REAL weight per pair (models/fusedkv_math.py). A complex weight c per pair also commutes with RoPE,
and it can live in q_proj: if K_i ~ c (a0 K_s0 + a1 K_s1) per pair, then
q . K_i = Re(conj(q) c K~) = Re(conj(conj(c) q) K~), so multiplying the layer's queries by conj(c)
(a 2x2 rotation-scale of each pair of q_proj's rows, per query head of the kv group) gives the
same scores over the fused keys K~. Per (layer, kv head, pair), with x0, x1, y the complex
samples of the sources and the target over calibration tokens:

    min over a real (2), phase phi:  || e^{-i phi} y - a0 x0 - a1 x1 ||^2
      r(phi) = Re(e^{-i phi} Z) = Zr u,  Zr = [Re z, Im z] (z_j = sum conj(x_j) y),  u = (cos, sin)
      residual = ||y||^2 - u' Zr' G^-1 Zr u   (G = Re of the 2x2 Gram of x0, x1)
      -> u: the top eigenvector of Zr' G^-1 Zr;  a = G^-1 Zr u;  c = u0 + i u1

Since c is a pure rotation and the fit is in complex numbers, fitting on pre- or post-RoPE keys
gives the same weights (RoPE rotates x0, x1 and y of one token by the same angle).

Values. Per (layer, kv head): V_i ~ (b0 * V_s0 + b1 * V_s1) M with b the engine's per-channel
value weights and M a D x D matrix. M commutes with attention (softmax weights act on tokens) and
would fold into o_proj; alternating least squares on the [V_s0, V_s1, V_i] covariance gives b.

o_proj. Given the fused K/V and the rotated q_proj, each reconstruction layer's o_proj is refitted
to the teacher's attention output, from the teacher's input to that layer: one linear regression
(ridge) of the teacher's output on the student's per-head attention outputs, which subsumes M.

The teacher runs under no_grad; statistics are float64; weights are written in float32.
"""
from __future__ import annotations

import torch

from sgl_kvxfer.fusedkv.model import LM, attend


def as_complex_pairs(k: torch.Tensor) -> torch.Tensor:
    """[..., D] (half-split rotary layout) -> complex128 [..., D/2]: pair j is k_j + i k_{j+D/2}."""
    h = k.shape[-1] // 2
    return torch.complex(k[..., :h].double(), k[..., h:].double())


def _ridge(g: torch.Tensor, ridge: float) -> torch.Tensor:
    """g [..., n, n] + ridge x (trace / n) x I (dead channels stay finite)."""
    n = g.shape[-1]
    lam = ridge * torch.diagonal(g, dim1=-2, dim2=-1).mean(-1).clamp_min(1e-30)
    return g + lam[..., None, None] * torch.eye(n, dtype=g.dtype, device=g.device)


class KeyPairStats:
    """Streaming statistics of the rotation-aware key fit of one target from two sources:
    per [Hkv, D/2] the real 2x2 Gram G, the complex cross sums z [2] and ||y||^2."""

    def __init__(self):
        self.G = self.z = self.Y = None

    def update(self, k0: torch.Tensor, k1: torch.Tensor, y: torch.Tensor) -> None:
        """k0, k1, y [..., Hkv, D] keys (pre- or post-RoPE, all alike), any leading token dims."""
        x = torch.stack([as_complex_pairs(k0), as_complex_pairs(k1)], -1).flatten(0, -4)  # [S, H, P, 2]
        t = as_complex_pairs(y).flatten(0, -3)  # [S, H, P]
        G = torch.einsum("shpa,shpb->hpab", x.conj(), x).real
        z = torch.einsum("shpa,shp->hpa", x.conj(), t)
        Y = t.abs().pow(2).sum(0)
        if self.G is None:
            self.G, self.z, self.Y = G, z, Y
        else:
            self.G, self.z, self.Y = self.G + G, self.z + z, self.Y + Y

    def solve(self, ridge: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> (a [2, Hkv, D/2] real weights, c [Hkv, D/2] unit complex, residual [Hkv, D/2])."""
        G = _ridge(self.G, ridge)
        Zr = torch.stack([self.z.real, self.z.imag], -1)  # [H, P, 2 (sources), 2 (re, im)]
        GiZ = torch.linalg.solve(G, Zr)
        B = Zr.transpose(-1, -2) @ GiZ  # [H, P, 2, 2] symmetric PSD
        evals, evecs = torch.linalg.eigh(B)
        u = evecs[..., -1]  # [H, P, 2]
        a = (GiZ @ u[..., None])[..., 0]  # [H, P, 2]
        return (a.permute(2, 0, 1).float(), torch.complex(u[..., 0], u[..., 1]),
                (self.Y - evals[..., -1]).clamp_min(0))


def fold_query_rotation(q_weight: torch.Tensor, c: torch.Tensor, num_heads: int) -> torch.Tensor:
    """q_proj weight [Hq * D, hidden] with each query head's pair rows multiplied by conj(c) of its
    kv group (c [Hkv, D/2] complex): q' = conj(c) q per pair, which commutes with RoPE."""
    Hkv, P = c.shape
    w = q_weight.double().view(num_heads, 2, P, -1)  # [Hq, (re, im), P, hidden]
    cc = c.repeat_interleave(num_heads // Hkv, 0)[..., None]  # [Hq, P, 1]; GQA: head h -> group h // group_size
    re, im = w[:, 0], w[:, 1]
    # conj(c) (re + i im) = (cr re + ci im) + i (cr im - ci re)
    new = torch.stack([cc.real * re + cc.imag * im, cc.real * im - cc.imag * re], 1)
    return new.reshape(q_weight.shape).to(q_weight.dtype)


class ValueCov:
    """Streaming covariance of [V_s0, V_s1, V_i] per kv head: [Hkv, 3D, 3D] float64."""

    def __init__(self):
        self.S = None

    def update(self, v0: torch.Tensor, v1: torch.Tensor, y: torch.Tensor) -> None:
        z = torch.cat([v0, v1, y], -1).double().flatten(0, -3)  # [S, H, 3D]
        S = torch.einsum("sha,shb->hab", z, z)
        self.S = S if self.S is None else self.S + S

    def solve(self, iters: int = 8, ridge: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Alternating least squares of V_i ~ (b0 * V_s0 + b1 * V_s1) M -> (b [2, Hkv, D] float32,
        residual sum of squares [Hkv], target sum of squares [Hkv]). Starts from b = 1."""
        D = self.S.shape[-1] // 3
        Suu, Sui, Sii = self.S[:, :2 * D, :2 * D], self.S[:, :2 * D, 2 * D:], self.S[:, 2 * D:, 2 * D:]
        H = Suu.shape[0]
        beta = torch.ones(H, 2 * D, dtype=Suu.dtype, device=Suu.device)
        idx = torch.arange(2 * D, device=Suu.device) % D

        def bcat(beta):  # [H, D, 2D]: [diag(b0), diag(b1)]
            out = torch.zeros(H, D, 2 * D, dtype=beta.dtype, device=beta.device)
            out[:, idx, torch.arange(2 * D, device=beta.device)] = beta
            return out

        def m_step(beta):
            Bc = bcat(beta)
            cov = Bc @ Suu @ Bc.transpose(1, 2)
            return torch.linalg.solve(_ridge(cov, ridge), Bc @ Sui), Bc

        for _ in range(iters):
            M, _ = m_step(beta)
            MMt = M @ M.transpose(1, 2)  # [H, D, D]
            Q = Suu * MMt[:, idx][:, :, idx]
            r = (Sui @ M.transpose(1, 2)).gather(2, idx[None, :, None].expand(H, 2 * D, 1))[..., 0]  # [H, 2D]
            beta = torch.linalg.solve(_ridge(Q, ridge), r[..., None])[..., 0]
            beta = beta / beta.abs().mean(-1, keepdim=True).clamp_min(1e-30)  # a per-channel scale moves into M
        M, Bc = m_step(beta)
        cross = torch.einsum("hab,hab->h", M, Bc @ Sui)
        quad = torch.einsum("hab,hab->h", M, Bc @ Suu @ Bc.transpose(1, 2) @ M)
        tr = torch.diagonal(Sii, dim1=-2, dim2=-1).sum(-1)
        return beta.view(H, 2, D).permute(1, 0, 2).float(), (tr - 2 * cross + quad).clamp_min(0), tr


@torch.no_grad()
def fit_fusion_and_queries(teacher: LM, student: LM, calib: torch.Tensor, batch: int, autocast,
                           ridge: float = 1e-6) -> dict:
    """Pass 1: key weights + query rotations, value weights, for every reconstruction layer of the
    student (whose sources are set). Returns per layer the key / value relative squared errors
    (key: of the rotation-aware fit; value: of (b, M))."""
    fk, c = student.config.fusedkv, student.config
    s0, s1 = fk.source_layers
    keys = {i: KeyPairStats() for i in fk.reconstruction_layers}
    vals = {i: ValueCov() for i in fk.reconstruction_layers}
    dev = next(student.parameters()).device
    for j in range(0, calib.shape[0], batch):
        with autocast():
            _, kv = teacher(calib[j:j + batch, :-1].to(dev), return_kv=True)
        for i in keys:
            keys[i].update(kv[s0][0], kv[s1][0], kv[i][0])
            vals[i].update(kv[s0][1], kv[s1][1], kv[i][1])
    out = {}
    for i in keys:
        a, rot, res = keys[i].solve(ridge)
        b, v_res, v_tot = vals[i].solve(ridge=ridge)
        attn = student.model.layers[i].self_attn
        attn.kv_fusion.key_pair_weight.copy_(a.to(dev))
        attn.kv_fusion.value_weight.copy_(b.to(dev))
        attn.q_proj.weight.copy_(fold_query_rotation(attn.q_proj.weight, rot.to(dev), c.num_heads))
        out[i] = {"k_rel_sq_err": float(res.sum() / keys[i].Y.sum().clamp_min(1e-30)),
                  "v_rel_sq_err": float(v_res.sum() / v_tot.sum().clamp_min(1e-30))}
    return out


class _Stop(Exception):
    pass


class _LayerTap:
    """One layer of an LM, tapped for one forward: the residual stream entering the block, the
    attention's (normalized) input and its output; the forward stops there."""

    def __init__(self, lm: LM, layer: int):
        self.lm, self.block = lm, lm.model.layers[layer]
        self.seen: dict[str, torch.Tensor] = {}

    def _pre(self, module, args):
        self.seen["h"] = args[0].detach()

    def _attn(self, module, args, out):
        self.seen["x"], self.seen["out"] = args[0].detach(), out.detach()
        raise _Stop

    def run(self, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        self.seen = {}
        hooks = [self.block.register_forward_pre_hook(self._pre), self.block.self_attn.register_forward_hook(self._attn)]
        try:
            self.lm(ids)
        except _Stop:
            pass
        finally:
            for h in hooks:
                h.remove()
        return self.seen


@torch.no_grad()
def fit_output_projections(teacher: LM, student: LM, calib: torch.Tensor, batch: int, autocast,
                           ridge: float = 1e-4, sequential: bool | str = False) -> dict:
    """Pass 2: each reconstruction layer's o_proj by ridge regression of a target attention output
    on the student's per-head attention outputs (its q_proj and fused K/V).

        sequential=False       layer-local: the teacher's input to the layer, the teacher's
                               attention output as the target (the default)
        sequential=True        layers in order, each from the STUDENT's own input to it (earlier
                               layers already refitted), the teacher's attention output as target
        sequential="residual"  as True, the target being what makes the student's residual
                               stream after the attention equal the teacher's (teacher attention
                               output + teacher residual - student residual)

    Returns per layer the relative squared error against the teacher's attention output before
    the refit and against the target after it (calibration windows)."""
    fk = student.config.fusedkv
    dev = next(student.parameters()).device
    out = {}
    for i in fk.reconstruction_layers:
        t_tap, s_tap = _LayerTap(teacher, i), _LayerTap(student, i)
        AtA = AtY = 0
        YtY = before = 0.0
        a = student.model.layers[i].self_attn
        for j in range(0, calib.shape[0], batch):
            ids = calib[j:j + batch, :-1].to(dev)
            with autocast():
                _, kv = teacher(ids, return_kv=True)  # the storage layers are the student's too
                t = t_tap.run(ids)
                s = s_tap.run(ids) if sequential else t
                cos, sin = student.rotary(ids.shape[1], ids.device, kv[0][0].dtype)
                k, v = a.rebuilt_kv(kv)
                A = attend(a.query(s["x"], cos, sin), k, v).double().flatten(0, 1)
            want = t["out"].double().flatten(0, 1)
            Y = want + (t["h"].double() - s["h"].double()).flatten(0, 1) if sequential == "residual" else want
            before += float((A @ a.o_proj.weight.double().T - want).pow(2).sum())
            AtA, AtY = AtA + A.T @ A, AtY + A.T @ Y
            YtY += float(Y.pow(2).sum())
        W = torch.linalg.solve(_ridge(AtA, ridge), AtY)  # [Hq*D, hidden]
        after = YtY - 2 * float((W * AtY).sum()) + float((W * (AtA @ W)).sum())
        student.model.layers[i].self_attn.o_proj.weight.copy_(W.T.float())
        out[i] = {"o_rel_sq_err_before": before / max(YtY, 1e-30), "o_rel_sq_err": max(after, 0.0) / max(YtY, 1e-30)}
    return out


def closed_form_init(teacher: LM, student: LM, calib: torch.Tensor, batch: int, autocast) -> dict:
    """Both passes; per layer {k_rel_sq_err, v_rel_sq_err, o_rel_sq_err_before, o_rel_sq_err}."""
    first = fit_fusion_and_queries(teacher, student, calib, batch, autocast)
    second = fit_output_projections(teacher, student, calib, batch, autocast)
    return {i: {**first[i], **second[i]} for i in first}
