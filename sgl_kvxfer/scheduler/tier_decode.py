"""SpectrumKV's decode demotion path (a mixin of `EngineTiering`, scheduler/tiering.py).

Decode rule: the newest R = kv_decode_recent generated tokens stay fp16; once 2R are unassigned,
the oldest R are assigned by the same policy at b (KV-norm importance: no queries exist yet for
them) and moved, so at most 2R - 1 generated tokens per request wait in fp16. On finish, all but
the newest R are assigned. Keep/drop baselines (pdtrim, sws) trim only the prefill KV, as in
PD transfer, and leave generated tokens fp16.


Hazards: decode tokens are private to the request until it finishes, so a run continues the
last page its previous run got (`_tails`), but only where the row still holds that id (a request
retracted and recomputed starts afresh). Under overlapped decode a step whose apply demotes
drains first (EngineTiering.apply_drains, scheduler/overlap.py).
"""
from __future__ import annotations

import torch

from sgl_kvxfer.spectrum.byte_budget import assign_tiers
from sgl_kvxfer.spectrum.tiers import TIER_INT4, TIER_INT8


class DecodeDemotionMixin:
    """`EngineTiering`'s decode rule; state (`_tiered_len`, `_tails`, ...) lives there."""

    def _decode_run(self, req, final: bool, kv_len: int | None = None):
        """(req, start, end) of the generated tokens due for demotion once req's row holds
        `kv_len` tokens (default: req.kv_len), or None."""
        done = self._tiered_len.get(req)
        recent = self.settings.decode_recent
        if done is None or self.policy.keep_drop:
            return None
        end = (req.kv_len if kv_len is None else kv_len) - recent
        if end - done < (1 if final else recent):
            return None
        return req, done, end

    def _demote_runs(self, runs: list) -> None:
        """Decode demotion of every due request at once: one host copy of their slots, one KV-norm
        pass over the layers for all of them, the tiers assigned per run (each run normalized on
        its own, as a lone run would be), then one retier_runs: each run on its own pages (the
        free tail of its previous run's last page first), one data move (fp16 -> int: one
        quantize-and-store launch per tier for all layers on CUDA). The host reads the device
        table once (each run's row from its oldest live tail's position, so the tails are checked
        on that copy); everything after it runs on host ids."""
        spans = []  # (req, start, end, first position read: the oldest tail's, else start)
        for req, start, end in runs:
            tails = self._tails.get(req) or {}
            spans.append((req, start, end, min([start, *(pos for _, pos in tails.values())])))
        host = torch.cat([self.table.read(req.req_pool_idx, end, start=lo) for req, _, end, lo in spans]).cpu()
        rows, at = [], 0
        for req, start, end, lo in spans:
            rows.append((host[at:at + end - lo], lo))
            at += end - lo
        slots = torch.cat([row[start - lo:] for (row, lo), (_, start, _, _) in zip(rows, spans)])
        joint = self._norm_importance(slots)  # normalized over every run's tokens
        st, parts, pos = self.settings, [], 0
        for (req, start, end, _), (row, lo) in zip(spans, rows):
            n = end - start
            run_slots, imp = slots[pos:pos + n], joint[pos:pos + n]
            pos += n
            if len(runs) > 1:  # renormalized over the run alone (a lone run's scores are already)
                imp = imp / imp.sum()
            tiers = assign_tiers(self.policy, imp, st.budget, self.layout, st.unit, 0, st.int4_allowed,
                                 self.config.random_seed)
            if self.cold is not None:  # copies of the tokens it drops, before their ids are freed
                self.cold.keep_dropped(req, start, run_slots, tiers)
            parts.append((run_slots, tiers, self._live_tails(req, row, lo)))
        results = self.allocator.retier_runs(parts, self._make_room)
        for (req, start, end), (run_slots, tiers, _), (new, got) in zip(runs, parts, results):
            # host ids in, host ids out (retier_runs plans on the host): no copy back below
            self._record(req, start, run_slots, tiers, new, got)
            self._tiered_len[req] = end
            tails = dict(self._tails.get(req) or {})
            if self.cold is not None:  # its host mirror of the row follows the rewrite
                self.cold.note_rows(req, start, new)
            moved = new != run_slots
            for t in (TIER_INT8, TIER_INT4):
                idx = (moved & (got == t)).nonzero().squeeze(1)
                if idx.numel():
                    tails[t] = (int(new[idx[-1]]), start + int(idx[-1]))  # (id, row position)
            self._tails[req] = tails

    def _live_tails(self, req, row: torch.Tensor, lo: int) -> dict | None:
        """{tier: id} of the request's previous decode runs' last pages, each only if the row still
        holds that id at its position (a request retracted and recomputed starts afresh). row: the
        host copy of the request's row from position lo (lo <= every tail's position)."""
        tails = self._tails.get(req)
        if not tails:
            return None
        return {t: slot for t, (slot, pos) in tails.items() if int(row[pos - lo]) == slot}
