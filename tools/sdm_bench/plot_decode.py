#!/usr/bin/python3
"""Plots of an `sdm-bench decode` run, from its results.json (sdm-bench runs this script).

Usage: plot_decode.py RESULTS_JSON OUT_DIR

Writes into OUT_DIR, one subplot per group (pair) in each figure:
  tokens_per_s_vs_context.png  tokens/s against context length, per model and batch size
  tokens_per_s_vs_batch.png    tokens/s against batch size, per model and context length
  step_ms_vs_context.png       ms per step and the global layers' share of it, against context
  ratio_vs_context.png         SDM / full-attention tokens/s at the same batch, against context,
                               measured (solid) and at the bandwidth floor (dashed: the twin's
                               bytes per step over the SDM model's)
and prints the names of the files it wrote, one per line. Exits with status 3 when matplotlib is
missing (Debian: apt-get install python3-matplotlib), 2 on bad arguments.
"""

import json
import os
import sys


def main(argv):
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        print("matplotlib is not available (%s); install python3-matplotlib" % e, file=sys.stderr)
        return 3
    with open(argv[1]) as f:
        doc = json.load(f)
    out_dir = argv[2]
    groups = doc["groups"]
    rows = doc["results"]
    listed = set(doc["parameters"]["batches"])
    # On CUDA the benchmark does not time each kind of layer (decode_benchmark.cc: the profile
    # would synchronise after every layer): those fields hold zeros, not measurements.
    device = doc.get("device")
    profiled = not (isinstance(device, dict) and device.get("resolved") == "cuda")
    if not groups or not rows:
        print("no results to plot", file=sys.stderr)
        return 0
    machine = "%s, %d threads" % (doc["machine"]["cpu"], doc["machine"]["engine_threads"])
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]

    def style(role):
        return ("-", "o") if role != "attention" else ("--", "s")

    def figure(title):
        n = len(groups)
        fig, axes = plt.subplots(1, n, figsize=(6.0 * n, 4.6), squeeze=False)
        fig.suptitle("%s\n%s" % (title, machine), fontsize=10)
        return fig, axes[0]

    def save(fig, name):
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, name), dpi=110)
        plt.close(fig)
        print(name)

    def group_rows(g):
        return [r for r in rows if r["group"] == g["name"]]

    # tokens/s against context, one line per (model, listed batch).
    fig, axes = figure("Decode tokens/s vs context length")
    for ax, g in zip(axes, groups):
        gr = group_rows(g)
        batches = sorted({r["batch"] for r in gr if r["batch"] in listed})
        for m in g["models"]:
            ls, marker = style(m["role"])
            for i, b in enumerate(batches):
                pts = sorted((r["context"], r["tokens_per_s"]) for r in gr
                             if r["model"] == m["name"] and r["batch"] == b)
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], ls=ls, marker=marker,
                            color=colors[i % len(colors)], label="%s, batch %d" % (m["name"], b))
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("tokens/s (median step)")
        ax.set_title(g["name"])
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    save(fig, "tokens_per_s_vs_context.png")

    # tokens/s against batch, one line per (model, context).
    fig, axes = figure("Decode tokens/s vs batch size")
    for ax, g in zip(axes, groups):
        gr = group_rows(g)
        contexts = sorted({r["context"] for r in gr})
        for m in g["models"]:
            ls, marker = style(m["role"])
            for i, c in enumerate(contexts):
                pts = sorted((r["batch"], r["tokens_per_s"]) for r in gr
                             if r["model"] == m["name"] and r["context"] == c)
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], ls=ls, marker=marker,
                            color=colors[i % len(colors)], label="%s, ctx %d" % (m["name"], c))
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch size (sessions per step)")
        ax.set_ylabel("tokens/s (median step)")
        ax.set_title(g["name"])
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    save(fig, "tokens_per_s_vs_batch.png")

    # ms per step against context at one batch: the whole step and its global layers.
    fig, axes = figure("ms per decode step vs context length")
    for ax, g in zip(axes, groups):
        gr = group_rows(g)
        contexts = sorted({r["context"] for r in gr})
        # The largest listed batch that every model measured at every context (else batch 1).
        common = [b for b in sorted(listed)
                  if all(any(r["model"] == m["name"] and r["context"] == c and r["batch"] == b
                             for r in gr) for m in g["models"] for c in contexts)]
        b = common[-1] if common else 1
        for i, m in enumerate(g["models"]):
            ls, marker = style(m["role"])
            pts = sorted((r["context"], r["ms_per_step_median"],
                          r["sdm_ms_per_step"] if m["role"] == "sdm" else r["attn_ms_per_step"])
                         for r in gr if r["model"] == m["name"] and r["batch"] == b)
            if not pts:
                continue
            color = colors[i % len(colors)]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], ls=ls, marker=marker, color=color,
                    label="%s: whole step" % m["name"])
            if profiled:  # on CUDA the run does not time each kind of layer (zeros)
                layer = "SDM layers" if m["role"] == "sdm" else "full-attention layers"
                ax.plot([p[0] for p in pts], [p[2] for p in pts], ls=":", marker=marker,
                        color=color, label="%s: its %s" % (m["name"], layer))
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("ms per step (median), batch %d" % b)
        ax.set_ylim(bottom=0)
        ax.set_title(g["name"])
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    save(fig, "step_ms_vs_context.png")

    # SDM / attention ratio against context.
    if any(g.get("ratios") for g in groups):
        fig, axes = figure("SDM / full-attention tokens/s at the same batch "
                           "(dashed: if both moved their bytes at the same rate)")
        for ax, g in zip(axes, groups):
            ratios = g.get("ratios", [])
            batches = sorted({r["batch"] for r in ratios if r["batch"] in listed})
            for i, b in enumerate(batches):
                pts = sorted((r["context"], r["ratio"], r.get("bandwidth_floor_ratio"))
                             for r in ratios if r["batch"] == b)
                color = colors[i % len(colors)]
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color=color,
                        label="batch %d: measured" % b)
                if all(p[2] is not None for p in pts):
                    ax.plot([p[0] for p in pts], [p[2] for p in pts], ls="--", marker=".",
                            color=color, label="batch %d: bandwidth floor" % b)
            ax.axhline(1.0, color="gray", lw=0.8)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("context length (tokens)")
            ax.set_ylabel("SDM tokens/s / attention tokens/s")
            ax.set_title(g["name"])
            ax.grid(True, alpha=0.3)
            if batches:
                ax.legend(fontsize=7)
        save(fig, "ratio_vs_context.png")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
