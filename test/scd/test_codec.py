"""SCD codec: full-rank round trips, the joint (N-consumer) fit, RoPE exactness vs the engine."""
import pytest
import torch

from sgl_kvxfer.layers.rope import RotaryEmbedding, apply_rope
from sgl_kvxfer.models.arch_config import ModelArchConfig
from sgl_kvxfer.models.loader import load_model
from sgl_kvxfer.models.presets import PRESETS
from sgl_kvxfer.scd import (ScdArtifacts, ScdDecoder, ScdEncoder, ScdManifest, kv_projections,
                            make_random_artifacts, regenerate_kv)
from sgl_kvxfer.scd.calib.build import ReuseMoments, fit_reuse
from sgl_kvxfer.scd.calib.forward import LlamaRunner, left_pad
from sgl_kvxfer.scd.identity import ModelIdentity
from sgl_kvxfer.scd.rotary import KeyRotary


def _capture(model_dir, seqs):
    model, arch = load_model(model_dir, "auto", torch.float32, "cpu", 0)
    ids, valid, pos = left_pad(seqs)
    taps = LlamaRunner(model).forward(ids, pos, valid, kv_layers=range(arch.num_hidden_layers),
                                      h_layers=range(arch.num_hidden_layers))
    return model, arch, taps, pos[valid], valid


def _manifest(arch, consumers, r_k, r_v, patch=(), head_mode="joint"):
    ident = ModelIdentity("producer", "x", "*")
    return ScdManifest(producer=ident, consumers=tuple(ModelIdentity(c, "x", "*") for c in consumers),
                       num_layers=arch.num_hidden_layers, num_kv_heads=arch.num_key_value_heads,
                       head_dim=arch.head_dim, hidden_size=arch.hidden_size, rope_theta=arch.rope_theta,
                       rope_scaling=arch.rope_scaling, max_position_embeddings=arch.max_position_embeddings,
                       reuse_layers=tuple(i for i in range(arch.num_hidden_layers) if i not in patch),
                       patch_layers=tuple(patch), r_k=r_k, r_v=r_v, r_h=8, dtype="float32", head_mode=head_mode)


def _fit(arch, rot, ks_models, vs_models, pos, consumers, r_k, r_v, ridge, head_mode="joint"):
    mom = ReuseMoments(arch.num_hidden_layers, arch.num_key_value_heads, arch.head_dim, len(consumers),
                       head_mode=head_mode)
    for layer in range(arch.num_hidden_layers):
        mom.update(layer, [rot.derope(k[layer], pos) for k in ks_models], [v[layer] for v in vs_models])
    tensors, report = fit_reuse(mom, range(arch.num_hidden_layers), r_k, r_v, consumers, ridge)
    return ScdArtifacts(_manifest(arch, consumers, r_k, r_v, head_mode=head_mode), tensors), report


@pytest.mark.parametrize("head_mode", ["joint", "per_head"])
def test_full_rank_round_trip_same_model(tiny_pair, head_mode):
    seqs = [list(range(100 + 7 * i, 160 + 9 * i)) for i in range(4)]
    _, arch, taps, pos, valid = _capture(tiny_pair["producer"], seqs)
    rot = KeyRotary.from_arch(arch)
    ks = {layer: taps.k[layer][valid] for layer in taps.k}  # [n, H, D]
    vs = {layer: taps.v[layer][valid] for layer in taps.v}
    d = arch.head_dim
    art, report = _fit(arch, rot, [ks, ks], [vs, vs], pos, ["self"], d, d, 1e-9, head_mode)
    enc, dec = ScdEncoder(art), ScdDecoder(art, "self")
    for layer in range(arch.num_hidden_layers):
        zk, zv = enc.encode_reuse(layer, ks[layer], vs[layer], pos)
        assert zk.shape == (pos.numel(), arch.num_key_value_heads, d)
        k_hat, v_hat = dec.decode_reuse(layer, zk, zv, pos)
        assert (k_hat - ks[layer]).norm() / ks[layer].norm() < 1e-4
        assert (v_hat - vs[layer]).norm() / vs[layer].norm() < 1e-4
    assert max(report["self"]["k_rel_err"]) < 1e-6
    # Lower rank: larger error, monotone in rank (a real test of the truncation).
    errs = [max(_fit(arch, rot, [ks, ks], [vs, vs], pos, ["self"], r, r, 1e-6, head_mode)[1]["self"]["v_rel_err"])
            for r in (2, 8, d)]
    assert errs[0] > errs[1] > errs[2] and errs[0] > 1e-2


