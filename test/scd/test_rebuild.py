"""StackedRebuild (scd/rebuild.py): the whole segment's layers in batched GEMMs give each layer's
K/V of the per-layer decoder (codec.py), for every head mode, rank level and with Patch biases;
a segment rebuilt in pieces equals it rebuilt whole; the paged pool's batched writes equal
per-layer set_kv."""
import json
import os

import pytest
import torch

from sgl_kvxfer.models.arch_config import ModelArchConfig
from sgl_kvxfer.models.presets import write_preset_config
from sgl_kvxfer.scd.artifacts import make_random_artifacts
from sgl_kvxfer.scd.codec import KVProjection, ScdDecoder
from sgl_kvxfer.scd.rebuild import StackedRebuild, per_layer


@pytest.fixture(scope="module")
def arch(tmp_path_factory):
    """The tiny preset with 5 layers: several Reuse and several Patch layers to stack."""
    d = write_preset_config("tiny", str(tmp_path_factory.mktemp("tiny")))
    with open(os.path.join(d, "config.json")) as f:
        cfg = json.load(f)
    cfg["num_hidden_layers"] = 5
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    return ModelArchConfig.from_dir(d)


def _setup(arch, head_mode="joint", bias=False, patch_layers=(0, 2), seed=3, device="cpu"):
    arts = make_random_artifacts(arch, ["c0"], 8, 12, 16, patch_layers=list(patch_layers), seed=seed,
                                 head_mode=head_mode, rank_levels=[(4, 8)])
    m = arts.manifest
    g = torch.Generator().manual_seed(seed)
    kv_out = m.num_kv_heads * m.head_dim

    def w():
        return torch.randn(kv_out, arch.hidden_size, generator=g).to(torch.bfloat16)

    def b():
        return torch.randn(kv_out, generator=g).to(torch.bfloat16) if bias else None

    projs = [KVProjection(*(None if t is None else t.to(device) for t in (w(), w(), b(), b())))
             for _ in range(m.num_layers)]
    dec = ScdDecoder(arts, "c0", device)
    return m, dec, projs


def _codes(m, n, level, g):
    r_k, r_v = level
    out = {}
    for layer in m.reuse_layers:
        out[(layer, "k")] = torch.randn(n, m.num_kv_heads, r_k, generator=g).to(torch.bfloat16).float()
        out[(layer, "v")] = torch.randn(n, m.num_kv_heads, r_v, generator=g).to(torch.bfloat16).float()
    for layer in m.patch_layers:
        out[(layer, "h")] = torch.randn(n, m.r_h, generator=g).to(torch.bfloat16).float()
    return out


