"""The retrofit's losses and initialisations: a student (a FusedKV / Lite LM holding the teacher's
weights) learns to reproduce its teacher (the original model).

    source_search        the pair of storage layers whose K/V best explain the top half's
                         (least squares over every pair at once, from one set of statistics)
    lstsq_fusion_init    fusion weights fitted to the teacher's own K/V by least squares
    AttentionMatcher     attention-output matching, layer by layer: each reconstruction layer's
                         q_proj, o_proj and fusion weights learn to give the teacher's attention
                         output from the teacher's input to that layer, over K/V rebuilt from the
                         teacher's source layers (all layers at once, one teacher forward a batch)
    distill_loss         KL(teacher || student) on next-token distributions + hidden_weight x the
                         relative squared error of every layer's residual stream

The teacher runs under no_grad; the student's autocast dtype follows the caller.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from sgl_kvxfer.fusedkv.model import LM, attend
from sgl_kvxfer.models.fusedkv_math import FusionLstsq


def kl_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of KL(teacher || student), fp32."""
    t = F.log_softmax(teacher_logits.float(), -1)
    s = F.log_softmax(student_logits.float(), -1)
    return (t.exp() * (t - s)).sum(-1).mean()


def hidden_loss(student_hidden: list, teacher_hidden: list) -> torch.Tensor:
    """Mean over layers of ||h_s - h_t||^2 / ||h_t||^2 (each layer's residual stream)."""
    terms = [(s.float() - t.float()).pow(2).sum() / t.float().pow(2).sum().clamp_min(1e-12)
             for s, t in zip(student_hidden, teacher_hidden)]
    return torch.stack(terms).mean()


_COMPILED: dict = {}


def _compiled(fn):
    """fn under torch.compile, one compiled wrapper per function for the process."""
    if fn not in _COMPILED:
        _COMPILED[fn] = torch.compile(fn)
    return _COMPILED[fn]


def distill_loss(student: LM, teacher: LM, ids: torch.Tensor, hidden_weight: float,
                 compiled: bool = False) -> tuple[torch.Tensor, dict]:
    """(loss, {"kl", "hidden"}) of one batch ids [B, T]. compiled: the two losses under
    torch.compile (the KL's log-softmaxes over the vocabulary fuse into a few passes)."""
    kl_fn, hidden_fn = (_compiled(kl_loss), _compiled(hidden_loss)) if compiled else (kl_loss, hidden_loss)
    t_hidden: list = []
    with torch.no_grad():
        t_logits = teacher(ids, hidden_out=t_hidden if hidden_weight else None)
    s_hidden: list = []
    s_logits = student(ids, hidden_out=s_hidden if hidden_weight else None)
    kl = kl_fn(s_logits, t_logits)
    if not hidden_weight:
        return kl, {"kl": kl.detach(), "hidden": torch.zeros(())}
    h = hidden_fn(s_hidden, t_hidden)
    return kl + hidden_weight * h, {"kl": kl.detach(), "hidden": h.detach()}


def _key_pairs(k: torch.Tensor) -> torch.Tensor:
    """[..., T, H, D] post-RoPE keys -> [..., 2T, H, D/2]: a rotary pair's two channels (j, j + D/2)
    as two samples of one weight (the RoPE pair constraint, models/fusedkv_math.py)."""
    h = k.shape[-1] // 2
    return torch.cat([k[..., :h], k[..., h:]], dim=-3)


@torch.no_grad()
def source_search(teacher: LM, calib: torch.Tensor, batch: int, autocast, num_storage: int,
                  variant: str) -> dict:
    """Score source layers by how well they explain the top half's K and V on calib windows.

    Per reconstruction layer i and candidate source pair (j, l), the least-squares fit of the
    FusedKV form  y_i ~ w_j * x_j + w_l * x_l  (one weight per value channel, per key rotary pair)
    leaves a relative squared error e_i(j, l); a pair's score is the mean over i of (e_K + e_V) / 2.
    All pairs come from one pass: the Gram sums G[j, l] = sum x_j x_l, R[i, j] = sum y_i x_j and
    Y[i] = sum y_i^2 per channel (float64). FusedKV takes the best pair; Lite, which has no
    weights, the single layers that explain K and V best (scaled fits: q_proj / o_proj can absorb
    a scale). Returns {"sources": (s0, s1), "scores": ..., "paper": the (0, n-1) pair's score}."""
    n, L = num_storage, teacher.config.num_layers
    dev = next(teacher.parameters()).device
    stats = {}
    for j in range(0, calib.shape[0], batch):
        with autocast():
            _, kv = teacher(calib[j:j + batch, :-1].to(dev), return_kv=True)
        for which, xs in (("k", [_key_pairs(kv[i][0].double()).flatten(0, 1) for i in range(L)]),
                          ("v", [kv[i][1].double().flatten(0, 1) for i in range(L)])):
            X = torch.stack(xs)  # [L, S, H, C]
            G = torch.einsum("jshc,lshc->jlhc", X[:n], X[:n])
            R = torch.einsum("ishc,jshc->ijhc", X[n:], X[:n])
            Y = X[n:].pow(2).sum(1)
            if which in stats:
                G0, R0, Y0 = stats[which]
                G, R, Y = G0 + G, R0 + R, Y0 + Y
            stats[which] = (G, R, Y)
    rel = {}
    for which, (G, R, Y) in stats.items():
        j, l = torch.triu_indices(n, n, offset=0, device=G.device)
        gjj, gjl, gll = G[j, j], G[j, l], G[l, l]  # [P, H, C]
        lam = 1e-6 * (gjj + gll).clamp_min(1e-30) / 2
        a, b, d = gjj + lam, gjl, gll + lam
        single = j == l
        b = torch.where(single[:, None, None], torch.zeros_like(b), b)  # j == l: one source, one weight
        d = torch.where(single[:, None, None], torch.ones_like(d), d)
        det = a * d - b * b
        rj, rl = R[:, j], R[:, l]  # [I, P, H, C]
        rl = torch.where(single[None, :, None, None], torch.zeros_like(rl), rl)
        wj, wl = (d * rj - b * rl) / det, (a * rl - b * rj) / det
        res = Y[:, None] - wj * rj - wl * rl  # [I, P, H, C]
        rel[which] = (res.sum((2, 3)) / Y.sum((1, 2))[:, None]).clamp_min(0).mean(0)  # [P]
    pairs = list(zip(j.tolist(), l.tolist()))
    k_err = {p: float(rel["k"][i]) for i, p in enumerate(pairs)}
    v_err = {p: float(rel["v"][i]) for i, p in enumerate(pairs)}
    if variant == "lite":  # K from s1, V from s0, each alone
        best = (min(range(n), key=lambda x: v_err[(x, x)]), min(range(n), key=lambda x: k_err[(x, x)]))
        score = lambda p: (k_err[(p[1], p[1])] + v_err[(p[0], p[0])]) / 2  # noqa: E731
    else:
        score = lambda p: (k_err[p] + v_err[p]) / 2  # noqa: E731
        best = min((p for p in pairs if p[0] != p[1]), key=score)
    return {"sources": list(best), "score": score(best), "paper_pair_score": score((0, n - 1)),
            "k_rel_err": {f"{a},{b}": e for (a, b), e in k_err.items()},
            "v_rel_err": {f"{a},{b}": e for (a, b), e in v_err.items()}}


