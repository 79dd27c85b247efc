"""CPU ISA detection and the SGL_KVXFER_CPU_ISA cap (sgl_kvxfer/utils/cpu_isa.py): plain logic
over flag sets, so every case runs on any machine."""
import pytest

from sgl_kvxfer.utils import cpu_isa

AVX2 = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c"})
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
SPR = AVX512 | {"avx512_bf16", "amx_bf16", "amx_tile", "amx_int8"}


@pytest.mark.parametrize("flags,level", [(frozenset({"sse4_2"}), "baseline"), (AVX2, "avx2"), (AVX512, "avx512"),
                                         (AVX512 | {"avx512_bf16"}, "avx512_bf16"), (SPR, "amx"),
                                         (AVX2 | {"avx512f"}, "avx2")])  # AVX-512 F alone is not enough
def test_detected_level(flags, level):
    assert cpu_isa.detected_level(flags) == level


def _pretend(monkeypatch, flags, cap=None):
    monkeypatch.setattr(cpu_isa, "cpu_flags", lambda: flags)
    monkeypatch.setattr(cpu_isa, "_is_x86", lambda: True)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)  # set by test/conftest.py under a cap
    if cap is None:
        monkeypatch.delenv("SGL_KVXFER_CPU_ISA", raising=False)
    else:
        monkeypatch.setenv("SGL_KVXFER_CPU_ISA", cap)


def test_avx2_cpu_takes_the_fallbacks(monkeypatch):
    _pretend(monkeypatch, AVX2)
    assert cpu_isa.level() == "avx2" and not cpu_isa.onednn_bf16_linear()
    assert cpu_isa.native_build_flags() == ["-march=x86-64-v3"]
    _pretend(monkeypatch, AVX2 | {"avx_ne_convert"})  # oneDNN's other bf16 route
    assert cpu_isa.onednn_bf16_linear()


def test_cap_forces_the_avx2_paths_on_an_avx512_cpu(monkeypatch):
    _pretend(monkeypatch, SPR)
    assert cpu_isa.level() == "amx" and cpu_isa.onednn_bf16_linear()
    assert "-mprefer-vector-width=512" in cpu_isa.native_build_flags()
    _pretend(monkeypatch, SPR, cap="avx2")
    assert cpu_isa.level() == "avx2" and not cpu_isa.onednn_bf16_linear()
    assert cpu_isa.native_build_flags() == ["-march=x86-64-v3"]
    assert cpu_isa.torch_cap_env() == {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
    assert "capped" in cpu_isa.describe()
    _pretend(monkeypatch, SPR, cap="avx512")  # below what the CPU has: its extensions stay out
    assert "-mno-avx512bf16" in cpu_isa.native_build_flags()


def test_onednn_cap_turns_off_the_bf16_prepack(monkeypatch):
    """ONEDNN_MAX_CPU_ISA=AVX2 set outside us (by a user, or test/conftest.py under a cap):
    oneDNN's bf16 reorder raises even on an AVX-512 CPU, so the fp32 fallback is taken."""
    _pretend(monkeypatch, SPR)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert not cpu_isa.onednn_bf16_linear()
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_AMX")
    assert cpu_isa.onednn_bf16_linear()


def test_cap_never_raises_the_level(monkeypatch):
    _pretend(monkeypatch, AVX2, cap="amx")
    assert cpu_isa.level() == "avx2"
    _pretend(monkeypatch, AVX2, cap="auto")
    assert cpu_isa.level() == "avx2" and cpu_isa.torch_cap_env() == {}


def test_unknown_cap_is_a_clear_error(monkeypatch):
    _pretend(monkeypatch, AVX2, cap="avx9000")
    with pytest.raises(ValueError, match="SGL_KVXFER_CPU_ISA"):
        cpu_isa.level()
