"""Restore-one / lower-one layer profile for `--kv-layer-budget profile` (spectrum/layer_budget.py).

    python -m sgl_kvxfer.spectrum_calib.layer_profile --out profile.json [--model DIR] \
        [--prose prose.jsonl] [--context 2048] [--chunk 128] [--windows 8] [--device cuda]

For each sample (a context and its continuation), with the engine's own model code
(sgl_kvxfer/scd/calib/forward.py: the K/V it builds are what the pool stores):

    1. prefill the context at full precision; the continuation's next-token log-probs over it
       are the reference p
    2. base:        every context token's K/V at the low tier (codec int4, group G) in every
                    layer, the first `sinks` tokens exact
       restore l:   base, layer l exact                        (restore-one)
       lower l:     base, layer l at int2c (2-bit, keys per channel over pages of PAGE tokens)
    3. KL(config) = mean over scored tokens of KL(p || p_config)

and writes gain_up[l] = KL(base) - KL(restore l), loss_down[l] = KL(lower l) - KL(base) with the
samples' description. 1 + 2L continuation forwards per batch of samples; the context is
prefilled once.
"""
from __future__ import annotations

import argparse
import time

import torch

from sgl_kvxfer.kernels.tier_codec import dequantize, quantize
from sgl_kvxfer.mem_cache.kivi_pages import decode, encode, quantize_per_token, dequantize_per_token, scale_zero
from sgl_kvxfer.spectrum.formats import IntFormat
from sgl_kvxfer.spectrum.layer_budget import DOWN, LOW, LayerProfile


