"""Unit codes (calib/fit.py `unit_codes`): every code column at unit variance on the calibration
data, the decoders fitted on the scaled codes. Float codes decode to the same values; on a
quantised wire the decoded error falls, since one per-token scale no longer follows the leading
principal column alone. The manifest's code_scale and the config's --code-scale say which."""
import pytest
import torch

from sgl_kvxfer.mem_cache.scd_quant import fake_quant
from sgl_kvxfer.models.arch_config import ModelArchConfig
from sgl_kvxfer.models.presets import write_preset_config
from sgl_kvxfer.scd.artifacts import ScdManifest, make_random_artifacts
from sgl_kvxfer.scd.calib.calibrate import CalibConfig
from sgl_kvxfer.scd.calib.fit import JointMoments, fit_joint


def _pair(n, width=48, seed=0):
    """Producer rows a with a fast-decaying spectrum (as K/V's principal components have) and a
    consumer b = a M + noise: x = [a | b], float64."""
    fixed = torch.Generator().manual_seed(1234)  # the pair itself; `seed` draws its tokens
    basis = torch.linalg.qr(torch.randn(width, width, generator=fixed, dtype=torch.float64))[0]
    m = torch.eye(width, dtype=torch.float64) + 0.2 * torch.randn(width, width, generator=fixed,
                                                                  dtype=torch.float64) / width ** 0.5
    spectrum = 0.8 ** torch.arange(width, dtype=torch.float64)
    g = torch.Generator().manual_seed(seed)
    a = (torch.randn(n, width, generator=g, dtype=torch.float64) * spectrum) @ basis.T + 0.3
    b = a @ m + 1e-3 * torch.randn(n, width, generator=g, dtype=torch.float64)
    return a, b


def _fit(unit: bool, rank: int, levels=()):
    a, b = _pair(4000)
    jm = JointMoments(1, a.shape[1], 2)
    jm.update(torch.cat([a, b], -1)[None])
    return fit_joint(jm, rank, 1e-6, levels=levels, unit_codes=unit)


def _decoded(fit, a, bits=None, r=None):
    enc = fit.enc[0].double() if r is None else fit.enc[0].double()[:, :r]
    dec = fit.dec[0][0].double() if r is None else fit.dec_at[r][0][0].double()
    z = (a - fit.mu_a[0].double()) @ enc
    if bits:
        z = fake_quant(z.float(), bits).double()
    return z @ dec + fit.mu_b[0][0].double()


def _rel_err(x, ref):
    return float(((x - ref) ** 2).sum() / ((ref - ref.mean(0)) ** 2).sum())


def test_unit_codes_have_unit_variance_and_keep_the_float_decode():
    a, b = _pair(1000, seed=1)  # held out
    plain, unit = _fit(False, 32, levels=(8,)), _fit(True, 32, levels=(8,))
    z = (a - unit.mu_a[0].double()) @ unit.enc[0].double()
    assert torch.allclose(z.var(0), torch.ones(32, dtype=torch.float64), rtol=0.15)
    zp = (a - plain.mu_a[0].double()) @ plain.enc[0].double()
    assert zp.var(0)[0] / zp.var(0)[-1] > 1e3  # the unscaled code spans orders of magnitude
    for r in (None, 8):  # the top rank and a nested level decode as before (float32 matrices)
        x, y = _decoded(unit, a, r=r), _decoded(plain, a, r=r)
        assert _rel_err(x, y) < 1e-7 and _rel_err(x, b) == pytest.approx(_rel_err(y, b), rel=1e-3)


@pytest.mark.parametrize("bits", [4, 8])
def test_unit_codes_lower_the_quantised_error(bits):
    a, b = _pair(1000, seed=2)
    plain, unit = _fit(False, 32), _fit(True, 32)
    e_plain, e_unit = _rel_err(_decoded(plain, a, bits), b), _rel_err(_decoded(unit, a, bits), b)
    e_float = _rel_err(_decoded(unit, a), b)
    # on this pair: int4 0.0132 -> 0.0095, int8 9.6e-5 -> 4.6e-5 (float 1.8e-5, the rank cut)
    assert e_unit < (0.8 if bits == 4 else 0.6) * e_plain, (e_unit, e_plain)
    assert e_float < e_unit


def test_manifest_and_config_name_the_code_scale(tmp_path):
    arch = ModelArchConfig.from_dir(write_preset_config("tiny", str(tmp_path)))
    m = make_random_artifacts(arch, 1, 4, 4, 8, patch_layers=[0]).manifest
    assert m.code_scale == "none"
    d = m.to_dict()
    d.pop("code_scale")  # a manifest written before the field: the principal components' own scale
    assert ScdManifest.from_dict(d).code_scale == "none"
    d["code_scale"] = "unit"
    assert ScdManifest.from_dict(d).code_scale == "unit"
    with pytest.raises(ValueError, match="code_scale"):
        ScdManifest.from_dict({**d, "code_scale": "whiten"})
    cons = ("a=x",)
    # auto (the default): unit for int4 codes only
    assert CalibConfig(consumers=cons, code_dtype="int4").unit_codes
    for dtype in ("int8", "bfloat16", "float32"):
        assert not CalibConfig(consumers=cons, code_dtype=dtype).unit_codes
    assert not CalibConfig(consumers=cons, code_dtype="int4", code_scale="none").unit_codes
    assert CalibConfig(consumers=cons, code_dtype="int8", code_scale="unit").unit_codes
    assert CalibConfig(consumers=cons, code_scale="unit").unit_codes
    with pytest.raises(ValueError, match="code-scale"):
        CalibConfig(consumers=cons, code_scale="whiten")
