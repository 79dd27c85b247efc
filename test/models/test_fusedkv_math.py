"""FusedKV math: config parsing/validation, fusion vs a naive loop, the RoPE pair constraint
(shift invariance of scores), init schemes, least-squares fitting, checkpoint checks."""
import pytest
import torch

from sgl_kvxfer.layers.rope import RotaryEmbedding, apply_rope
from sgl_kvxfer.models.fusedkv_math import (
    FusedKVConfig, FusionLstsq, KVFusion, check_fusion_tensors, expand_key_weight, fit_fusion_weights_lstsq,
    fuse_kv, fusion_param_names, fusion_param_shapes, init_fusion_weights)


# ---- config -------------------------------------------------------------------------------
def test_config_defaults_bottom_half():
    c = FusedKVConfig.from_hf_dict({"num_hidden_layers": 30, "fusedkv": {}})
    assert c.variant == "fusedkv" and c.num_storage_layers == 15 and c.source_layers == (0, 14)
    assert list(c.storage_layers) == list(range(15)) and list(c.reconstruction_layers) == list(range(15, 30))
    assert c.kv_layer_fraction == 0.5 and c.is_storage(14) and not c.is_storage(15)
    assert FusedKVConfig.from_hf_dict({"num_hidden_layers": 30}) is None
    # round trip through the config.json section
    assert FusedKVConfig.from_hf_dict({"num_hidden_layers": 30, "fusedkv": c.to_dict()}) == c
    odd = FusedKVConfig(num_hidden_layers=5)
    assert odd.num_storage_layers == 2 and odd.source_layers == (0, 1)


def test_config_lite_sources():
    c = FusedKVConfig(num_hidden_layers=8, variant="lite")
    assert c.kv_sources(2) == (2, 2)  # storage layer: its own
    assert c.kv_sources(5) == (3, 0)  # K from the last storage layer, V from the bottom layer
    assert not c.has_fusion_weights and init_fusion_weights(c, 2, 8) == {}
    with pytest.raises(ValueError, match="fuses two sources"):
        FusedKVConfig(num_hidden_layers=8).kv_sources(5)


@pytest.mark.parametrize("section, match", [
    ({"variant": "yoco"}, "variant"),
    ({"init": "zeros"}, "init"),
    ({"num_storage_layers": 0}, "num_storage_layers"),
    ({"num_storage_layers": 8}, "num_storage_layers"),
    ({"num_storage_layers": 2.5}, "num_storage_layers"),
    ({"source_layers": [0, 4]}, "source_layers"),  # 4 is not a storage layer (n = 4)
    ({"source_layers": [-1, 3]}, "source_layers"),
    ({"source_layers": [0]}, "source_layers"),
    ({"storage_layers": 4}, "unknown keys"),
])
def test_config_validation_errors(section, match):
    with pytest.raises(ValueError, match=match):
        FusedKVConfig.from_hf_dict({"num_hidden_layers": 8, "fusedkv": section})


def test_config_validation_misc():
    with pytest.raises(ValueError, match="must be an object"):
        FusedKVConfig.from_hf_dict({"num_hidden_layers": 8, "fusedkv": "lite"})
    with pytest.raises(ValueError, match="at least 2 layers"):
        FusedKVConfig(num_hidden_layers=1)