def roundtrip(x: torch.Tensor, fmt: IntFormat, is_key: bool, group_size: int, page_size: int) -> torch.Tensor:
    """x [B, T, H, D] -> its round trip through `fmt` (pages: runs of page_size tokens along T)."""
    if fmt.key_axis == "token" or not is_key:
        if fmt.key_axis == "token":
            q, s, z = quantize(x, fmt.bits, group_size)
            return dequantize(q, s, z, fmt.bits, group_size, x.dtype)
        q, s, z = quantize_per_token(x, fmt.bits, group_size)
        return dequantize_per_token(q, s, z, fmt.bits, group_size, x.dtype)
    b, t, h, d = x.shape
    pad = -t % page_size
    xf = torch.nn.functional.pad(x.float(), (0, 0, 0, 0, 0, pad))
    pages = xf.view(b, (t + pad) // page_size, page_size, h, d)
    # padded rows must not widen a page's range: use the page's real tokens only
    real = torch.arange(t + pad, device=x.device).view(1, -1, page_size, 1, 1) < t
    lo = torch.where(real, pages, torch.full_like(pages, float("inf"))).amin(2, keepdim=True)
    hi = torch.where(real, pages, torch.full_like(pages, float("-inf"))).amax(2, keepdim=True)
    scale, zero = scale_zero(lo, hi, fmt.bits)
    codes = decode(encode(pages, scale, zero, fmt.bits), fmt.bits)
    out = codes * scale.float() + zero.float()
    return out.view(b, t + pad, h, d)[:, :t].to(x.dtype)


def _kl(ref_logp: torch.Tensor, logits: torch.Tensor, mask: torch.Tensor) -> float:
    logp = torch.log_softmax(logits.float(), -1)
    kl = (ref_logp.exp() * (ref_logp - logp)).sum(-1)
    return float((kl * mask).sum() / mask.sum())


@torch.no_grad()
def profile_layers(runner, samples: list[tuple[list[int], list[int]]], group_size: int, page_size: int,
                   num_sink: int = 4, batch: int = 4, meta: dict | None = None) -> LayerProfile:
    """samples: (context ids, continuation ids). runner: scd.calib.forward.LlamaRunner."""
    from sgl_kvxfer.scd.calib.forward import KVCache, left_pad

    num_layers = len(runner.layers)
    sums = {"base": 0.0, **{f"up{l}": 0.0 for l in range(num_layers)}, **{f"down{l}": 0.0 for l in range(num_layers)}}
    weight = 0
    for at in range(0, len(samples), batch):
        chunk = samples[at:at + batch]
        ids, valid, pos = left_pad([c for c, _ in chunk], device=runner.device)
        cache, _ = runner.prefill_cache(ids, pos, valid)
        # continuation: right after each row's context (positions continue its own numbering)
        cids, cvalid, cpos = left_pad([t for _, t in chunk], device=runner.device)
        cpos = cpos + valid.sum(1, keepdim=True)
        # the first continuation token's logits sit at its last context position: score tokens 1..
        ref = runner.forward(cids, cpos, cvalid, past=cache, logits="all").logits
        ref_logp = torch.log_softmax(ref.float(), -1)
        mask = cvalid.float()
        sink = (pos < num_sink)[..., None, None]

        def layer_kv(fmt, li):
            return tuple(torch.where(sink, x, roundtrip(x, fmt, key, group_size, page_size))
                         for x, key in ((cache.k[li], True), (cache.v[li], False)))
        low = [layer_kv(LOW, li) for li in range(num_layers)]

        def score(override: dict) -> float:
            ks = [override.get(li, low[li])[0] for li in range(num_layers)]
            vs = [override.get(li, low[li])[1] for li in range(num_layers)]
            return _kl(ref_logp, runner.forward(cids, cpos, cvalid, past=KVCache(ks, vs, valid), logits="all").logits,
                       mask)
        n = float(mask.sum())
        sums["base"] += score({}) * n
        for li in range(num_layers):
            sums[f"up{li}"] += score({li: (cache.k[li], cache.v[li])}) * n
            sums[f"down{li}"] += score({li: layer_kv(DOWN, li)}) * n
        weight += n
    avg = {k: v / weight for k, v in sums.items()}
    base = avg["base"]
    return LayerProfile(num_layers, tuple(base - avg[f"up{l}"] for l in range(num_layers)),
                        tuple(avg[f"down{l}"] - base for l in range(num_layers)), base, "kl",
                        {**(meta or {}), "samples": len(samples), "scored_tokens": int(weight), "num_sink": num_sink,
                         "group_size": group_size, "page_size": page_size, "low": LOW.label(), "lower": DOWN.label()})


def prose_samples(tokenizer, texts: list[str], context: int, chunk: int,
                  windows: int) -> list[tuple[list[int], list[int]]]:
    """Non-overlapping (context, chunk) windows, one per document, up to `windows`."""
    out = []
    for text in texts:
        ids = tokenizer.encode(text)
        if len(ids) >= context + chunk:
            out.append((ids[:context], ids[context:context + chunk]))
        if len(out) == windows:
            break
    return out


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="profile JSON to write")
    ap.add_argument("--model", default=None, help="model dir (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--prose", default=None, help="JSONL with a 'text' field (default: the probe's filler prose)")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=128, help="scored continuation tokens per window")
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=0, help="int group (0: head_dim, the engine default)")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args(argv)
    for name in ("context", "chunk", "windows", "batch", "page_size"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.sinks < 0 or args.group_size < 0:
        ap.error("--sinks and --group-size must be >= 0")
    from sgl_kvxfer.models.loader import load_model, load_tokenizer, resolve_model_path, resolve_tokenizer_path
    from sgl_kvxfer.scd.calib.forward import LlamaRunner
    from sgl_kvxfer.spectrum.niah import load_filler_texts

    model_dir = resolve_model_path(args.model)
    model, arch = load_model(model_dir, "auto", getattr(torch, args.dtype), args.device, 0)
    tokenizer = load_tokenizer(resolve_tokenizer_path(model_dir))
    samples = prose_samples(tokenizer, load_filler_texts(args.prose), args.context, args.chunk, args.windows)
    if not samples:
        ap.error(f"no document holds {args.context} + {args.chunk} tokens")
    group = args.group_size or arch.head_dim
    t0 = time.time()
    profile = profile_layers(LlamaRunner(model), samples, group, args.page_size, args.sinks, args.batch,
                             {"model": model_dir, "source": "prose", "context": args.context, "chunk": args.chunk})
    profile.save(args.out)
    top = sorted(range(profile.num_layers), key=lambda l: -profile.gain_up[l])[:5]
    print(f"base KL {profile.base_kl:.4f}; most sensitive layers {top}; {time.time() - t0:.1f} s -> {args.out}")
    return args.out


if __name__ == "__main__":
    main()
