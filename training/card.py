#!/usr/bin/env python3
"""Writes a model card (README.md) and plots for a trained model directory.

    /usr/bin/python3 training/card.py --run runs/demo --twin runs/demo_twin \
        --model models/sdm-fortunes-demo

Reads each run's eval.json and log.jsonl (written by training/train.py) and writes, into the model
directory, README.md (data, config, steps, wall time, held-out bits per byte, recall accuracy
against distance, SDM model vs its sliding-window twin), loss.png and recall.png (when matplotlib,
Debian's python3-matplotlib, is importable; the card says so when it is not).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import data  # noqa: E402


def read_run(run_dir):
    with open(os.path.join(run_dir, "eval.json")) as f:
        ev = json.load(f)
    log = []
    with open(os.path.join(run_dir, "log.jsonl")) as f:
        for line in f:
            log.append(json.loads(line))
    return ev, log


def plots(model_dir, runs):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    for label, (ev, log) in runs.items():
        ax.plot([r["step"] for r in log], [r["loss"] for r in log], label=label, lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats/byte)")
    ax.set_ylim(top=3.5)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(model_dir, "loss.png"))
    plt.close(fig)

    # Recall on held-out probes during training (train.py --eval-every), when the runs logged it.
    probes = {label: [(r["step"], r["recall_probe"]) for r in log if r.get("recall_probe")]
              for label, (ev, log) in runs.items()}
    if any(probes.values()):
        fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
        for (label, pts), color in zip(probes.items(), ("C0", "C1", "C2")):
            for d, ls in (("32", "--"), ("128", "-")):
                ax.plot([st for st, _ in pts], [p[d] for _, p in pts], ls=ls, color=color,
                        marker=".", label=f"{label}, {d} B")
        ax.set_xlabel("step")
        ax.set_ylabel("exact answers (held-out probe)")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(os.path.join(model_dir, "recall-training.png"))
        plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    window = None
    for label, (ev, log) in runs.items():
        acc = ev["recall_accuracy"]
        ds = sorted(int(d) for d in acc)
        ax.plot(ds, [acc[str(d)] for d in ds], marker="o", label=label)
        window = window or ev["config"].get("swa_window")
        chance = ev["recall_chance"]
    ax.axhline(chance, color="gray", ls=":", label="chance (1 / word list)")
    if window:
        ax.axvline(window, color="gray", ls="--", lw=0.8, label=f"window ({window} bytes)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("bytes between the fact and the question")
    ax.set_ylabel("exact answers")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(model_dir, "recall.png"))
    plt.close(fig)
    return True


def describe(cfg):
    layers = []
    for i in range(cfg["n_layers"]):
        layers.append("sdm" if i in cfg.get("sdm_at", []) else "swa")
    return ", ".join(layers)


PRECISION = {
    "fp32": "float32",
    "bf16": "matrix products in bf16 (CPU autocast; weights, optimizer state and the SDM "
            "recurrence in float32)",
}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run", required=True)
    ap.add_argument("--twin")
    ap.add_argument("--model", required=True)
    ap.add_argument("--notes", help="a markdown file appended as the card's last section")
    args = ap.parse_args(argv)

    sdm = read_run(args.run)
    runs = {"SDM hybrid (shipped)": sdm}
    if args.twin:
        runs["sliding-window twin"] = read_run(args.twin)
    has_plots = plots(args.model, runs)
    ev = sdm[0]
    cfg = ev["config"]
    sa = cfg.get("sdm_args", {})
    size = os.path.getsize(os.path.join(args.model, "model.safetensors"))
    window = cfg["swa_window"]

    L = []
    L.append(f"# {os.path.basename(os.path.normpath(args.model))}: a small byte-level SDM "
             "hybrid trained on fortunes\n")
    L.append("Trained on this project's 2-core CPU by `scripts/train-demo.sh` (training/train.py); "
             "the model card is written by training/card.py from the run's own logs. It exists to "
             "show what the server is for — a session whose fixed-size memory carries what it was "
             "told, across turns and server restarts — not to write good prose: it is a "
             f"{ev['params_without_m0'] / 1e6:.2f}M-parameter model that saw "
             f"{ev['tokens'] / 1e6:.1f}M bytes.\n")
    L.append("## Model\n")
    L.append(f"- {ev['params']:,} parameters, {ev['params_without_m0']:,} without the learned "
             f"initial memory M0; `model.safetensors` in bf16, {size / 1e6:.2f} MB.")
    L.append(f"- d = {cfg['dim']}, {cfg['n_layers']} layers ({describe(cfg)}): the flagship's "
             "3:1 pattern of sliding-window and SDM layers at small size; sliding-window "
             f"attention with {cfg['n_heads']} heads and a {window}-byte window; SwiGLU FFN.")
    if sa:
        s2 = sa["slots_per_head"]
        L.append(f"- SDM: {sa['num_heads']} heads of {s2} slots (product keys, s = "
                 f"{int(round(s2 ** 0.5))}), {sa['num_writes']} writes and {sa['num_reads']} reads "
                 "per token and head, learned M0, LayerNorm of the readings, output gate, shared-"
                 "residual delta rule.")
    L.append("- Tokenizer: bytes (ids 0-255 are UTF-8 bytes, 256 BOS). Every training example "
             "starts with BOS, as a server session does.\n")
    L.append("## Data\n")
    L.append("- Text: every fortune file of Debian's `fortunes` package (/usr/share/games/fortunes), "
             "split at the `%` lines; 1 fortune in 20 (by a hash of its text) is held out. "
             "Training rows start at a fortune.")
    L.append(f"- Recall task ({ev['recall_frac']:.0%} of the rows): 1-3 facts such as "
             f"`{data.fact_text('Ruth', 'amber').strip()}` stated once, then corpus text, then "
             f"the questions `{data.question_text('Ruth')!r}` with the answers; "
             f"{len(data.NAMES)} names, {len(data.WORDS)} code words with distinct first letters "
             "(the first byte of an answer names the word: recalling a fact is recalling one "
             "byte bound to a name), so chance is "
             f"{ev['recall_chance']:.1%}. The distance (bytes of text between the facts and the "
             "questions) is drawn log-uniformly; its upper end grows over the first "
             f"{ev['curriculum_frac']:.0%} of the steps from 48 bytes to what fits a "
             f"{ev['seq']}-byte row (a curriculum: near facts first). Answer bytes weigh "
             f"{ev['answer_weight']:g} in the loss.\n")
    L.append("## Training\n")
    planned = ev.get("planned_steps", ev["steps"])
    if planned != ev["steps"]:
        L.append(f"- Stopped at step {ev['steps']} of the {planned} planned (the learning-rate "
                 f"schedule is that of {planned} steps), to meet the deadline: see the notes.")
    L.append(f"- {ev['steps']} steps of {ev['batch']} rows x {ev['seq']} bytes "
             f"({ev['tokens']:,} bytes), AdamW (betas 0.9/0.95, weight decay 0.1), peak learning "
             f"rate {ev['lr']:g} with warm-up and cosine decay to 10%, gradient clipping 1.0, "
             f"seed {ev['seed']}, {PRECISION[ev.get('precision', 'fp32')]}, "
             f"{ev['threads']} torch thread(s)." +
             (f" The SDM write strength starts low (b_proj bias {ev['beta_bias']:g}, beta = "
              f"{1 / (1 + math.exp(-ev['beta_bias'])):.2f}) so that text overwrites a slot "
              "slowly until the model has learned what to keep." if "beta_bias" in ev else ""))
    L.append(f"- Wall time: {ev['train_wall_s'] / 60:.1f} min of training on the shared 2-core "
             "CPU (other jobs ran at the same time), plus "
             f"{ev['eval_wall_s'] / 60:.1f} min of evaluation." +
             "".join(f" The {label}: {e['train_wall_s'] / 60:.1f} min for {e['steps']} steps."
                     for label, (e, _) in runs.items() if e is not ev))
    if has_plots:
        L.append("\n![training loss](loss.png)\n")
        if os.path.exists(os.path.join(args.model, "recall-training.png")):
            L.append("Recall during training, on 32 held-out examples at 2x and 8x the window "
                     "(the table below uses more):\n")
            L.append("![recall during training](recall-training.png)\n")
    else:
        L.append("\n(no plots: matplotlib was not importable when the card was written)\n")
    L.append("## Evaluation (on the bf16 weights as shipped)\n")
    head = "| | parameters | steps | held-out bits/byte | " + " | ".join(
        f"recall @ {d} B ({int(d) // window}x window)" for d in sorted(ev["recall_accuracy"], key=int)) + " |"
    L.append(head)
    L.append("|---" * (4 + len(ev["recall_accuracy"])) + "|")
    for label, (e, _) in runs.items():
        acc = e["recall_accuracy"]
        row = (f"| {label} | {e['params_without_m0']:,} | {e['steps']} | "
               f"{e['heldout_bits_per_byte']:.3f} | " +
               " | ".join(f"{acc[d]:.0%}" for d in sorted(acc, key=int)) + " |")
        L.append(row)
    L.append("")
    L.append(f"Held-out bits per byte: mean over {ev['heldout_bytes']:,} bytes of held-out "
             f"fortunes (rows of BOS + {ev['seq']} bytes). Recall: "
             f"{ev['recall_per_distance']} held-out examples per distance, one fact each, exact "
             f"greedy answer; chance {ev['recall_chance']:.1%}. The distance is the bytes of text "
             "between the end of the fact and the start of the question; the answer comes about "
             "40 bytes later still. The twin is the same model with its "
             "SDM layer replaced by a sliding-window layer, trained on the same batches for the "
             "same steps.")
    if has_plots:
        L.append("\n![recall against distance](recall.png)\n")
    if args.notes:
        with open(args.notes) as f:
            L.append(f.read())
    with open(os.path.join(args.model, "README.md"), "w") as f:
        f.write("\n".join(L).rstrip() + "\n")
    print(f"wrote {os.path.join(args.model, 'README.md')}")


if __name__ == "__main__":
    main()
