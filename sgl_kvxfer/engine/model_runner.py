"""ModelRunner: weights, KV pool, req-to-token table and attention backend; runs a ForwardBatch.

Owns every tensor of the engine. The scheduler talks to it only through `forward(batch)` and
the pool/allocator handles it exposes. Start-up order (scheduler/startup.py):

    load_weights(config) -> LoadedModel      the memory check (check_memory), then the weights on
                                             the device, no KV memory yet
    (tiered pool only) the int4 decision     it divides the pool's memory between the tiers
    ModelRunner(config, loaded, int4)        the KV pool, sized once, then the CUDA graphs
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from sgl_kvxfer import env
from sgl_kvxfer.config import EngineConfig
from sgl_kvxfer.engine.cuda_graph_runner import create_cuda_graph_runner
from sgl_kvxfer.engine.memory import kv_pool_tokens, plan_memory
from sgl_kvxfer.engine.prefill_graph_runner import create_prefill_graph_runner
from sgl_kvxfer.forward_batch import ForwardBatch
from sgl_kvxfer.layers.attention import create_attention_backend
from sgl_kvxfer.mem_cache import create_kv_pool, create_slot_allocator
from sgl_kvxfer.mem_cache.req_to_token import ReqToTokenPool

if TYPE_CHECKING:
    from sgl_kvxfer.models.arch_config import ModelArchConfig

logger = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    """The model's weights on their device and what was read with them; no KV memory yet."""
    model_dir: str
    hf_config: dict
    model: torch.nn.Module
    arch: ModelArchConfig
    dtype: torch.dtype
    stored_layers: int | None  # FusedKV (config.json's fusedkv section): only the bottom layers store KV


def load_weights(config: EngineConfig, max_running_requests: int | None = None,
                 max_prefill_tokens: int = 16384) -> LoadedModel:
    from sgl_kvxfer.models.arch_config import ModelArchConfig
    from sgl_kvxfer.models.loader import load_model, resolve_dtype, resolve_model_path

    device = config.resolved_device
    torch.manual_seed(config.random_seed)
    model_dir = resolve_model_path(config.model_path)
    with open(os.path.join(model_dir, "config.json")) as f:
        hf_config = json.load(f)
    arch = ModelArchConfig.from_hf_dict(hf_config)
    dtype = resolve_dtype(config.dtype, arch, device)
    check_memory(config, arch, dtype, stored_layers(hf_config), max_running_requests, max_prefill_tokens)
    model, arch = load_model(model_dir, config.load_format, dtype, device, config.random_seed,
                             merge_lora=config.merge_lora)
    model.eval()
    if device == "cpu":
        _prepare_cpu(model, dtype)
    return LoadedModel(model_dir, hf_config, model, arch, dtype, stored_layers(hf_config))


def check_memory(config: EngineConfig, arch, dtype: torch.dtype, stored: int | None,
                 max_running_requests: int | None, max_prefill_tokens: int) -> None:
    """Before any weight loads: the configuration must fit what the device has left
    (engine/memory.py), else start-up stops with the numbers."""
    from sgl_kvxfer.utils import cpu_isa

    device = config.resolved_device
    prepared = 0  # CPU bf16 linears get a prepared copy (_prepare_cpu): bf16 packed or fp32
    if device == "cpu" and dtype == torch.bfloat16 and env.CPU_KERNELS.get_bool():
        prepared = 2 if cpu_isa.onednn_bf16_linear() else 4
    plan = plan_memory(device, arch, torch.finfo(dtype).bits // 8, kv_bytes_per_token(arch, stored, dtype),
                       config.mem_fraction_static, config.max_total_tokens, max_prefill_tokens,
                       max_running_requests, prepared)
    logger.info("memory: needs %s", plan.describe())


def kv_bytes_per_token(arch, stored: int | None, dtype: torch.dtype) -> float:
    """K and V of every KV-storing layer (FusedKV: only the `stored` bottom layers)."""
    layers = arch.num_hidden_layers if stored is None else stored
    return 2.0 * layers * arch.num_key_value_heads * arch.head_dim * torch.finfo(dtype).bits / 8


def stored_layers(hf_config: dict) -> int | None:
    """FusedKV (config.json's fusedkv section): how many bottom layers store KV; None: all."""
    from sgl_kvxfer.models.fusedkv_math import FusedKVConfig

    fkv = FusedKVConfig.from_hf_dict(hf_config)
    return None if fkv is None else fkv.num_storage_layers


