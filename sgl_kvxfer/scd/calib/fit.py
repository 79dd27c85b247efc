"""Closed-form Reuse fits: joint subspace (SVD) + ridge encoder + per-consumer ridge decoders.

For one group (a (layer, kv head) of K or V, or a layer's normalized hidden states) the samples
are rows x = [a | b_1 | ... | b_N]: the producer's vector a and each consumer's b_i for the same
token (keys de-rotated). Everything is computed from streamed moments (mean and covariance of
x), so calibration never holds the raw traces:

    joint SVD    C = cov(x) = V diag(s) V^T;  latent z = (x - mu) V_r       (top r directions)
    encoder      W = argmin |A_c W - Z|^2 + lam |W|^2 = (C_aa + lam I)^-1 C_a: V_r      [d, r]
    decoder i    D_i = argmin |Zhat D - B_i,c|^2 + lam' |D|^2,  Zhat = A_c W   (the code the
                 consumer actually receives) = (W^T C_aa W + lam' I)^-1 W^T C_ab_i      [r, d]

N = 1 is the paper's pairwise case (X = [A B]). With N > 1 one latent serves every consumer,
so the producer encodes once; each consumer keeps only its own decoder.

Nested ranks: column j of W depends only on direction j of V (the ridge solve is per column),
so the rank-r' encoder is the first r' columns of the rank-r one: a code at rank r' is a prefix
of the code at rank r. The decoder of a lower rank is refitted from the codes it receives
(`levels`): a producer encodes once at the top rank and may send any prefix. lam = ridge * mean
eigenvalue of the Gram it regularizes (scale-free).

Unit codes (`unit_codes=True`): column j of W is divided by the std of code j on the calibration
data (sqrt of diag W^T C_aa W), and the decoders are fitted from those scaled codes, so float codes
decode to the same K/V up to the ridge's share. It is meant for a quantised wire (int8 / int4,
one scale per token and field: mem_cache/scd_quant.py): the principal columns' variance falls by orders
of magnitude across a field, so one scale set by the leading columns rounds the tail columns to
zero; with every column at unit variance each gets the same share of the grid. Under the
uniform-noise model of rounding that minimises the decoded error for a shared per-token step:
column j scaled by 1 / c_j (std sigma_j) decodes with error ~ sum_j c_j^2 max_i(sigma_i / c_i)^2
>= sum_j sigma_j^2, equal at c_j = sigma_j. Scaling a column keeps the nesting (a prefix of the code is still the
lower rank's code).

Where it runs: the eigendecompositions and solves run in float64 on the moments' device (or
`device`): cuSOLVER on a GPU, where a few hundred M x M problems take seconds; LAPACK on a CPU,
which a host shared with other jobs can slow by orders of magnitude (thread oversubscription).
Eigenvector signs are canonical (each direction's largest-magnitude entry positive), so both
give the same encoder, not one up to column signs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


NULL_TOL = 1e-7  # eigenvalues below this fraction of the largest count as zero


class JointMoments:
    """Streaming sums of x [G, n, M] (G groups of M = blocks * width features) in float64."""

    def __init__(self, groups: int, width: int, blocks: int, device="cpu"):
        self.width, self.blocks = width, blocks
        m = width * blocks
        self.n = 0
        self.s1 = torch.zeros(groups, m, dtype=torch.float64, device=device)
        self.s2 = torch.zeros(groups, m, m, dtype=torch.float64, device=device)

    def update(self, x: torch.Tensor) -> None:
        """x [G, n, M] (any float dtype)."""
        x = x.to(self.s1.device, torch.float64)
        self.n += x.shape[1]
        self.s1 += x.sum(1)
        self.s2 += x.transpose(1, 2) @ x

    def mean_cov(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.n < 2:
            raise ValueError("JointMoments needs at least 2 samples")
        mu = self.s1 / self.n
        return mu, self.s2 / self.n - mu[:, :, None] * mu[:, None, :]

    def state(self, prefix: str) -> dict[str, torch.Tensor]:
        return {f"{prefix}.s1": self.s1, f"{prefix}.s2": self.s2,
                f"{prefix}.n": torch.tensor([self.n, self.width, self.blocks], dtype=torch.float64)}

    @classmethod
    def from_state(cls, state: dict, prefix: str) -> "JointMoments":
        n, width, blocks = (int(x) for x in state[f"{prefix}.n"].tolist())
        jm = cls(state[f"{prefix}.s1"].shape[0], width, blocks, state[f"{prefix}.s1"].device)
        jm.s1, jm.s2, jm.n = state[f"{prefix}.s1"].double(), state[f"{prefix}.s2"].double(), n
        return jm


@dataclass
class JointFit:
    enc: torch.Tensor  # [G, d, r]  float32
    mu_a: torch.Tensor  # [G, d]
    dec: list[torch.Tensor]  # per consumer [G, r, d]
    mu_b: list[torch.Tensor]  # per consumer [G, d]
    rel_err: list[torch.Tensor]  # per consumer [G]: E|b - b_hat|^2 / E|b - mu_b|^2 on the fit data
    dec_at: dict = None  # lower rank r' -> per consumer [G, r', d] (decoders of the code's prefix)
    rel_err_at: dict = None  # lower rank r' -> per consumer [G]


def _ridge_solve(gram: torch.Tensor, rhs: torch.Tensor, ridge: float) -> torch.Tensor:
    """(gram + lam I)^-1 rhs, batched; lam = ridge * trace(gram) / dim (at least a tiny floor)."""
    dim = gram.shape[-1]
    lam = ridge * gram.diagonal(dim1=-2, dim2=-1).mean(-1).clamp(min=1e-30)
    eye = torch.eye(dim, dtype=gram.dtype, device=gram.device)
    return torch.linalg.solve(gram + lam[:, None, None] * eye, rhs)


def _canonical_signs(v: torch.Tensor) -> torch.Tensor:
    """v [G, M, r] with each column's largest-magnitude entry made positive (LAPACK and cuSOLVER
    may return any sign per eigenvector)."""
    peak = v.gather(-2, v.abs().argmax(-2, keepdim=True))  # [G, 1, r]
    return v * torch.where(peak < 0, -1.0, 1.0).to(v.dtype)


def fit_joint(moments: JointMoments, rank: int, ridge: float = 1e-4, levels=(), device=None,
              unit_codes: bool = False) -> JointFit:
    """Fit encoder / decoders of rank `rank` for every group, and decoders of each lower rank in
    `levels` for the first columns of the same encoder (see the module docstring). Runs on
    `device` (default: the moments' device); the fit's tensors are on that device. unit_codes:
    every code column at unit variance on the calibration data (the module docstring)."""
    mu, cov = moments.mean_cov()
    dev = torch.device(device) if device is not None else cov.device
    mu, cov = mu.to(dev), cov.to(dev)
    d, blocks = moments.width, moments.blocks
    if not 1 <= rank <= d:
        raise ValueError(f"rank must be in [1, {d}], got {rank}")
    evals, evecs = torch.linalg.eigh(cov)  # ascending
    v_r = _canonical_signs(evecs[..., -rank:].flip(-1))  # [G, M, r]
    # NOTE: directions of (numerically) zero variance carry no signal but, with a small ridge, get
    # decoder rows that amplify float32 code noise ~1/lam: zero them (an exact zero code + row).
    live = evals[..., -rank:].flip(-1) > NULL_TOL * evals[..., -1:].clamp(min=1e-300)
    v_r = v_r * live[:, None, :]
    c_aa = cov[:, :d, :d]
    enc = _ridge_solve(c_aa, cov[:, :d, :] @ v_r, ridge)  # [G, d, r]
    if unit_codes:
        var = (enc * (c_aa @ enc)).sum(-2)  # diag of the code's covariance W^T C_aa W, [G, r]
        # a dead column (zeroed above) stays zero: its scale is 1, not 1 / 0
        enc = enc / torch.where(var > 0, var, torch.ones_like(var)).sqrt()[:, None, :]
    decs, mus, errs = _decoders(enc, cov, mu, d, blocks, ridge)
    dec_at, err_at = {}, {}
    for r in sorted(set(levels)):
        if not 1 <= r < rank:
            raise ValueError(f"a nested rank must be in [1, {rank}), got {r}")
        dec_at[r], _, err_at[r] = _decoders(enc[..., :r], cov, mu, d, blocks, ridge)
    return JointFit(enc.float(), mu[:, :d].float(), decs, mus, errs, dec_at, err_at)


def _decoders(enc, cov, mu, d: int, blocks: int, ridge: float):
    """Per consumer block: ridge decoder from the received code, its mean and fit error."""
    c_aa = cov[:, :d, :d]
    s = enc.transpose(1, 2) @ c_aa @ enc  # cov of the received code [G, r, r]
    decs, mus, errs = [], [], []
    for i in range(1, blocks):
        sl = slice(i * d, (i + 1) * d)
        rhs = enc.transpose(1, 2) @ cov[:, :d, sl]  # [G, r, d]
        dec = _ridge_solve(s, rhs, ridge)
        c_bb = cov[:, sl, sl]
        tr_bb = c_bb.diagonal(dim1=-2, dim2=-1).sum(-1)
        # E|b - bhat|^2 = tr C_bb - 2 tr(D^T W^T C_ab) + tr(D^T S D)
        err = tr_bb - 2 * (dec * rhs).sum((-2, -1)) + (dec * (s @ dec)).sum((-2, -1))
        decs.append(dec.float())
        mus.append(mu[:, sl].float())
        errs.append((err / tr_bb.clamp(min=1e-30)).float())
    return decs, mus, errs