def test_joint_heads_fit_no_worse_than_per_head(tiny_pair):
    """Same bytes (H*r numbers per token): the joint subspace over a layer's heads contains every
    per-head (block-diagonal) choice, so its fit error is at most the per-head one."""
    seqs = [list(range(100 + 7 * i, 180 + 9 * i)) for i in range(4)]
    _, arch, taps, pos, valid = _capture(tiny_pair["producer"], seqs)
    _, _, taps_b, _, _ = _capture(tiny_pair["b"], seqs)
    rot = KeyRotary.from_arch(arch)
    ka, va = ({l: t[l][valid] for l in t} for t in (taps.k, taps.v))
    kb, vb = ({l: t[l][valid] for l in t} for t in (taps_b.k, taps_b.v))
    rep = {mode: _fit(arch, rot, [ka, kb], [va, vb], pos, ["b"], 4, 4, 1e-6, mode)[1]["b"]
           for mode in ("joint", "per_head")}
    for kind in ("k_rel_err", "v_rel_err"):
        assert all(j <= p + 1e-3 for j, p in zip(rep["joint"][kind], rep["per_head"][kind])), (kind, rep)
        assert sum(rep["joint"][kind]) < sum(rep["per_head"][kind])


def test_joint_fit_serves_several_consumers(tiny_pair):
    """One encoding, two decoders: consumer 'lin' is an exact linear map of the producer, so at
    full rank both it and the producer itself are reconstructed from the SAME codes."""
    seqs = [list(range(300 + 5 * i, 380 + 5 * i)) for i in range(3)]
    _, arch, taps, pos, valid = _capture(tiny_pair["producer"], seqs)
    rot = KeyRotary.from_arch(arch)
    d, g = arch.head_dim, torch.Generator().manual_seed(3)
    mix = torch.eye(d) + 0.3 * torch.randn(d, d, generator=g)
    ks = {layer: taps.k[layer][valid] for layer in taps.k}
    vs = {layer: taps.v[layer][valid] for layer in taps.v}
    k_lin = {layer: rot.rope(rot.derope(ks[layer], pos) @ mix, pos) for layer in ks}
    v_lin = {layer: vs[layer] @ mix + 0.5 for layer in vs}
    art, _ = _fit(arch, rot, [ks, ks, k_lin], [vs, vs, v_lin], pos, ["self", "lin"], d, d, 1e-9, "per_head")
    enc = ScdEncoder(art)
    for name, kt, vt in (("self", ks, vs), ("lin", k_lin, v_lin)):
        dec = ScdDecoder(art, name)
        for layer in range(arch.num_hidden_layers):
            k_hat, v_hat = dec.decode_reuse(layer, *enc.encode_reuse(layer, ks[layer], vs[layer], pos), pos)
            assert (k_hat - kt[layer]).norm() / kt[layer].norm() < 1e-3, (name, layer)
            assert (v_hat - vt[layer]).norm() / vt[layer].norm() < 1e-3, (name, layer)


@pytest.mark.parametrize("preset", ["llama-3-8b", "smollm2-135m"])
def test_derope_rope_exact(preset):
    arch = ModelArchConfig.from_hf_dict(PRESETS[preset])
    rot = KeyRotary.from_arch(arch)
    pos = torch.tensor([0, 1, 5, 511, 4000, 9000])
    x = torch.randn(len(pos), 2, arch.head_dim)
    ref = RotaryEmbedding(arch.head_dim, arch.rope_theta, arch.rope_scaling, arch.max_position_embeddings)
    assert torch.equal(rot.rope(x, pos), apply_rope(x, *ref.cos_sin(pos, torch.float32)))
    assert torch.allclose(rot.derope(rot.rope(x, pos), pos), x, atol=1e-5)
    assert torch.allclose(rot.rope(rot.derope(x, pos), pos), x, atol=1e-5)
    assert not torch.allclose(rot.derope(x, pos)[1:], x[1:], atol=1e-2)  # it does rotate
    yarn = KeyRotary(64, 10000.0, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048}, 8192)
    assert yarn.rotary.attention_scaling != 1.0
    x = torch.randn(len(pos), 2, 64)
    assert torch.allclose(yarn.derope(yarn.rope(x, pos), pos), x, atol=1e-5)


