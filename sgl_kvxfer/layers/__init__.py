"""Layers the models are built from: RMSNorm (layernorm.py), RoPE (rope.py), the fused elementwise
ops dispatch (fused_ops.py), CPU linears (cpu_linear.py) and the attention backends (attention/).
They import kernels/, mem_cache/ and forward_batch.py, never models/ or anything above."""