# ---- fusion -------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fuse_kv_matches_naive_loop(dtype):
    g = torch.Generator().manual_seed(0)
    T, H, D = 5, 3, 8
    k0, k1, v0, v1 = (torch.randn(T, H, D, generator=g).to(dtype) for _ in range(4))
    kp, vw = torch.randn(2, H, D // 2, generator=g), torch.randn(2, H, D, generator=g)
    kw = expand_key_weight(kp)
    k, v = fuse_kv(k0, k1, v0, v1, kw, vw)
    assert k.dtype == dtype and k.shape == (T, H, D)
    for t in range(T):
        for h in range(H):
            for d in range(D):
                pair = d % (D // 2)  # half layout: channel d pairs with d +- D/2
                ek = kp[0, h, pair] * k0[t, h, d].float() + kp[1, h, pair] * k1[t, h, d].float()
                ev = vw[0, h, d] * v0[t, h, d].float() + vw[1, h, d] * v1[t, h, d].float()
                assert k[t, h, d].item() == ek.to(dtype).item()
                assert v[t, h, d].item() == ev.to(dtype).item()
    # the nn.Module gives the same values and gradients reach both parameters
    m = KVFusion(H, D)
    with torch.no_grad():
        m.key_pair_weight.copy_(kp)
        m.value_weight.copy_(vw)
    mk, mv = m(k0, k1, v0, v1)
    assert torch.equal(mk, k) and torch.equal(mv, v)
    (mk.float().sum() + mv.float().sum()).backward()
    assert m.key_pair_weight.grad.abs().sum() > 0 and m.value_weight.grad.abs().sum() > 0


def test_expand_layouts():
    w = torch.tensor([1.0, 2.0, 3.0])
    assert expand_key_weight(w).tolist() == [1, 2, 3, 1, 2, 3]
    assert expand_key_weight(w, "interleaved").tolist() == [1, 1, 2, 2, 3, 3]
    with pytest.raises(ValueError):
        expand_key_weight(w, "neox")


def _interleaved_rope(x, pos, theta=10000.0):
    """The paper's (2j, 2j+1) rotation, x [T, H, D], pos [T]."""
    D = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    ang = pos.double()[:, None, None] * inv  # [T, 1, D/2]
    a, b = x.double()[..., 0::2], x.double()[..., 1::2]
    out = torch.empty(x.shape, dtype=torch.float64)
    out[..., 0::2], out[..., 1::2] = a * ang.cos() - b * ang.sin(), a * ang.sin() + b * ang.cos()
    return out


def _fused_scores(layout, key_pair, shift, asym=0.0):
    """Scores of q at position 40 + shift against fused keys at positions 0..7 + shift."""
    g = torch.Generator().manual_seed(1)
    T, H, D = 8, 2, 16
    q, k0, k1 = (torch.randn(T, H, D, generator=g, dtype=torch.float64) for _ in range(3))
    kpos = torch.arange(T) + shift
    qpos = torch.full((T,), 40) + shift
    if layout == "half":
        inv = RotaryEmbedding(D, 10000.0, None, 4096).inv_freq.double()  # the model's frequencies
        rot = lambda x, p: apply_rope(x, (p[:, None, None] * inv).cos(), (p[:, None, None] * inv).sin())  # noqa: E731
    else:
        rot = _interleaved_rope
    kw = expand_key_weight(key_pair.double(), layout)
    kw[..., 0] += asym  # break the pair symmetry of one channel (negative control)
    fused, _ = fuse_kv(rot(k0, kpos), rot(k1, kpos), k0, k1, kw, torch.ones_like(kw))
    return torch.einsum("hd,thd->ht", rot(q, qpos)[0], fused)


@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_rope_symmetry_scores_shift_invariant(layout):
    kp = torch.randn(2, 2, 8, generator=torch.Generator().manual_seed(2))
    base = _fused_scores(layout, kp, 0)
    for shift in (1, 7, 333):
        torch.testing.assert_close(_fused_scores(layout, kp, shift), base, rtol=1e-9, atol=1e-9)
    # the control: unequal weights inside one rotary pair make scores depend on absolute position
    assert (_fused_scores(layout, kp, 333, asym=0.7) - _fused_scores(layout, kp, 0, asym=0.7)).abs().max() > 1e-3


# ---- init ---------------------------------------------------------------------------------
def test_init_shapes_and_lite_init():
    c = FusedKVConfig(num_hidden_layers=6, init="lite")
    w = init_fusion_weights(c, 2, 8)
    assert sorted(w) == [3, 4, 5]
    kp, vw = w[4]
    assert (kp.shape, vw.shape) == fusion_param_shapes(2, 8)
    assert kp[0].eq(0).all() and kp[1].eq(1).all() and vw[0].eq(1).all() and vw[1].eq(0).all()


def test_equivalent_init_matches_iterative_fusion():
    """Appendix A.3: equivalent init == the iterative chain run with the same auxiliary draws."""
    c = FusedKVConfig(num_hidden_layers=8, init="equivalent", init_seed=3)
    H, D = 2, 8
    w = init_fusion_weights(c, H, D)
    g = torch.Generator().manual_seed(3)
    ks, vs = fusion_param_shapes(H, D)
    ksrc = [torch.randn(H, D // 2, dtype=torch.float64) for _ in range(2)]  # stand-in caches
    vsrc = [torch.randn(H, D, dtype=torch.float64) for _ in range(2)]
    k = v = None
    for i in c.reconstruction_layers:
        if k is None:
            a, b = torch.randn(ks, generator=g).double(), torch.randn(vs, generator=g).double()
            k, v = a[0] * ksrc[0] + a[1] * ksrc[1], b[0] * vsrc[0] + b[1] * vsrc[1]
        else:
            ap, an = torch.randn(ks[1:], generator=g).double(), torch.randn(ks[1:], generator=g).double()
            bp, bn = torch.randn(vs[1:], generator=g).double(), torch.randn(vs[1:], generator=g).double()
            k, v = ap * k + an * ksrc[1], bp * v + bn * vsrc[0]
        kp, vw = w[i]
        torch.testing.assert_close(kp[0].double() * ksrc[0] + kp[1].double() * ksrc[1], k, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(vw[0].double() * vsrc[0] + vw[1].double() * vsrc[1], v, rtol=1e-5, atol=1e-5)
    n1 = init_fusion_weights(FusedKVConfig(num_hidden_layers=8, init="normal"), H, D)
    assert not torch.equal(n1[5][0], w[5][0])


# ---- least squares ------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_lstsq_recovers_weights(layout):
    g = torch.Generator().manual_seed(4)
    T, H, D = 64, 2, 8
    k0, k1, v0, v1 = (torch.randn(T, H, D, generator=g) for _ in range(4))
    kp, vw = torch.randn(2, H, D // 2, generator=g), torch.randn(2, H, D, generator=g)
    kt, vt = fuse_kv(k0, k1, v0, v1, expand_key_weight(kp, layout), vw)
    fk, fv = fit_fusion_weights_lstsq(k0, k1, kt, v0, v1, vt, rope_layout=layout, ridge=0.0)
    torch.testing.assert_close(fk, kp, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(fv, vw, rtol=1e-4, atol=1e-4)
    # a target outside the span: the constrained fit beats any other pair-tied weights
    noisy = kt + 0.3 * torch.randn(kt.shape, generator=g)
    fk, _ = fit_fusion_weights_lstsq(k0, k1, noisy, v0, v1, vt, rope_layout=layout)
    err = lambda p: (fuse_kv(k0, k1, v0, v1, expand_key_weight(p, layout), vw)[0] - noisy).pow(2).sum()  # noqa: E731
    assert err(fk) <= err(kp) and err(fk) < err(fk + 0.01)


def test_lstsq_dead_channel_is_finite():
    z = torch.zeros(16, 1, 4)
    fk, fv = fit_fusion_weights_lstsq(z, z, z, z, z, z)
    assert torch.isfinite(fk).all() and torch.isfinite(fv).all()


# ---- checkpoint ---------------------------------------------------------------------------
def test_check_fusion_tensors():
    c = FusedKVConfig(num_hidden_layers=4)
    ks, vs = fusion_param_shapes(2, 8)
    t = {}
    for i in (2, 3):
        kn, vn = fusion_param_names(i)
        t[kn], t[vn] = torch.zeros(ks), torch.zeros(vs)
    assert fusion_param_names(2)[0] == "model.layers.2.self_attn.kv_fusion.key_pair_weight"
    check_fusion_tensors(c, t, 2, 8)
    with pytest.raises(ValueError, match="lacks"):
        check_fusion_tensors(c, {k: v for k, v in t.items() if "layers.3" not in k}, 2, 8)
    with pytest.raises(ValueError, match="shape"):
        check_fusion_tensors(c, {**t, fusion_param_names(2)[0]: torch.zeros(vs)}, 2, 8)
    with pytest.raises(ValueError, match="unexpected"):
        check_fusion_tensors(FusedKVConfig(num_hidden_layers=4, variant="lite"), t, 2, 8)


def test_lstsq_streaming_equals_one_shot():
    g = torch.Generator().manual_seed(5)
    xs = [torch.randn(40, 2, 8, generator=g) for _ in range(6)]
    one = fit_fusion_weights_lstsq(*xs)
    fit = FusionLstsq()
    for lo, hi in ((0, 16), (16, 29), (29, 40)):
        fit.update(*(x[lo:hi] for x in xs))
    for a, b in zip(one, fit.solve()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="before any update"):
        FusionLstsq().solve()
