"""How far the quantised GEMM (``simd-gguf``) is from this core's float32
multiply-add peak, and what that peak allows a k = 5 verification to cost.

A decode step and a verification must compute bit-identical rows (the
invariant), so every path multiplies and adds in float32, one fused
multiply-add per weight per row, whatever the row count. Measured on one
core (one thread, the layers' weights in cache, as the engine's two cores
each run half the outputs):

- the core's peak: a numba loop of 18 independent 16-lane fused
  multiply-adds on registers, the best of five;
- the kernel: one pass over one decoder layer's projections (the model's
  shapes, random blocks of --kind: the speed does not depend on the values)
  at each row count, the best of --reps;
- the floor: the multiply-adds of a 6-row pass at the peak rate, against
  the measured 1-row pass. Where that floor is above VERIFY6_GOAL (1.15),
  no kernel that keeps float32 products can verify k = 5 drafts within that
  on this CPU: decoding is already faster than the multiply-adds of six
  rows can be.

    python benchmarks/bench_gemm_ceiling.py [--model M] [--kind Q4_1] [--rows 1,2,3,6] [--layouts table,wide]

--layouts also times each named kernel layout (``gemm_gguf.LAYOUTS``) for
all the rows in one launch, in turns with the pass as ``gemm_gguf.gemm``
runs it, relative to that one-row pass.

Prints the CPU model and a table; writes JSON to --out.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numba
import numpy as np

from specdec.engine import gemm_gguf
from specdec.engine.gemm_numba import OUT_BLOCK
from specdec.engine.gemm_select import cpu_model
from specdec.engine.simd import LANES, load, mac, total, zeros
from specdec.models import default_model, resolve_model

#: independent sums in the peak loop: more than the FMA units' latency x throughput (4 x 2) needs
PEAK_SUMS = 18
#: issue 14's goal: a k = 5 verification (six rows) within this many decode steps
VERIFY6_GOAL = 1.15


@numba.njit(nogil=True, cache=True)
def _peak(x, n):
    """n rounds of 18 independent LANES-lane fused multiply-adds (operands from L1)."""
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = a8 = zeros()
    b0 = b1 = b2 = b3 = b4 = b5 = b6 = b7 = b8 = zeros()
    for i in range(n):
        k = (i & 15) * LANES
        u, v, w = load(x, k), load(x, k + 16 * LANES), load(x, k + 32 * LANES)
        a0, a1, a2, a3, a4, a5 = mac(a0, u, v), mac(a1, u, w), mac(a2, v, w), mac(a3, u, u), mac(a4, v, v), \
            mac(a5, w, w)
        a6, a7, a8, b0, b1, b2 = mac(a6, u, v), mac(a7, u, w), mac(a8, v, w), mac(b0, u, u), mac(b1, v, v), \
            mac(b2, w, w)
        b3, b4, b5, b6, b7, b8 = mac(b3, u, v), mac(b4, u, w), mac(b5, v, w), mac(b6, u, u), mac(b7, v, v), \
            mac(b8, w, w)
    return (total(a0) + total(a1) + total(a2) + total(a3) + total(a4) + total(a5) + total(a6) + total(a7)
            + total(a8) + total(b0) + total(b1) + total(b2) + total(b3) + total(b4) + total(b5) + total(b6)
            + total(b7) + total(b8))


def peak_macs_per_s(rounds: int = 2_000_000) -> float:
    """One core's float32 multiply-adds per second at its peak (best of five)."""
    x = (np.random.default_rng(0).standard_normal(48 * LANES) * 1e-3).astype(np.float32)
    _peak(x, 10)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        _peak(x, rounds)
        best = min(best, time.perf_counter() - start)
    return PEAK_SUMS * LANES * rounds / best


def layer_shapes(model: str) -> list[tuple[int, int]]:
    """(outputs, inputs) of one decoder layer's projections as the engine fuses them."""
    from transformers import AutoConfig

    src = resolve_model(model)
    cfg = AutoConfig.from_pretrained(src.path, **src.hf_kwargs())
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    qkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * head_dim
    return [(qkv, cfg.hidden_size), (cfg.hidden_size, cfg.num_attention_heads * head_dim),
            (2 * cfg.intermediate_size, cfg.hidden_size), (cfg.hidden_size, cfg.intermediate_size)]