@torch.no_grad()
def lstsq_fusion_init(teacher: LM, student: LM, calib: torch.Tensor, batch: int, autocast) -> dict:
    """Fit every reconstruction layer's fusion weights to the teacher's K/V on calib windows
    [N, T + 1]; returns the fit's relative squared error of K and V per layer (first batch)."""
    fk = student.config.fusedkv
    s0, s1 = fk.source_layers
    fits = {i: FusionLstsq() for i in fk.reconstruction_layers}
    dev = next(student.parameters()).device
    first = None
    for j in range(0, calib.shape[0], batch):
        with autocast():
            _, kv = teacher(calib[j:j + batch, :-1].to(dev), return_kv=True)
        flat = {layer: (k.float().flatten(0, 1), v.float().flatten(0, 1)) for layer, (k, v) in kv.items()}
        first = first or kv
        for i, fit in fits.items():
            fit.update(flat[s0][0], flat[s1][0], flat[i][0], flat[s0][1], flat[s1][1], flat[i][1])
    resid = {}
    for i, fit in fits.items():
        kp, vw = fit.solve()
        fusion = student.model.layers[i].self_attn.kv_fusion
        fusion.key_pair_weight.copy_(kp.to(dev))
        fusion.value_weight.copy_(vw.to(dev))
        k, v = fusion(first[s0][0].float(), first[s1][0].float(), first[s0][1].float(), first[s1][1].float())
        rel = lambda x, y: float((x - y).pow(2).sum() / y.pow(2).sum().clamp_min(1e-30))  # noqa: E731
        resid[i] = {"k_rel_sq_err": rel(k, first[i][0].float()), "v_rel_sq_err": rel(v, first[i][1].float())}
    return resid


class AttentionMatcher:
    """Attention-output matching of every reconstruction layer against the teacher, layer-local:
    layer i's loss is ||attn_i^student(x_i) - attn_i^teacher(x_i)||^2 / ||attn_i^teacher(x_i)||^2
    with x_i the teacher's input to layer i's attention and the student's K/V rebuilt from the
    TEACHER's source layers, so every layer learns at once from one teacher forward, and no
    layer's error feeds another's. Trains q_proj, o_proj (and kv_fusion) of those layers."""

    def __init__(self, teacher: LM, student: LM):
        self.teacher, self.student = teacher, student
        self.layers = [i for i in range(student.config.num_layers) if not student.config.stores(i)]
        self._seen: dict[int, tuple] = {}
        self._hooks = [teacher.model.layers[i].self_attn.register_forward_hook(self._capture(i))
                       for i in self.layers]
        self._armed = False

    def _capture(self, layer: int):
        def hook(module, args, out):
            if self._armed:
                self._seen[layer] = (args[0].detach(), out.detach())
        return hook

    def parameters(self) -> tuple[list, list]:
        """(q_proj + o_proj weights, fusion weights) of the reconstruction layers."""
        mats, fusion = [], []
        for i in self.layers:
            a = self.student.model.layers[i].self_attn
            mats += [a.q_proj.weight, a.o_proj.weight]
            if hasattr(a, "kv_fusion"):
                fusion += list(a.kv_fusion.parameters())
        return mats, fusion

    def loss(self, ids: torch.Tensor) -> torch.Tensor:
        """Mean over reconstruction layers of the relative squared error (differentiable in the
        student's parameters)."""
        self._armed, self._seen = True, {}
        try:
            with torch.no_grad():
                _, kv = self.teacher(ids, return_kv=True)
        finally:
            self._armed = False
        cos, sin = self.student.rotary(ids.shape[1], ids.device, kv[0][0].dtype)
        terms = []
        for i in self.layers:
            x, want = self._seen[i]
            a = self.student.model.layers[i].self_attn
            k, v = a.rebuilt_kv(kv)
            got = a.o_proj(attend(a.query(x, cos, sin), k, v))
            terms.append((got.float() - want.float()).pow(2).sum() / want.float().pow(2).sum().clamp_min(1e-12))
        return torch.stack(terms).mean()

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
