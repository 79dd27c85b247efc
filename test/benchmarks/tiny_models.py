"""A random tiny Llama with SmolLM2's tokenizer (scripts/train/make_tiny_model.py), for scripts that
need real prompts but no real weights."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def tiny_task_model(tmp_path) -> str:
    sys.path.insert(0, os.path.join(ROOT, "scripts", "train"))
    from make_tiny_model import make_tiny_model

    return make_tiny_model(str(tmp_path / "tiny_model"), layers=2, hidden=64, heads=4, kv_heads=2)
