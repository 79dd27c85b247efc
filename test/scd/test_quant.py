"""Quantised SCD codes (manifest dtype int8 / int4): the per-token-per-field grid, its wire
packing, the manifest's and the payload's byte counts, and the encoder handing over codes on the
grid so that what the harness measures is what the wire carries."""
import pytest
import torch

from sgl_kvxfer.mem_cache.scd_payload import CodeLayout, pack_codes, unpack_codes
from sgl_kvxfer.models.arch_config import ModelArchConfig
from sgl_kvxfer.models.presets import write_preset_config
from sgl_kvxfer.scd import ScdArtifacts, ScdDecoder, ScdEncoder
from sgl_kvxfer.scd.artifacts import make_random_artifacts
from sgl_kvxfer.mem_cache.scd_quant import fake_quant, field_bytes, pack_field, qmax, unpack_field


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("n", [7, 16])
def test_pack_round_trips_the_grid(bits, n):
    g = torch.Generator().manual_seed(bits + n)
    z = torch.randn(5, n, generator=g) * torch.tensor([1e-3, 1.0, 30.0, 0.0, 5.0])[:, None]
    zq = fake_quant(z, bits)
    # error at most half a step of each token's own scale; an all-zero token stays zero
    step = z.abs().amax(-1, keepdim=True) / qmax(bits)
    assert ((zq - z).abs() <= 0.5 * step * 1.01).all()
    assert torch.equal(zq[3], torch.zeros(n))
    block = pack_field(z, bits)
    assert block.dtype == torch.uint8 and block.numel() == 5 * field_bytes(n, bits)
    assert torch.equal(unpack_field(block, 5, n, bits), zq)
    # packing codes already on the grid (what the encoder hands over) changes nothing
    assert torch.equal(pack_field(zq, bits), block)
    # int4 is coarser than int8, and both beat nothing
    if bits == 4:
        e4, e8 = (fake_quant(z, 4) - z).pow(2).sum(), (fake_quant(z, 8) - z).pow(2).sum()
        assert e8 < e4 < z.pow(2).sum()


@pytest.fixture(scope="module")
def arch(tmp_path_factory):
    return ModelArchConfig.from_dir(write_preset_config("tiny", str(tmp_path_factory.mktemp("tiny"))))


@pytest.mark.parametrize("dtype,bits", [("int8", 8), ("int4", 4)])
def test_quantised_manifest_payload_and_codec(arch, dtype, bits):
    art = make_random_artifacts(arch, 1, 8, 16, 32, patch_layers=[1], rank_levels=((4, 8),), dtype=dtype)
    m = art.manifest
    assert m.wire_bits == bits and m.code_dtype == torch.float32
    h = m.num_kv_heads
    reuse = len(m.reuse_layers)
    assert m.bytes_per_token == reuse * (field_bytes(h * 8, bits) + field_bytes(h * 16, bits)) + field_bytes(32, bits)
    assert m.bytes_per_token_at((4, 8)) == reuse * (field_bytes(h * 4, bits) + field_bytes(h * 8, bits)) + \
        field_bytes(32, bits)
    bf = make_random_artifacts(arch, 1, 8, 16, 32, patch_layers=[1]).manifest
    assert m.bytes_per_token < bf.bytes_per_token * bits / 16 + 2 * 2 * m.num_layers
    # encoder -> pack -> unpack -> decoder equals encoder -> decoder (the harness's path)
    enc, dec = ScdEncoder(art), ScdDecoder(art, "c0")
    t = 6
    g = torch.Generator().manual_seed(0)
    pos = torch.arange(t) + 3
    codes, direct = {}, {}
    for layer in m.reuse_layers:
        k = torch.randn(t, h, m.head_dim, generator=g)
        v = torch.randn(t, h, m.head_dim, generator=g)
        zk, zv = enc.encode_reuse(layer, k, v, pos, (4, 8))
        assert zk.dtype == torch.float32
        codes[(layer, "k")], codes[(layer, "v")] = zk, zv
        direct[layer] = dec.decode_reuse(layer, zk, zv, pos)
    for layer in m.patch_layers:
        codes[(layer, "h")] = enc.encode_patch(layer, torch.randn(t, m.hidden_size, generator=g))
    layout = CodeLayout.from_manifest(m, (4, 8))
    assert layout.bytes_per_token == m.bytes_per_token_at((4, 8))
    out = torch.zeros(layout.nbytes(t), dtype=torch.uint8)
    assert pack_codes(layout, codes, out) == layout.nbytes(t)
    back = unpack_codes(layout, out, t)
    for key, z in codes.items():
        assert torch.equal(back[key], z), key
    for layer in m.reuse_layers:
        k, v = dec.decode_reuse(layer, back[(layer, "k")], back[(layer, "v")], pos)
        assert torch.equal(k, direct[layer][0]) and torch.equal(v, direct[layer][1])
    # the manifest's dtype survives save / load; a bad dtype is refused
    import dataclasses
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        art.save(d)
        assert ScdArtifacts.load(d).manifest.dtype == dtype
    with pytest.raises(ValueError, match="dtype"):
        dataclasses.replace(m, dtype="int3")
