#!/usr/bin/env python3
# Ours against the reference implementation's decode step, batch by batch: reads the JSON of
# `sdm-bench decode` (ours) and of scripts/device/reference_decode.py (the reference's own decode
# step at the same shapes), prints one table and writes it as JSON. scripts/device-check.sh runs
# it after both benchmarks; it needs only Python's standard library.
#
#   python3 scripts/device/compare_decode.py --ours decode.json \
#       --reference reference_decode.json [--model sdm_flagship] [--json comparison.json]
#
# For each batch the reference timed: our median ms per step and tok/s for `--model` at the
# reference's context, the fraction of the device's copy bandwidth our step's bytes reach (the
# floor: a step cannot read its bytes faster than that), the reference's median ms per step, and
# speedup = reference ms / our ms (above 1: ours is faster). A batch either side did not time
# (skipped, out of memory, error) gets its reason instead of a speedup.
# Exit status: 0 when at least one batch was compared, 1 when none was, 2 on unreadable input.
import argparse
import json
import sys


def load(path, what):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        print(f"compare_decode: cannot read {what} {path}: {e}", file=sys.stderr)
        sys.exit(2)


def compare(ours, reference, model):
    """Rows of the comparison, one per batch of the reference, and the context compared."""
    context = reference.get("context")
    mine = {}
    for r in ours.get("results", []):
        if r.get("model") == model and r.get("context") == context:
            mine[r.get("batch")] = r
    rows = []
    for ref in reference.get("rows", []):
        b = ref.get("batch")
        row = {"batch": b}
        o = mine.get(b)
        if o is not None:
            row.update(ours_ms=o["ms_per_step_median"], ours_tok_s=o["tokens_per_s"],
                       ours_fraction_of_bandwidth=o.get("fraction_of_bandwidth"))
        if isinstance(ref.get("median_ms"), (int, float)) and ref.get("status") in ("ok", "partial"):
            row.update(reference_ms=ref["median_ms"], reference_tok_s=ref.get("tok_s"),
                       reference_status=ref["status"])
        if "ours_ms" in row and "reference_ms" in row and row["ours_ms"] > 0:
            row["speedup"] = row["reference_ms"] / row["ours_ms"]
        else:
            why = []
            if o is None:
                why.append(f"ours: no {model} result at context {context}, batch {b}")
            elif not row["ours_ms"] > 0:
                why.append(f"ours: a median of {row['ours_ms']} ms")
            if "reference_ms" not in row:
                why.append(f"reference: {ref.get('status', '?')} ({ref.get('reason', '')})")
            row["reason"] = "; ".join(why)
        rows.append(row)
    return context, rows


def fmt(v, spec):
    """v formatted by spec, or a dash as wide as spec says (its leading digits)."""
    if v is None:
        width = int("".join(c for c in spec.split(".")[0] if c.isdigit()) or 0)
        return "-".rjust(width)
    return format(v, spec)


def main():
    p = argparse.ArgumentParser(
        description="Ours against the reference's decode step, batch by batch (see the header).")
    p.add_argument("--ours", required=True, help="sdm-bench decode --json output")
    p.add_argument("--reference", required=True, help="reference_decode.py --json output")
    p.add_argument("--model", default="sdm_flagship", help="our model to compare")
    p.add_argument("--json", default="", help="where to write the comparison")
    args = p.parse_args()
    ours = load(args.ours, "our decode JSON")
    reference = load(args.reference, "the reference's JSON")
    context, rows = compare(ours, reference, args.model)
    device = reference.get("device", "?")
    if reference.get("preset") not in (None, args.model):
        print(f"note: the reference ran {reference.get('preset')}'s shapes, not {args.model}'s")
    print(f"== ours ({args.model}) vs the reference's decode step, context {context}, {device} ==")
    print(f"{'batch':>6} {'ours ms':>9} {'ours tok/s':>11} {'of bw':>6} {'ref ms':>9} "
          f"{'ref tok/s':>10} {'speedup':>8}")
    for r in rows:
        frac = r.get("ours_fraction_of_bandwidth")
        line = (f"{r['batch']:>6} {fmt(r.get('ours_ms'), '9.3f')} "
                f"{fmt(r.get('ours_tok_s'), '11.1f')} "
                f"{'-' if frac is None else format(100 * frac, '5.1f') + '%':>6} "
                f"{fmt(r.get('reference_ms'), '9.3f')} {fmt(r.get('reference_tok_s'), '10.1f')} "
                f"{'-' if 'speedup' not in r else format(r['speedup'], '.2f') + 'x':>8}")
        if "reason" in r:
            line += f"  {r['reason']}"
        print(line)
    compared = [r for r in rows if "speedup" in r]
    summary = ", ".join(f"b{r['batch']} {r['speedup']:.2f}x" for r in compared) or "none compared"
    print(f"speedup (reference ms / ours): {summary}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "context": context, "device": device,
                       "reference_commit": reference.get("reference", {}).get("commit"),
                       "rows": rows,
                       "summary": summary}, f, indent=1)
    return 0 if compared else 1


if __name__ == "__main__":
    sys.exit(main())
