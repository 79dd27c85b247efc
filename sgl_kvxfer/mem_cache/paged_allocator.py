"""Page-granular token-slot allocator (`--page-size` > 1): the free list holds page ids.

Slots stay the integer ids the rest of the engine uses, but they come in aligned pages:

    slot = page * PAGE + offset        page 0 (slots 0 .. PAGE-1) is padding, never handed out
    request row:  pos  0 ....... PAGE-1 | PAGE ...... 2*PAGE-1 | ... | last page (maybe partial)
    slot       :  p0*PAGE + pos % PAGE  | p1*PAGE + pos % PAGE  | ... | pk*PAGE + pos % PAGE

Invariants:
- A page is free or owned by exactly one holder (a radix node, or a running request's private
  run whose last page may be partial). The same interface as `TokenSlotAllocator`, counted in
  tokens (whole pages), so the prefix cache and the lifecycle see token counts.
- `free(slots)` takes a run of a row starting at a page-aligned position (every caller frees
  `[aligned, end)` ranges): one slot every PAGE identifies each page, so no host sync is needed.
"""
from __future__ import annotations

import torch

from sgl_kvxfer.mem_cache.free_list import LazyFreeList
from sgl_kvxfer.utils.host_copy import int64_to_device, to_device


def pages_needed(starts: list[int], lens: list[int], page_size: int) -> int:
    """Fresh pages to add `lens[i]` tokens to rows that hold `starts[i]` tokens: the partial
    last page of a row is filled first."""
    total = 0
    for s, n in zip(starts, lens):
        fresh = n - min(n, -s % page_size)
        total += -(-fresh // page_size)
    return total


class PagedTokenSlotAllocator:
    def __init__(self, size: int, page_size: int, device: str = "cpu"):
        assert page_size > 1, "page_size 1 uses TokenSlotAllocator"
        self.page_size = page_size
        self.num_pages = size // page_size  # usable pages: ids 1..num_pages
        self.size = self.num_pages * page_size
        self.device = device
        self._pages = LazyFreeList(1, self.num_pages, device)  # page 0 (padding) is never in it

    def clear(self) -> None:
        self._pages.reset()

    def available_pages(self) -> int:
        return self._pages.available()

    def available_size(self) -> int:
        return self.available_pages() * self.page_size

    def alloc_pages(self, n: int) -> torch.Tensor | None:
        """`n` page ids (int64 [n]) or None when fewer are free."""
        return self._pages.take(n)

    def alloc(self, n: int) -> torch.Tensor | None:
        """Slots of `n` tokens on fresh pages (a new row's positions 0..n-1)."""
        pages = self.alloc_pages(-(-n // self.page_size))
        if pages is None:
            return None
        offs = torch.arange(self.page_size, device=self.device)
        return (pages[:, None] * self.page_size + offs).flatten()[:n]

    def alloc_extend(self, last_slots: torch.Tensor, starts: list[int], lens: list[int]) -> torch.Tensor | None:
        """Slots for positions starts[i] .. starts[i]+lens[i]-1 of B rows, concatenated.

        last_slots [B] (device): slot of position starts[i]-1 (read only where starts[i] % PAGE
        != 0, i.e. where the row's last page has room). Returns None, changing nothing, when too
        few pages are free.

            row i:  ... | last page: filled  room  | fresh page | fresh page (partial) |
                          cont_i = min(lens[i], room) tokens, then lens[i] - cont_i on fresh pages
        """
        P = self.page_size
        if all(n == 1 for n in lens):
            return self.alloc_decode(last_slots, [i for i, s in enumerate(starts) if s % P == 0])
        pages = self.alloc_pages(pages_needed(starts, lens, P))
        if pages is None:
            return None
        lens_t = torch.tensor(lens, dtype=torch.int64)
        cont = torch.tensor([min(n, -s % P) for s, n in zip(starts, lens)], dtype=torch.int64)
        npages = (lens_t - cont + P - 1) // P
        page_base = torch.cumsum(npages, 0) - npages
        tok_base = torch.cumsum(lens_t, 0) - lens_t
        req = torch.repeat_interleave(torch.arange(len(lens)), lens_t)  # request of each new token
        j = torch.arange(int(lens_t.sum())) - tok_base[req]  # its index inside the request's run
        k = (j - cont[req]).clamp(min=0)  # index among the request's fresh-page tokens
        is_cont = j < cont[req]
        host = torch.stack([req, j, is_cont.long(), page_base[req] + k // P, k % P])
        req_d, j_d, cont_d, pidx_d, off_d = to_device(host, self.device).unbind(0)
        if pages.numel() == 0:
            return last_slots[req_d] + 1 + j_d
        fresh = pages[pidx_d.clamp(max=pages.numel() - 1)] * P + off_d
        if not bool(is_cont.any()):
            return fresh
        return torch.where(cont_d.bool(), last_slots[req_d] + 1 + j_d, fresh)

    def alloc_decode(self, last_slots: torch.Tensor, at_boundary: list[int]) -> torch.Tensor | None:
        """alloc_extend with every len 1 (a decode step) in a handful of ops: a row whose last
        page has room takes the next slot of it, a row at a page boundary (its index listed in
        `at_boundary`: its start % PAGE == 0) a fresh page's first."""
        P = self.page_size
        pages = self.alloc_pages(len(at_boundary))
        if pages is None:
            return None
        out = last_slots + 1
        if at_boundary:
            rows = int64_to_device((at_boundary,), self.device)
            out[rows] = pages * P
        return out

    def free(self, slots: torch.Tensor) -> None:
        """Free the pages of a row run that starts at a page-aligned position (see module doc)."""
        if slots.numel():
            self._pages.give(slots[:: self.page_size].to(self.device, torch.int64) // self.page_size)

    def reclaimable(self, slots: torch.Tensor) -> int:
        """Tokens a later alloc gains once `slots` (a page-aligned run) are freed: whole pages."""
        return -(-int(slots.numel()) // self.page_size) * self.page_size

    def debug_check(self) -> None:
        self._pages.check("page")
