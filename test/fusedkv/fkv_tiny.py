"""Helpers of the FusedKV offline tests: a tiny random Llama dir (with SmolLM2's tokenizer when
the vocabulary is its 49152) and a small {domain}_{split}.jsonl data folder."""
from __future__ import annotations

import json
import os
import random

from sgl_kvxfer.fusedkv.model import LM, LMConfig

TINY_HF = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
           "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
           "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": True, "max_position_embeddings": 2048,
           "eos_token_id": 2, "torch_dtype": "float32"}
WORDS = ("the cat dog sat on a mat and ran to see big small red blue house tree river stone light dark "
         "def return import class for while if else print value list dict").split()


def tiny_model_dir(path, vocab: int = 49152, seed: int = 3) -> str:
    """A random tiny Llama checkpoint (HF names), with SmolLM2's tokenizer files when vocab fits."""
    from safetensors.torch import save_file

    from sgl_kvxfer.models.loader import resolve_model_path

    cfg = {**TINY_HF, "vocab_size": vocab}
    m = LM(LMConfig.from_hf_dict(cfg))
    m.init_weights(seed=seed, std=0.2)
    os.makedirs(path, exist_ok=True)
    save_file({k: v.contiguous() for k, v in m.state_dict().items()}, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    if vocab == 49152:
        src = resolve_model_path(None)
        for n in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            if os.path.isfile(os.path.join(src, n)):
                with open(os.path.join(src, n), "rb") as a, open(os.path.join(path, n), "wb") as b:
                    b.write(a.read())
    return str(path)


def jsonl_dir(path, docs: int = 6, words: int = 120) -> str:
    """prose_* and code_* train / calib / eval files of random word sequences."""
    rng = random.Random(0)
    os.makedirs(path, exist_ok=True)
    for domain in ("prose", "code"):
        for split in ("train", "calib", "eval"):
            with open(os.path.join(path, f"{domain}_{split}.jsonl"), "w") as f:
                for _ in range(docs):
                    f.write(json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(words))}) + "\n")
    return str(path)



def teacher_student_pair(noise: float):
    """(teacher, student) of a 4-layer LM for distillation-step tests: the student is the
    teacher's FusedKV retrofit (sources 0 and 1) with every weight moved by noise x N(0, 1), so
    the loss and every gradient are non-zero; the noise comes from the torch RNG as the caller seeded it."""
    import torch

    from sgl_kvxfer.fusedkv.retrofit import RetrofitConfig, student_from

    c = LMConfig(vocab_size=64, hidden_size=16, num_layers=4, num_heads=2, num_kv_heads=1, head_dim=8,
                 intermediate_size=24)
    teacher = LM(c)
    teacher.init_weights(seed=1, std=0.2)
    teacher.requires_grad_(False)
    student = student_from(teacher, RetrofitConfig(variant="fusedkv"), (0, 1))
    with torch.no_grad():
        for p in student.parameters():
            p.add_(noise * torch.randn_like(p))
    return teacher, student