def time_layer(shapes: list[tuple[int, int]], kind: str, rows: int, reps: int,
               layouts: tuple[str | None, ...] = (None,)) -> dict[str | None, float]:
    """Seconds of one pass over a layer's projections at `rows` rows on one
    thread (best of reps) by each of `layouts` (None: as ``gemm_gguf.gemm``
    runs it; a name: that layout's kernel for all the rows in one launch),
    the layouts in turns."""
    rng = np.random.default_rng(rows)
    weights = [gemm_gguf.quantize((rng.standard_normal(shape) * 0.02).astype(np.float32), kind) for shape in shapes]
    xs = [rng.standard_normal((rows, n)).astype(np.float32) for _, n in shapes]
    outs = [np.empty((rows, w.d.shape[0]), np.float32) for w in weights]
    best = dict.fromkeys(layouts, float("inf"))
    for rep in range(reps + 2):  # the first two compile and warm the caches
        for layout in layouts:
            start = time.perf_counter()
            for x, w, out in zip(xs, weights, outs):
                if layout is None:
                    gemm_gguf.gemm(x, w, 1)
                else:
                    with gemm_gguf.LAUNCH_LOCK:
                        gemm_gguf.set_team(1)
                        gemm_gguf.LAYOUTS[layout][w.kind](x, w.qs, w.d, w.m, out, 1)
            if rep >= 2:
                best[layout] = min(best[layout], time.perf_counter() - start)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=default_model())
    ap.add_argument("--kind", default="Q4_1", choices=sorted(gemm_gguf.KINDS))
    ap.add_argument("--rows", default="1,2,3,6", help="row counts, comma-separated (1 is always timed)")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--layouts", default="", help="also time these kernel layouts (gemm_gguf.LAYOUTS, e.g. "
                                                   "table,wide), each for all the rows in one launch, in turns")
    ap.add_argument("--out", default="bench_results/gemm_ceiling.json")
    args = ap.parse_args()
    try:
        rows = sorted({1, *(int(r) for r in args.rows.split(","))})
    except ValueError:
        ap.error(f"--rows: {args.rows!r} is not a comma-separated list of row counts")
    if rows[0] < 1 or args.reps < 1:
        ap.error("--rows and --reps: positive")
    layouts = [name for name in args.layouts.split(",") if name]
    if unknown := [name for name in layouts if name not in gemm_gguf.RUNNABLE]:
        ap.error(f"--layouts: {', '.join(unknown)} not among the layouts this CPU runs, "
                 f"{', '.join(gemm_gguf.RUNNABLE)}")
    shapes = layer_shapes(args.model)
    macs = sum(o * i for o, i in shapes)
    if any(i % gemm_gguf.BLOCK or o % OUT_BLOCK for o, i in shapes):
        ap.error(f"the layer's shapes {shapes} are not whole blocks ({gemm_gguf.BLOCK} inputs, {OUT_BLOCK} outputs)")
    peak = peak_macs_per_s()
    print(f"CPU: {cpu_model()}; one thread; {args.kind} blocks of {args.model}'s layer shapes {shapes} "
          f"({macs / 1e6:.2f} M multiply-adds a row)")
    print(f"peak: {peak / 1e9:.1f} G float32 multiply-adds/s on one core ({PEAK_SUMS} independent {LANES}-lane sums)")
    result = {"cpu": cpu_model(), "model": args.model, "kind": args.kind, "shapes": shapes, "macs_per_row": macs,
              "peak_macs_per_s": peak, "rows": {}}
    one = None
    print(f"\n{'rows':>4} {'ms a layer':>10} {'x 1 row':>8} {'GMAC/s':>7} {'% of peak':>9} "
          f"{'ms at peak':>10} {'floor x 1 row':>13}" + "".join(f" {name + ' x 1 row':>16}" for name in layouts))
    for n in rows:
        times = time_layer(shapes, args.kind, n, args.reps, (None, *layouts))
        s = times[None]
        one = one or s
        at_peak = macs * n / peak
        r = {"ms": s * 1e3, "x_one_row": s / one, "macs_per_s": macs * n / s, "share_of_peak": macs * n / s / peak,
             "ms_at_peak": at_peak * 1e3, "floor_x_one_row": max(at_peak, one) / one,
             "layouts_x_one_row": {name: times[name] / one for name in layouts}}
        result["rows"][n] = r
        print(f"{n:4d} {r['ms']:10.3f} {r['x_one_row']:8.2f} {r['macs_per_s'] / 1e9:7.1f} "
              f"{100 * r['share_of_peak']:8.0f}% {r['ms_at_peak']:10.3f} {r['floor_x_one_row']:13.2f}"
              + "".join(f" {times[name] / one:16.2f}" for name in layouts))
    if 6 in result["rows"]:
        floor = result["rows"][6]["floor_x_one_row"]
        verdict = "above" if floor > VERIFY6_GOAL else "within"
        print(f"\na 6-row pass at this core's peak would cost {floor:.2f}x today's 1-row pass: {verdict} the "
              f"{VERIFY6_GOAL}x goal before any dequantising")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