def test_primed_positions_share_one_lookup_and_give_the_same_rotation(monkeypatch):
    """prime(positions, num_positions=bound): every later rope / derope of that same tensor reuses
    its cos / sin (one lookup per segment, no positions.max() sync) and rotates exactly as an
    unprimed call; another tensor of equal values is looked up afresh."""
    arch = ModelArchConfig.from_hf_dict(PRESETS["llama-3-8b"])
    rot, fresh = KeyRotary.from_arch(arch), KeyRotary.from_arch(arch)
    pos = torch.arange(4090, 4100)
    x = torch.randn(len(pos), 2, arch.head_dim)
    want_rope, want_derope = fresh.rope(x, pos), fresh.derope(x, pos)
    calls = []
    real = rot.rotary.cos_sin
    monkeypatch.setattr(rot.rotary, "cos_sin", lambda p, dt, n=None: calls.append(n) or real(p, dt, n))
    rot.prime(pos, num_positions=4100)
    for _ in range(3):
        assert torch.equal(rot.rope(x, pos), want_rope) and torch.equal(rot.derope(x, pos), want_derope)
    assert calls == [4100]
    assert torch.equal(rot.rope(x, pos.clone()), want_rope) and calls == [4100, None]


def test_engine_kv_equals_runner_kv_and_patch_regeneration(tiny_pair):
    """Our offline forward captures exactly the post-RoPE K/V the engine's pool stores, and the
    consumer's K/V regenerated from its own input_layernorm output equal its stored K/V."""
    from sgl_kvxfer import Engine

    ids = [list(range(1000, 1023))]
    eng = Engine(tiny_pair["a"], device="cpu", dtype="float32", attention_backend="torch", max_total_tokens=256)
    try:
        eng.generate(input_ids=ids[0], sampling_params={"max_new_tokens": 1, "temperature": 0})
        slots, _ = eng.scheduler.kv.tree.match_prefix(ids[0])
        assert slots.numel() == len(ids[0])
        pool = eng.runner.kv_pool
        model, arch, taps, pos, valid = _capture(tiny_pair["a"], ids)
        rot, proj = KeyRotary.from_arch(arch), kv_projections(model)
        for layer in range(arch.num_hidden_layers):
            k_eng, v_eng = pool.get_kv(layer, slots)
            assert torch.allclose(taps.k[layer][0], k_eng, atol=1e-5, rtol=1e-5)
            assert torch.allclose(taps.v[layer][0], v_eng, atol=1e-5, rtol=1e-5)
            assert torch.allclose(rot.rope(rot.derope(k_eng, pos), pos), k_eng, atol=1e-5)
            k_re, v_re = regenerate_kv(taps.h[layer][0], proj[layer], pos, rot)
            assert torch.allclose(k_re, k_eng, atol=1e-5) and torch.allclose(v_re, v_eng, atol=1e-5)
    finally:
        eng.shutdown()


def test_random_artifacts_shapes_and_bytes(tmp_path):
    arch = ModelArchConfig.from_hf_dict(PRESETS["llama-3-8b"])
    art = make_random_artifacts(arch, ["code", "prose"], r_k=16, r_v=32, r_h=256, patch_layers=[3, 17], seed=1)
    assert art.producer_tensor("k_enc.0").shape == (8 * 128, 8 * 16)  # joint over the 8 kv heads
    m = art.manifest
    assert m.bytes_per_token == (30 * 8 * 48 + 2 * 256) * 2
    assert m.raw_kv_bytes_per_token() == 32 * 8 * 256 * 2
    art.save(str(tmp_path))
    back = ScdArtifacts.load(str(tmp_path), producer=False, consumers=["prose"])
    assert back.manifest == m and not any(k.startswith("producer/") for k in back.tensors)
    with pytest.raises(KeyError, match="producer"):
        ScdEncoder(back)
    enc, dec = ScdEncoder(ScdArtifacts.load(str(tmp_path))), ScdDecoder(back, "prose")
    t = 5
    pos = torch.arange(t)
    zk, zv = enc.encode_reuse(0, torch.randn(t, 8, 128), torch.randn(t, 8, 128), pos)
    assert zk.dtype == torch.bfloat16 and zk.shape == (t, 8, 16) and zv.shape == (t, 8, 32)
    k, v = dec.decode_reuse(0, zk, zv, pos, out_dtype=torch.bfloat16)
    assert k.shape == v.shape == (t, 8, 128) and k.dtype == torch.bfloat16
    zh = enc.encode_patch(3, torch.randn(t, 4096))
    assert dec.align_patch(3, zh).shape == (t, 4096)
    with pytest.raises(ValueError, match="patch layer, not reuse"):
        enc.encode_reuse(3, torch.randn(t, 8, 128), torch.randn(t, 8, 128), pos)


