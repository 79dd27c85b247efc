"""Write a small randomly initialized Llama model directory (HF format, with the embedded SmolLM2
tokenizer), for CPU tests and the SCD quick start: a base model that fine-tunes in seconds.

    python scripts/train/make_tiny_model.py --out DIR [--layers 4] [--hidden 64] [--heads 4]
        [--kv-heads 2] [--intermediate 128] [--seed 0]

The vocabulary is SmolLM2's (49152 tokens), so the task suite's prompts tokenize as for the
real model; with hidden 64 that is ~3.2M parameters, almost all in the tied embedding.
"""
from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


def make_tiny_model(out: str, layers: int = 4, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
                    intermediate: int = 128, seed: int = 0, max_positions: int = 4096) -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from sgl_kvxfer.models.loader import load_tokenizer, resolve_model_path

    src = resolve_model_path(None)
    tok = load_tokenizer(src)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=intermediate,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      head_dim=hidden // heads, max_position_embeddings=max_positions, rms_norm_eps=1e-5,
                      tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    tpl = os.path.join(src, "chat_template.jinja")
    if os.path.isfile(tpl) and not os.path.isfile(os.path.join(out, "chat_template.jinja")):
        with open(tpl) as f, open(os.path.join(out, "chat_template.jinja"), "w") as g:
            g.write(f.read())
    return out


def main(argv=None) -> str:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--intermediate", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    if min(a.layers, a.hidden, a.heads, a.kv_heads, a.intermediate) < 1 or a.hidden % a.heads or a.heads % a.kv_heads:
        ap.error("sizes must be >= 1, --hidden a multiple of --heads, --heads a multiple of --kv-heads")
    out = make_tiny_model(a.out, a.layers, a.hidden, a.heads, a.kv_heads, a.intermediate, a.seed)
    print(out)
    return out


if __name__ == "__main__":
    main()
