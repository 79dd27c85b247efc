"""FusedKV offline tooling: training, retrofit and conversion (docs/fusedkv.md).

The serving runtime never imports this package; it reads what this package writes (a model dir
with a `fusedkv` section in config.json) through models/fusedkv_llama.py and shares only the math
of models/fusedkv_math.py.

    data        token data from {domain}_{split}.jsonl folders (flag or SGL_KVXFER_FUSEDKV_DATA)
    model       compact LM in every cross-layer layout: vanilla, fusedkv, lite, yoco, cla2
    checkpoint  model dirs in and out of the compact LM
    distill     the retrofit's losses: least-squares init, attention-output matching, KL + hidden
    retrofit    the retrofit under a time budget, with its PPL curve
    runctl      a clock of training seconds, a progress bar over the budget, SIGINT as stop
    curve       perplexity per domain, the curve's power-law extrapolation, its plot
    convert     python -m sgl_kvxfer.fusedkv.convert (the CLI)
    task_eval   task-suite scores of a model dir through the engine
    scratch     from-scratch training of one layout at one seed (scripts/fusedkv/compare_scratch.py)
"""
