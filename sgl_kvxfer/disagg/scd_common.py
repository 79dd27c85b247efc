"""What both SCD roles share: loading the artifacts for this server's model, and their id.

SCD over PD (docs/pd_disaggregation.md, "SCD over PD"): a prefill server started with
`--scd-artifacts DIR` (the producer) encodes its prompt KV into the artifacts' low-rank codes
(disagg/scd_prefill.py); a decode server with the same DIR and its own, different weights (a
consumer) rebuilds its KV from them (disagg/scd_decode.py). The codec is sgl_kvxfer/scd/.

The *manifest id* names one calibration run: sha256 over manifest.json and
producer.safetensors (the encoders every consumer's decoders were fitted against). The producer
publishes it through the bootstrap server (`scd` in /route) and every claim carries the
consumer's; a difference is a clear error for the request, never a silent decode.
"""
from __future__ import annotations

import hashlib
import logging
import os

logger = logging.getLogger(__name__)


class ScdSetupError(RuntimeError):
    """The server cannot serve SCD with these artifacts (raised at start-up)."""


def manifest_id(art_dir: str) -> str:
    from sgl_kvxfer.scd.artifacts import MANIFEST, PRODUCER_FILE

    h = hashlib.sha256()
    for name in (MANIFEST, PRODUCER_FILE):
        path = os.path.join(art_dir, name)
        if not os.path.isfile(path):
            raise ScdSetupError(f"--scd-artifacts {art_dir}: no {name} (both sides need the whole calibration "
                                "output: its producer file names the run every consumer decodes against)")
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                h.update(block)
        h.update(b"\0")
    return h.hexdigest()


def model_spec(runner):
    """What `ScdArtifacts.check_pair` identifies this server's model by: its dir (+ the LoRA
    adapter merged at load), or only its architecture for dummy weights (timing runs)."""
    cfg = runner.config
    if cfg.load_format == "dummy":
        return runner.arch
    return (runner.model_dir, getattr(cfg, "merge_lora", None))


def load_producer(art_dir: str, runner):
    """(artifacts with the producer side only, manifest id); ScdSetupError if this server's
    model is not the artifacts' producer."""
    from sgl_kvxfer.scd.artifacts import ScdArtifacts, ScdPairError

    mid = manifest_id(art_dir)
    arts = ScdArtifacts.load(art_dir, producer=True, consumers=[], device=runner.device)
    try:
        arts.check_pair(producer=model_spec(runner))
    except ScdPairError as e:
        raise ScdSetupError(f"--scd-artifacts {art_dir}: {e}") from e
    _check_shape(arts.manifest, runner.arch, art_dir)
    return arts, mid


def load_consumer(art_dir: str, runner, name: str | None):
    """(artifacts with this consumer's side, its name, manifest id). `name` None: the consumer
    whose identity matches this server's weights."""
    from sgl_kvxfer.scd.artifacts import ScdArtifacts, ScdPairError
    from sgl_kvxfer.scd.identity import as_identity

    mid = manifest_id(art_dir)
    manifest = ScdArtifacts.load(art_dir, producer=False, consumers=[]).manifest
    spec = model_spec(runner)
    try:
        if name is None:
            name = ScdArtifacts(manifest, {}).check_pair(consumer=spec)
        else:
            wanted = next((c for c in manifest.consumers if c.name == name), None)
            if wanted is None:
                raise ScdSetupError(f"--scd-consumer {name!r}: {art_dir} names consumers {manifest.consumer_names}")
            if not as_identity(spec).matches(wanted):
                ScdArtifacts(manifest, {}).check_pair(consumer=spec)  # the error names what differs
                raise ScdSetupError(f"--scd-consumer {name!r}: this server's model is another consumer "
                                    f"of {art_dir}, not {name!r}")
    except ScdPairError as e:
        raise ScdSetupError(f"--scd-artifacts {art_dir}: {e}") from e
    _check_shape(manifest, runner.arch, art_dir)
    arts = ScdArtifacts.load(art_dir, producer=False, consumers=[name], device=runner.device)
    return arts, name, mid


def _check_shape(manifest, arch, art_dir: str) -> None:
    got = (arch.num_hidden_layers, arch.num_key_value_heads, arch.head_dim, arch.hidden_size)
    want = (manifest.num_layers, manifest.num_kv_heads, manifest.head_dim, manifest.hidden_size)
    if got != want:
        raise ScdSetupError(f"--scd-artifacts {art_dir}: made for (layers, kv heads, head dim, hidden) {want}, "
                            f"this model has {got}")


def route_info(manifest, mid: str) -> dict:
    """The producer's `scd` entry in its bootstrap registration (what a consumer checks)."""
    return {"manifest_id": mid, "consumers": list(manifest.consumer_names), "bytes_per_token": manifest.bytes_per_token,
            "reuse_layers": list(manifest.reuse_layers), "patch_layers": list(manifest.patch_layers),
            "ranks": [manifest.r_k, manifest.r_v, manifest.r_h], "dtype": manifest.dtype}
