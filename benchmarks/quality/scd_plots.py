"""The figure of benchmarks/quality/scd_eval.py: methods per consumer, the score-vs-bytes Pareto
front of the rank sweep, adaptive vs fixed ranks by link rate, and per-layer drift. Diagnostic rows
(not wire methods, no bytes) are labelled "(diag.)" and drawn as horizontal lines on the bytes axis."""
from __future__ import annotations


def plot(p: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(2, 3, figsize=(17, 9))
    s = p["summary"]["methods"]
    main = [m for m in s if "@" not in m and ":" not in m]  # the wire methods at the top level, bf16 codes
    cons = list(p["results"])
    w = 0.8 / max(1, len(cons))
    for j, c in enumerate(cons):
        ax[0, 0].bar([i + j * w for i in range(len(main))], [s[m]["per_consumer"].get(c, 0) for m in main], w, label=c)
    names = [f"{m} (diag.)" if s[m].get("diagnostic") else m for m in main]
    ax[0, 0].set_xticks([i + w * (len(cons) - 1) / 2 for i in range(len(main))], names, rotation=30, fontsize=8)
    ax[0, 0].set_ylabel("task score (F1 / EM / pass)")
    ax[0, 0].set_title("score per consumer (its own task)", fontsize=9)
    ax[0, 0].legend(fontsize=7)

    a = ax[0, 1]
    fams = [("scd", "o"), ("reuse", "s")] + [(f"{m}:{q}", mk) for q, mk in (("int8", "^"), ("int4", "v"))
                                             for m in ("scd", "reuse")]
    for fam, mk in fams:  # each family's levels; the quantised-code ones too
        pts = sorted((v["bytes_per_token"], v["score"], k) for k, v in s.items() if k.split("@")[0] == fam)
        if pts:
            a.plot([x[0] for x in pts], [x[1] for x in pts], mk + "-", mfc="none", label=f"{fam} (rank sweep)")
            for b, sc, k in pts:
                a.annotate(k.split("@")[1] if "@" in k else "top", (b, sc), fontsize=6)
    for k in ("raw", "int8", "int4", "droidspeak"):
        if k in s:
            a.scatter([s[k]["bytes_per_token"]], [s[k]["score"]], marker="x", s=40, label=k)
    for k, ls in (("oracle", "--"), ("base", ":")):
        if k in s:
            a.axhline(s[k]["score"], ls=ls, c="k", lw=1, label=k)
    for j, k in enumerate(k for k, v in s.items() if v.get("diagnostic")):
        a.axhline(s[k]["score"], ls="-.", c=f"C{j + 5}", lw=1, label=f"{k} (diag., no bytes)")
    a.set_xscale("log")
    a.set_xlabel("bytes per token on the wire")
    a.set_ylabel("mean score over consumers")
    a.set_title("score vs bytes (hollow: SCD / Reuse-only levels)", fontsize=9)
    a.legend(fontsize=6)

    a = ax[0, 2]
    for kind, ls in (("k", "-"), ("v", "--")):
        for j, c in enumerate(cons):
            d = p["drift"].get(c)
            if d:
                a.plot(d[f"{kind}_cos"], ls, c=f"C{j}", label=f"{c} {kind.upper()} (KL {d['kl_specialist_vs_base']:.2f})"
                       if kind == "k" else f"{c} V")
    a.set_xlabel("layer")
    a.set_ylabel("cosine, specialist vs base")
    a.set_title("drift per layer", fontsize=9)
    a.legend(fontsize=6)

    ad = p.get("adaptive", {})
    rates = ad.get("rates", {})
    if rates:
        xs = [float(r) for r in rates]
        labs = list(next(iter(rates.values())))
        for lab in labs:
            style = "k-" if lab == "adaptive" else ("k:" if lab == "oracle" else "o-")
            ax[1, 0].plot(xs, [rates[r][lab]["ttft_ms"] for r in rates], style, label=lab, lw=2 if lab == "adaptive" else 1)
            ax[1, 1].plot(xs, [rates[r][lab]["score"] for r in rates], style, label=lab, lw=2 if lab == "adaptive" else 1)
        for a, yl in ((ax[1, 0], "modelled TTFT (ms)"), (ax[1, 1], "mean score")):
            a.set_xscale("log")
            a.set_xlabel("link rate (Gbit/s)")
            a.set_ylabel(yl)
            a.legend(fontsize=6)
        ax[1, 0].set_title(f"adaptive rank (wire <= {ad['wire_frac']:g} x prefill) vs fixed ranks", fontsize=9)
    a = ax[1, 2]
    a.axis("off")
    rows = [[k + (" (diag.)" if v.get("diagnostic") else ""), f"{v['score']:.3f}", f"{v['kl']:.3f}", f"{v['top1']:.3f}",
             "-" if v["bytes_per_token"] is None else str(v["bytes_per_token"]),
             f"{v['rebuild_ms_per_1k_tokens']:.1f}"] for k, v in s.items() if "@" not in k]
    if rows:
        t = a.table(cellText=rows, colLabels=["method", "score", "KL", "top-1", "B/token", "rebuild ms/1k"],
                    loc="center", fontsize=7)
        t.scale(1, 1.3)
    fig.suptitle(f"SCD on the task suite, {p['device']} (commit {str(p.get('commit'))[:7]})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
