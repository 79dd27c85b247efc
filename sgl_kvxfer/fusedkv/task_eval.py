"""Task-suite scores (sgl_kvxfer/tasks) of a model dir, answered through the engine.

The engine, not transformers, answers: it serves FusedKV dirs, which HF cannot load. Greedy
answers to the eval split of each task (`n` items, `seed`), prompts under the model's chat
template (tasks.chat_prompt_ids), each capped at its task's max_answer_tokens; scores with
tasks.evaluate. `compare` scores the original and the converted dir on the same items and gives
the difference of each task's headline metric in points (100 x).
"""
from __future__ import annotations

import gc


def task_scores(model_dir: str, names: list[str], n: int, seed: int, device: str, dtype: str = "auto") -> dict:
    """{task: {metric: mean, "n": items}} of model_dir's greedy answers."""
    import torch

    from sgl_kvxfer import Engine, tasks
    from sgl_kvxfer.models.loader import load_tokenizer, resolve_tokenizer_path

    tok = load_tokenizer(resolve_tokenizer_path(model_dir))
    exs = [ex for t in names for ex in tasks.generate(t, "eval", n, seed, tokenizer=tok)]
    prompts = [tasks.chat_prompt_ids(tok, ex) for ex in exs]
    params = [{"max_new_tokens": tasks.get_task(ex.task).max_answer_tokens, "temperature": 0} for ex in exs]
    longest = max(len(p) + q["max_new_tokens"] for p, q in zip(prompts, params))
    pool = min(sum(len(p) + q["max_new_tokens"] + 64 for p, q in zip(prompts, params)), max(200_000, 4 * longest))
    # answers are a few tokens: no decode CUDA graphs (their capture would cost more than it saves)
    with Engine(model_dir, device=device, dtype=dtype, max_total_tokens=pool, chunked_prefill_size=max(2048, longest),
                context_length=longest + 64, disable_cuda_graph=True) as eng:
        outs = eng.generate(input_ids=prompts, sampling_params=params)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return tasks.evaluate(exs, [o["text"] for o in outs])


def compare(original: str, converted: str, names: list[str], n: int, seed: int, device: str,
            dtype: str = "auto") -> dict:
    """Both dirs on the same items: {"original", "converted", "headline_points": {task: converted -
    original, x100}}."""
    from sgl_kvxfer import tasks

    a = task_scores(original, names, n, seed, device, dtype)
    b = task_scores(converted, names, n, seed, device, dtype)
    diff = {t: 100 * (b[t][tasks.headline(t)] - a[t][tasks.headline(t)]) for t in names}
    return {"tasks": names, "n": n, "seed": seed, "original": a, "converted": b, "headline_points": diff}