class ModelRunner:
    def __init__(self, config: EngineConfig, max_running_requests: int | None = None,
                 max_prefill_tokens: int = 16384, loaded: LoadedModel | None = None, int4=None):
        """`loaded`: weights from `load_weights` (None: load them here). `int4`: the int4 decision
        (spectrum/probe.Int4Resolution) a tiered pool is sized by; required when tiering is on,
        because the pool is built once (scheduler/startup.py decides it first)."""
        if config.tiering_enabled and int4 is None:
            raise ValueError("a tiered KV pool is sized by the int4 decision: build the runner with "
                             "scheduler/startup.create_runner, or pass int4")
        self.config = config
        self.device = config.resolved_device
        loaded = loaded or load_weights(config, max_running_requests, max_prefill_tokens)
        self.model_dir, self.hf_config, self.model = loaded.model_dir, loaded.hf_config, loaded.model
        self.arch, self.dtype, self.stored_layers = loaded.arch, loaded.dtype, loaded.stored_layers
        self.int4 = int4
        self.context_len = config.context_length or self.arch.max_position_embeddings
        weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.page_size = config.resolved_page_size
        tokens = kv_pool_tokens(self.device, config.mem_fraction_static, weight_bytes,
                                self._bytes_per_token_estimate(), config.max_total_tokens)
        self.max_total_tokens = tokens - tokens % self.page_size  # whole pages
        if self.max_total_tokens == 0:
            raise RuntimeError(f"the KV pool ({tokens} tokens) is smaller than one page ({self.page_size})")
        self.kv_pool = create_kv_pool(config, self.arch, self.max_total_tokens, self.dtype, self.device,
                                      int4_allowed=None if int4 is None else int4.enabled,
                                      stored_layers=self.stored_layers)
        self.allocator = create_slot_allocator(config, self.kv_pool, self.device)
        if config.tiering_enabled:  # SpectrumKV: a request must fit the fp16 (staging) store
            self.max_total_tokens = self.allocator.size
        self.max_running_requests = max_running_requests or min(256, max(self.max_total_tokens // 32, 4))
        # +1 row so a retracted request can be re-admitted while the batch is full, +1 row the
        # runner keeps: CUDA-graph padding rows read it (never handed out, never written).
        self.req_to_token = ReqToTokenPool(self.max_running_requests + 2,
                                           min(self.context_len, self.max_total_tokens) + 1, self.device)
        self.padding_req_row = self.req_to_token.alloc()
        self.attn_backend = create_attention_backend(
            config.resolved_attention_backend, kv_pool=self.kv_pool,
            num_q_heads=self.arch.num_attention_heads, num_kv_heads=self.arch.num_key_value_heads,
            head_dim=self.arch.head_dim)
        logger.info("model %s (%s) on %s: KV pool %d tokens, %.0f bytes/token, page %d, backend %s",
                    self.model_dir, self.dtype, self.device, self.max_total_tokens,
                    self.kv_pool.bytes_per_token(), self.page_size, config.resolved_attention_backend)
        self.graph_runner = create_cuda_graph_runner(self)  # None where decode graphs do not apply
        self.prefill_graph_runner = create_prefill_graph_runner(self, max_prefill_tokens)  # None: off

    def close(self) -> None:
        """Drop every tensor this runner owns: graphs first (each holds its private memory pool
        and the static buffers it replays), then the backend, the pool, the table and the
        weights. The caller collects cycles and empties the CUDA cache (Engine.shutdown)."""
        for runner in (self.graph_runner, self.prefill_graph_runner):
            for graph in (getattr(runner, "graphs", None) or {}).values():
                graph.reset()
        self.graph_runner = self.prefill_graph_runner = None
        self.attn_backend = self.kv_pool = self.allocator = self.req_to_token = None
        self.model = None

    def _bytes_per_token_estimate(self) -> float:
        return kv_bytes_per_token(self.arch, self.stored_layers, self.dtype)

    def server_info_extra(self) -> dict:
        """Model-variant facts for /get_server_info (FusedKV: the layer storage map and bytes)."""
        pool = self.kv_pool
        if self.stored_layers is None:
            return {}
        fkv = self.model.fusedkv
        return {"fusedkv": {
            "variant": fkv.variant, "num_layers": pool.num_layers, "num_storage_layers": pool.num_stored,
            "source_layers": list(fkv.source_layers), "storage_map": pool.storage_map(),
            "kv_vanilla_bytes_per_token": pool.vanilla_bytes_per_token(),
            "kv_bytes_ratio_vs_vanilla": pool.bytes_per_token() / pool.vanilla_bytes_per_token(),
            "skip_prefill_rows": bool(self.model.skip_prefill_rows),
            "reconstruction_path": getattr(self.attn_backend, "path", None)}}

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Run the model; returns fp32 logits [len(batch.logits_positions), vocab].

        NOTE: a decode batch replayed from a CUDA graph returns a view of the graph's static
        logits; the caller consumes it before the next forward (process_logits does)."""
        if self.graph_runner is not None and self.graph_runner.can_run(batch):
            return self.graph_runner.replay(batch)  # decode: logits_positions == arange(B)
        if self.prefill_graph_runner is not None and self.prefill_graph_runner.can_run(batch):
            return self.prefill_graph_runner.replay(batch)
        batch.attn_backend = self.attn_backend
        self.attn_backend.prepare_metadata(batch)
        hidden = self.model(batch.input_ids, batch.positions, batch)
        if batch.logits_positions.numel() == 0:
            return hidden.new_empty((0, self.arch.vocab_size), dtype=torch.float32)
        if getattr(self.model, "returns_logits_rows", False):  # FusedKV: rows selected mid-model
            return self.model.compute_logits(hidden)
        return self.model.compute_logits(hidden[batch.logits_positions])


def _prepare_cpu(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Everything the CPU paths build or convert once happens here, before the engine serves:
    the native C++ kernels (every CPU dtype samples greedily with them) and, for bf16, the
    linears' prepared weights, whose form follows the ISA (layers/cpu_linear.py)."""
    from sgl_kvxfer.kernels import cpu_ops
    from sgl_kvxfer.utils import cpu_isa

    if not env.CPU_KERNELS.get_bool():
        return
    logger.info("%s", cpu_isa.describe())
    if not cpu_ops.available():
        logger.warning("%s; the torch paths run instead", cpu_ops.load_error())
    if dtype != torch.bfloat16:
        return
    from sgl_kvxfer.layers.cpu_linear import can_prepack, pack_weight, prepack_linears_cpu

    n = prepack_linears_cpu(model)
    head = getattr(model, "lm_head_weight", None)
    if head is not None and can_prepack(head):
        model.packed_lm_head = pack_weight(head)
    logger.info("CPU bf16: %d linears prepared", n)