CASES = [("joint", False, (8, 12)), ("joint", True, (4, 8)), ("per_head", False, (8, 12)), ("per_head", True, (4, 8))]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("head_mode,bias,level", CASES)
def test_stacked_rebuild_equals_the_per_layer_decode(arch, head_mode, bias, level, device):
    """CPU: bit-equal. CUDA (float32 GEMMs, batched or not, may block differently): within a
    bf16 rounding of the largest value."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    m, dec, projs = _setup(arch, head_mode, bias, device=device)
    stacked = StackedRebuild(dec, projs, device)
    g = torch.Generator().manual_seed(1)
    start, n = 5, 9
    codes = {key: c.to(device) for key, c in _codes(m, n, level, g).items()}
    positions = torch.arange(start, start + n, device=device)
    dec.rotary.prime(positions, num_positions=start + n)
    got = per_layer(stacked.rebuild(codes, positions, torch.bfloat16), m.num_layers)
    for layer in range(m.num_layers):
        if layer in m.reuse_layers:
            want = dec.decode_reuse(layer, codes[(layer, "k")], codes[(layer, "v")], positions, torch.bfloat16)
        else:
            want = dec.regenerate_patch(layer, codes[(layer, "h")], positions, projs[layer], torch.bfloat16)
        for g_, w_ in zip(got[layer], want):
            assert g_.shape == w_.shape and g_.dtype == torch.bfloat16
            if device == "cpu":
                assert torch.equal(g_, w_), (layer, head_mode)  # the same float32 arithmetic, batched
            else:
                assert (g_.float() - w_.float()).abs().max() <= 2 ** -7 * w_.float().abs().max(), (layer, head_mode)


def test_a_segment_rebuilt_in_pieces_equals_it_rebuilt_whole(arch):
    """Segment k's K/V depend on its own positions only: [0, 40) in 3 segments (one a single
    token) is [0, 40) at once, within one bf16 rounding."""
    m, dec, projs = _setup(arch)
    stacked = StackedRebuild(dec, projs, "cpu")
    codes = _codes(m, 40, (m.r_k, m.r_v), torch.Generator().manual_seed(2))
    whole_pos = torch.arange(40)
    dec.rotary.prime(whole_pos, num_positions=40)
    whole = per_layer(stacked.rebuild(codes, whole_pos, torch.bfloat16), m.num_layers)
    pieces = []
    for a, b in ((0, 31), (31, 32), (32, 40)):
        pos = torch.arange(a, b)
        dec.rotary.prime(pos, num_positions=b)
        pieces.append(per_layer(stacked.rebuild({k: c[a:b] for k, c in codes.items()}, pos, torch.bfloat16),
                                m.num_layers))
    for layer in range(m.num_layers):
        for j in range(2):
            joined = torch.cat([p[layer][j] for p in pieces]).float()
            want = whole[layer][j].float()
            # one bf16 rounding apart at most: a one-token piece's float32 GEMMs may take
            # another kernel (another summation order) than the whole segment's on some CPUs
            torch.testing.assert_close(joined, want, rtol=2 ** -7, atol=2 ** -7 * want.abs().max().item(),
                                       msg=f"layer {layer}")


def test_codes_of_an_unknown_rank_are_refused(arch):
    m, dec, projs = _setup(arch)
    stacked = StackedRebuild(dec, projs, "cpu")
    codes = _codes(m, 3, (5, 8), torch.Generator().manual_seed(0))
    pos = torch.arange(3)
    dec.rotary.prime(pos, num_positions=3)
    with pytest.raises(ValueError, match="no level"):
        stacked.rebuild(codes, pos, torch.bfloat16)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("how", ["write_external", "write_layers"])
def test_the_paged_pools_batched_writes_equal_set_kv_per_layer(how, device):
    """write_external (page / offset once) and write_layers (a layer group in one index_put into
    the pool's single allocation) store exactly what set_kv does, layer by layer."""
    from sgl_kvxfer.mem_cache.paged_fp16_pool import PagedFp16KVPool

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    g = torch.Generator().manual_seed(0)
    a = PagedFp16KVPool(256, 4, 2, 8, torch.bfloat16, device, page_size=16)
    b = PagedFp16KVPool(256, 4, 2, 8, torch.bfloat16, device, page_size=16)
    for buf in a.k_buffer + a.v_buffer + b.k_buffer + b.v_buffer:
        buf.zero_()
    slots = torch.tensor([17, 18, 19, 64, 65, 200], device=device)
    kv = [(torch.randn(6, 2, 8, generator=g).to(device), torch.randn(6, 2, 8, generator=g).to(device))
          for _ in range(4)]
    if how == "write_external":
        a.write_external(slots, kv)
    else:  # two groups, not in layer order, as the rebuild's Reuse and Patch groups
        for ids in ((0, 3), (2, 1)):
            a.write_layers(slots, ids, torch.stack([kv[i][0] for i in ids]), torch.stack([kv[i][1] for i in ids]))
    for layer, (k, v) in enumerate(kv):
        b.set_kv(layer, slots, k, v)
    for x, y in zip(a.k_buffer + a.v_buffer, b.k_buffer + b.v_buffer):
        assert torch.equal(x, y)
    assert a.k_buffer[1].data_ptr() == a.k_all[1].data_ptr()  # the layers' views share one allocation