@pytest.mark.parametrize("head_mode", ["joint", "per_head"])
def test_nested_levels_equal_separate_fits(tiny_pair, head_mode):
    """A lower level's code is the top code's prefix (one encoder) and decodes exactly as a
    separate fit at that rank; errors shrink as the level grows; the decoder reads the level
    from the codes' width."""
    import dataclasses

    seqs = [list(range(100 + 7 * i, 160 + 9 * i)) for i in range(4)]
    _, arch, taps, pos, valid = _capture(tiny_pair["producer"], seqs)
    _, _, taps_b, _, _ = _capture(tiny_pair["b"], seqs)
    rot = KeyRotary.from_arch(arch)
    ks = [{l: t.k[l][valid] for l in t.k} for t in (taps, taps_b)]
    vs = [{l: t.v[l][valid] for l in t.v} for t in (taps, taps_b)]
    mom = ReuseMoments(arch.num_hidden_layers, arch.num_key_value_heads, arch.head_dim, 1, head_mode=head_mode)
    for layer in range(arch.num_hidden_layers):
        mom.update(layer, [rot.derope(k[layer], pos) for k in ks], [v[layer] for v in vs])
    levels = ((2, 3), (4, 6))
    tensors, _ = fit_reuse(mom, range(arch.num_hidden_layers), 8, 12, ["b"], 1e-4, levels)
    man = dataclasses.replace(_manifest(arch, ["b"], 8, 12, head_mode=head_mode), rank_levels=levels)
    art = ScdArtifacts(man, tensors)
    enc, dec = ScdEncoder(art), ScdDecoder(art, "b")
    assert man.levels == ((2, 3), (4, 6), (8, 12))
    assert [man.bytes_per_token_at(lv) for lv in man.levels] == sorted({man.bytes_per_token_at(lv) for lv in man.levels})
    layer = arch.num_hidden_layers - 1
    errs = []
    for r_k, r_v in man.levels:
        zk, zv = enc.encode_reuse(layer, ks[0][layer], vs[0][layer], pos, (r_k, r_v))
        assert zk.shape[-1] == r_k and zv.shape[-1] == r_v
        k_hat, v_hat = dec.decode_reuse(layer, zk, zv, pos)
        errs.append(float((k_hat - ks[1][layer]).norm() / ks[1][layer].norm()))
        t_sep, _ = fit_reuse(mom, range(arch.num_hidden_layers), r_k, r_v, ["b"], 1e-4)
        sep = ScdArtifacts(_manifest(arch, ["b"], r_k, r_v, head_mode=head_mode), t_sep)
        zk2, zv2 = ScdEncoder(sep).encode_reuse(layer, ks[0][layer], vs[0][layer], pos)
        k2, v2 = ScdDecoder(sep, "b").decode_reuse(layer, zk2, zv2, pos)
        assert torch.allclose(k_hat, k2, atol=1e-4, rtol=1e-3) and torch.allclose(v_hat, v2, atol=1e-4, rtol=1e-3)
    assert errs[0] > errs[1] > errs[2]
    with pytest.raises(ValueError):
        enc.encode_reuse(layer, ks[0][layer], vs[0][layer], pos, (3, 3))
    with pytest.raises(ValueError):
        dec.decode_reuse(layer, zk[..., :3], zv, pos)
    with pytest.raises(ValueError):
        dataclasses.replace(man, rank_levels=((4, 6), (2, 3)))
    assert ScdManifest.from_dict(man.to_dict()) == man
