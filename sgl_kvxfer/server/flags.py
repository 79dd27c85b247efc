"""Command-line flags with SGLang's names.

Our own flags come from the `ServerArgs` dataclass chain (`ServerArgs.add_cli_args`). SGLang flags
we do not implement are never silently ignored: a flag in `_NOOP_AT` is accepted only with the
value that makes it a no-op here (e.g. `--tp-size 1`), a switch in `_NOOP_SWITCHES` is accepted
with a warning, and everything in `UNSUPPORTED_FLAGS` stops the launch with an error naming it.
"""
from __future__ import annotations

import argparse
import logging

from sgl_kvxfer.config import ServerArgs

logger = logging.getLogger(__name__)

# flag -> the only accepted values (None: any value is accepted and ignored).
_NOOP_AT: dict[str, tuple[str, ...] | None] = {
    "--tp-size": ("1",), "--tensor-parallel-size": ("1",), "--dp-size": ("1",), "--data-parallel-size": ("1",),
    "--pp-size": ("1",), "--pipeline-parallel-size": ("1",), "--ep-size": ("1",), "--nnodes": ("1",),
    "--node-rank": ("0",), "--kv-cache-dtype": ("auto",), "--tokenizer-mode": ("auto",),
    "--log-level-http": None,
    "--watchdog-timeout": None, "--quantization": ("none",),
}
_NOOP_SWITCHES = ("--trust-remote-code", "--log-requests", "--disable-cuda-graph-padding",
                  "--enable-cache-report", "--skip-server-warmup")
UNSUPPORTED_FLAGS = (
    "--speculative-algorithm", "--speculative-draft-model-path", "--speculative-num-steps",
    "--speculative-eagle-topk", "--speculative-num-draft-tokens", "--enable-lora", "--lora-paths",
    "--max-loras-per-batch", "--lora-backend", "--max-lora-rank", "--enable-dp-attention", "--expert-parallel-size",
    "--dist-init-addr", "--incremental-streaming-output", "--decode-attention-backend", "--prefill-attention-backend",
    "--radix-cache-backend", "--max-queued-requests", "--enable-hierarchical-cache", "--hicache-ratio",
    "--disaggregation-decode-allocation-policy", "--enable-pd-role-switch",
    "--load-balance-method",
    "--enable-torch-compile", "--tool-call-parser", "--reasoning-parser", "--chat-template", "--is-embedding",
    "--grammar-backend", "--enable-mixed-chunk", "--enable-two-batch-overlap", "--json-model-override-args",
    "--revision", "--allow-auto-truncate", "--kv-events-config", "--enable-deterministic-inference",
    "--sampling-backend", "--weight-version", "--enable-multimodal", "--mm-attention-backend",
    "--enable-tokenizer-batch-encode", "--tokenizer-worker-num", "--file-storage-path", "--enable-eplb",
    "--moe-a2a-backend", "--moe-runner-backend", "--enable-fp32-lm-head", "--cpu-offload-gb",
)


class FlagError(ValueError):
    pass


def _strip_compat_flags(argv: list[str], known: set[str]) -> list[str]:
    """Remove accepted no-op SGLang flags; raise FlagError on unimplemented ones. Flags the
    parser knows (`known`) always pass through, so implementing one later needs no edit here."""
    rest, i = [], 0
    while i < len(argv):
        token = argv[i]
        name, eq, inline = token.partition("=")
        if name in known:
            rest.append(token)
        elif name in UNSUPPORTED_FLAGS:
            raise FlagError(f"SGLang flag {name} is not implemented by sgl_kvxfer; remove it "
                            "(see docs/http_api.md for the supported flags)")
        elif name in _NOOP_AT:
            if eq:
                value = inline
            else:
                if i + 1 >= len(argv):
                    raise FlagError(f"{name} expects a value")
                value = argv[i + 1]
                i += 1
            allowed = _NOOP_AT[name]
            if allowed is not None and value not in allowed:
                raise FlagError(f"SGLang flag {name} {value} is not implemented by sgl_kvxfer "
                                f"(only {name} {' / '.join(allowed)} is accepted)")
            logger.warning("ignoring SGLang flag %s %s (a no-op in sgl_kvxfer)", name, value)
        elif name in _NOOP_SWITCHES and not eq:
            logger.warning("ignoring SGLang flag %s (a no-op in sgl_kvxfer)", name)
        else:
            rest.append(token)
        i += 1
    return rest


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sgl-kvxfer-server", description="sgl_kvxfer HTTP server (SGLang 0.5.23 wire-compatible)")
    ServerArgs.add_cli_args(parser)
    return parser


def parse_server_args(argv: list[str]) -> ServerArgs:
    parser = build_parser()
    try:
        rest = _strip_compat_flags(list(argv), set(parser._option_string_actions))
    except FlagError as e:
        parser.error(str(e))
    namespace = parser.parse_args(rest)
    try:
        return ServerArgs.from_cli_args(namespace)
    except (TypeError, ValueError) as e:
        parser.error(str(e))
