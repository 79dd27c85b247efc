"""Token importance for SpectrumKV (paper Sec. 4.3, Eq. 13): I_j = A_j * exp(-lambda * Delta_j).

Positions are 0-based, j in [0, n). Delta_j = (n - 1) - j, so the last prompt token has
Delta = 0 (the paper's 1-based j = n).

A_j, attention definition (`ImportanceAccumulator`): the mean attention probability that key j
receives over every row in

    layers  : every layer fed through add_layer (all layers of the model)
    heads   : every *query* head (GQA: query head h reads kv head h // (Hq // Hkv))
    queries : the observation window, the last W prompt positions [n - W, n) (W=None: all)

Each row is a causal softmax (keys <= query position) with scale 1/sqrt(D) unless given, so every
row sums to 1 and A sums to 1 over the n keys. Rows are pooled with equal weight; A is that sum
divided by the number of rows. The paper says only "an observed or approximated attention-
importance statistic" aggregated "over layers, heads, and ... observations"; the window stands in
for the decode queries, which do not exist yet when the prefill worker ranks tokens.

Per-head max (`head_max=True`, --kv-importance attn-max): per layer, each query head's mean
probability over the window rows of one add_layer call, the maximum over heads, averaged over
layers and normalized to sum 1. The mean above lets the many sink / local heads outvote the few
heads that read one far fact (a retrieval head puts most of its window mass on the asked line,
the mean spreads that over all heads); the maximum keeps what any head reads. A window split over
two prefill chunks adds two such maxima for a layer (each over its own rows).

KV-norm fallback (`norm_importance`): mean over layers and kv heads of ||k_j|| (averaged with
||v_j|| when values are given), normalized to sum 1. Used when attention probabilities are
unavailable (fused kernels) or unreliable, as in the paper's Qwen decay sweep.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

from sgl_kvxfer import env

DEFAULT_WINDOW = 32


def recency_decay(n: int, lam: float, device=None) -> torch.Tensor:
    """exp(-lam * Delta_j) for j in [0, n), Delta_j = n - 1 - j. Float32 [n]."""
    delta = torch.arange(n - 1, -1, -1, dtype=torch.float32, device=device)
    return torch.exp(-lam * delta)


def token_importance(attn_mass: torch.Tensor, lam: float = 0.0) -> torch.Tensor:
    """Eq. 13: I = A * exp(-lam * Delta). `attn_mass` [n] from an accumulator."""
    return attn_mass.float() * recency_decay(attn_mass.numel(), lam, attn_mass.device)


def sink_mask(n: int, num_sink: int) -> torch.Tensor:
    """Bool [n]: True for the first min(num_sink, n) positions (the pinned sinks)."""
    mask = torch.zeros(n, dtype=torch.bool)
    mask[: max(0, min(num_sink, n))] = True
    return mask


def ranking_order(importance: torch.Tensor, num_sink: int = 0) -> torch.Tensor:
    """Token ids in assignment order: sinks [0, s) first, then the rest by descending importance.

    Ties keep position order (stable sort), so equal scores favor earlier tokens. Policies hand out
    tiers along this order from highest to lowest precision; pinning happens *before* ranking, so a
    sink's own score never matters.
    """
    n = importance.numel()
    s = max(0, min(num_sink, n))
    rest = torch.argsort(importance.detach().float().cpu()[s:], descending=True, stable=True) + s
    return torch.cat([torch.arange(s, dtype=torch.int64), rest])


def normalize_importance(total: torch.Tensor) -> torch.Tensor:
    """Scores summing to 1 from accumulated totals (RuntimeError where nothing accumulated)."""
    return _normalize(total)


def _normalize(total: torch.Tensor) -> torch.Tensor:
    denom = total.sum()
    if denom <= 0:
        raise RuntimeError("no importance accumulated")
    return total / denom


class ImportanceAccumulator:
    """Collects A_j for one request while its prefill runs, one add_layer call per layer (chunk).

    The attention backend calls add_layer with the queries of the current chunk; rows outside the
    window are ignored, so feeding every chunk is fine. Holds float32 state on `device`; not
    thread-safe (one accumulator per request, fed by the forward thread).
    """

    def __init__(self, num_tokens: int, window: int | None = DEFAULT_WINDOW, device=None, fused_heads: bool = False,
                 head_max: bool = False):
        if num_tokens < 1 or (window is not None and window < 1):
            raise ValueError(f"need num_tokens >= 1 and window >= 1 or None, got {num_tokens}, {window}")
        # fused_heads: every head in one product per layer (Hkv times fewer kernel launches); the
        # same sums in another order, so a ranking may differ at near-ties
        self.fused_heads = fused_heads
        self.head_max = head_max
        self.num_tokens = num_tokens
        self.window = window
        self.window_start = 0 if window is None else max(0, num_tokens - window)
        self._mass = torch.zeros(num_tokens, dtype=torch.float32, device=device)
        self.num_rows = 0

    def add_layer(self, q: torch.Tensor, k: torch.Tensor, q_positions: torch.Tensor | None = None,
                  scale: float | None = None, logit_softcap: float | None = None,
                  sliding_window: int | None = None) -> None:
        """Add the causal attention probabilities of windowed queries over keys [0, T).

        q: [T_q, Hq, D] (post-RoPE), k: [T, Hkv, D] (post-RoPE, key t at position t),
        q_positions: [T_q] absolute positions (default: the last T_q of the T keys).
        Optional model quirks: tanh soft-capping of logits, sliding-window attention.
        """
        t_q, hq, d = q.shape
        t, hkv, _ = k.shape
        if hq % hkv:
            raise ValueError(f"query heads {hq} not a multiple of kv heads {hkv}")
        if q_positions is None:
            q_positions = torch.arange(t - t_q, t, device=q.device)
        q_positions = q_positions.to(q.device)
        keep = q_positions >= self.window_start
        if not bool(keep.any()):
            return
        q, pos = q[keep], q_positions[keep]
        if t > self.num_tokens:
            raise ValueError(f"got {t} keys for a {self.num_tokens}-token request")
        if int(pos.max()) >= t:
            raise ValueError(f"queries up to position {int(pos.max())} need their keys; got T={t}")
        self._accumulate(q, k, pos, scale, logit_softcap, sliding_window)

    def add_range(self, q: torch.Tensor, k: torch.Tensor, q_start: int, scale: float | None = None,
                  logit_softcap: float | None = None, sliding_window: int | None = None) -> None:
        """add_layer for queries at the consecutive positions [q_start, q_start + T_q) (a prefill
        chunk): the window cut and the checks use host integers, so on a GPU it runs no host
        sync (add_layer's boolean mask and max read device values back). Same sums as add_layer
        with q_positions = arange(q_start, q_start + T_q)."""
        t_q, hq, _ = q.shape
        t, hkv, _ = k.shape
        if hq % hkv:
            raise ValueError(f"query heads {hq} not a multiple of kv heads {hkv}")
        lo = max(0, self.window_start - q_start)
        if lo >= t_q:
            return
        if t > self.num_tokens:
            raise ValueError(f"got {t} keys for a {self.num_tokens}-token request")
        if q_start + t_q > t:
            raise ValueError(f"queries up to position {q_start + t_q - 1} need their keys; got T={t}")
        if not self.head_max and self.window_kernel(q, k) and self._mass.device == q.device:
            # one launch per layer instead of the torch path's dozen: on a prefill the host
            # launches them all, layer after layer (kernels/window_mass.py)
            from sgl_kvxfer.kernels.window_mass import window_mass

            d = q.shape[-1]
            window_mass(q[lo:], k.to(q.dtype), q_start + lo, 1.0 / math.sqrt(d) if scale is None else scale,
                        self._mass, logit_softcap, sliding_window)
            self.num_rows += (t_q - lo) * hq
            return
        pos = torch.arange(q_start + lo, q_start + t_q, device=q.device)
        self._accumulate(q[lo:], k, pos, scale, logit_softcap, sliding_window)

    @staticmethod
    def window_kernel(q: torch.Tensor, k: torch.Tensor) -> bool:
        """Whether add_range sums through kernels/window_mass.py: on CUDA unless
        SGL_KVXFER_WINDOW_MASS=0, for a power-of-two head dim >= 16 (the kernel's tiles) and
        rows with unit stride; otherwise the torch path (its reference, and the CPU path)."""
        d = q.shape[-1]
        return (q.is_cuda and env.WINDOW_MASS.get_bool() and d >= 16 and d & (d - 1) == 0
                and q.stride(-1) == 1 and k.stride(-1) == 1)

    def _accumulate(self, q, k, pos, scale, logit_softcap, sliding_window) -> None:
        """The windowed rows q [W', Hq, D] at positions pos [W'] (device) over keys k [T, Hkv, D]."""
        w, hq, d = q.shape
        t, hkv, _ = k.shape
        q = q.float()
        scale = 1.0 / math.sqrt(d) if scale is None else scale
        key_pos = torch.arange(t, device=q.device)
        visible = key_pos[None, :] <= pos[:, None]                      # [W', T]
        if sliding_window is not None:
            visible &= key_pos[None, :] > pos[:, None] - sliding_window
        if self.head_max:  # per query head: the window rows' mean; then the max over heads
            logits = torch.einsum("whgd,thd->whgt", q.view(q.shape[0], hkv, hq // hkv, d), k.float()) * scale
            if logit_softcap is not None:
                logits = logit_softcap * torch.tanh(logits / logit_softcap)
            logits = logits.masked_fill(~visible[:, None, None, :], float("-inf"))
            per_head = torch.softmax(logits, dim=-1).mean(dim=0).reshape(hq, t)  # [Hq, T]
            self._mass[:t] += per_head.max(dim=0).values.to(self._mass.device)
            self.num_rows += 1
            return
        if self.fused_heads:  # [W', Hkv, G, D] x [T, Hkv, D] -> [W', Hkv, G, T]
            logits = torch.einsum("whgd,thd->whgt", q.view(w, hkv, hq // hkv, d), k.float()) * scale
            if logit_softcap is not None:
                logits = logit_softcap * torch.tanh(logits / logit_softcap)
            logits = logits.masked_fill(~visible[:, None, None, :], float("-inf"))
            self._mass[:t] += torch.softmax(logits, dim=-1).sum(dim=(0, 1, 2)).to(self._mass.device)
            self.num_rows += w * hq
            return
        group = hq // hkv
        kf = k.float()
        for h in range(hkv):
            # [W', G, D] x [T, D] -> [W', G, T]: the G query heads that read kv head h
            logits = torch.einsum("wgd,td->wgt", q[:, h * group:(h + 1) * group], kf[:, h]) * scale
            if logit_softcap is not None:
                logits = logit_softcap * torch.tanh(logits / logit_softcap)
            logits = logits.masked_fill(~visible[:, None, :], float("-inf"))
            self._mass[:t] += torch.softmax(logits, dim=-1).sum(dim=(0, 1)).to(self._mass.device)
        self.num_rows += w * hq

    @property
    def has_data(self) -> bool:
        return self.num_rows > 0

    def scores(self) -> torch.Tensor:
        """A [num_tokens] float32, summing to 1 (mean probability over all accumulated rows)."""
        if not self.has_data:
            raise RuntimeError("ImportanceAccumulator.scores() before any windowed query was added")
        return _normalize(self._mass) if self.head_max else self._mass / self.num_rows


class KVNormAccumulator:
    """Per-layer feed of the KV-norm fallback; same contract as ImportanceAccumulator."""

    def __init__(self, num_tokens: int, device=None):
        self.num_tokens = num_tokens
        self._total = torch.zeros(num_tokens, dtype=torch.float32, device=device)
        self.num_layers = 0

    def add_layer(self, k: torch.Tensor, v: torch.Tensor | None = None) -> None:
        """k, v: [T, Hkv, D] for keys [0, T)."""
        norm = k.float().norm(dim=-1).mean(dim=-1)                     # [T]
        if v is not None:
            norm = 0.5 * (norm + v.float().norm(dim=-1).mean(dim=-1))
        self._total[: norm.numel()] += norm.to(self._total.device)
        self.num_layers += 1

    @property
    def has_data(self) -> bool:
        return self.num_layers > 0

    def totals(self) -> torch.Tensor:
        """The per-token sums over the layers fed so far (scores() before normalizing)."""
        return self._total

    def scores(self) -> torch.Tensor:
        return _normalize(self._total)


def norm_importance(keys: Sequence[torch.Tensor] | torch.Tensor,
                    values: Sequence[torch.Tensor] | torch.Tensor | None = None) -> torch.Tensor:
    """KV-norm fallback A [T]: keys/values are per-layer [T, Hkv, D] (a list or an [L, T, Hkv, D])."""
    layers = list(keys)
    acc = KVNormAccumulator(layers[0].shape[0], device=layers[0].device)
    vals = list(values) if values is not None else [None] * len(layers)
    if len(vals) != len(layers):
        raise ValueError("keys and values must have the same number of layers")
    for k, v in zip(layers, vals):
        acc.add_layer(k, v)
    return acc.scores()
