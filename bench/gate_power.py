"""The promotion gate's power: how large a drop its paired test sees, at which n.

The gate refuses a candidate only when its paired test against the best version
(services/watcher/paired.py, the very function the gate calls) says "worse" at `alpha`,
one-sided. This script simulates pairs of evaluations on the same n tasks and reports,
per n, the smallest true drop the test detects with the given power, and how often it
refuses a candidate that is in truth as good (the false refusals, ≤ alpha by design).

Pass/fail suites (demo, env:<name>): McNemar's exact test. Two versions of equal quality
still disagree on some tasks ("churn": a greedy answer that changed); a drop of d adds d
to the tasks lost:

    P(lost) = churn / 2 + d      P(gained) = churn / 2      (the best passes p0 of the tasks)

so `churn` is the share of tasks two equally good versions answer differently.
`--churn-from FILE` measures it on a run: the demo suite's per-task results of
consecutive versions, from the EvalResults `nextstate tail evals --raw > FILE` prints.

Graded suites (simulated-user: ratings in [0, 1]): the paired bootstrap, on per-task
differences -d + N(0, sd) (`--graded`; slower: every simulated test resamples).

The baseline in the same run: the same drops against an *unpaired* comparison of the two
scores' 95% Wilson intervals (what "inside the interval of the best" amounted to before):
the ratio of detectable drops says what pairing buys.

    python bench/gate_power.py [--n 32 64 128] [--alpha 0.05] [--power 0.8] [--reps 2000]
                               [--churn 0.1 0.2 0.3] [--p0 0.7] [--graded]
"""

from __future__ import annotations

import argparse
import itertools
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from services.evaluator.suites.stats import wilson
from services.watcher.paired import compare

Refuses = Callable[[dict[str, float], dict[str, float]], bool]


def pass_fail_pair(rng: random.Random, n: int, p0: float, churn: float, drop: float
                   ) -> tuple[dict[str, float], dict[str, float]]:
    """The best's and the candidate's outcomes on n tasks (task id -> 1/0)."""
    lose = (churn / 2 + drop) / p0  # P(the candidate fails | the best passes)
    gain = (churn / 2) / (1 - p0)  # P(the candidate passes | the best fails)
    if lose > 1 or gain > 1:
        raise ValueError(f"p0={p0} cannot carry churn {churn} and a drop of {drop}")
    best, cand = {}, {}
    for i in range(n):
        t = f"t{i}"
        best[t] = 1.0 if rng.random() < p0 else 0.0
        flip = rng.random() < (lose if best[t] else gain)
        cand[t] = 1.0 - best[t] if flip else best[t]
    return best, cand


def graded_pair(rng: random.Random, n: int, sd: float, drop: float) -> tuple[dict[str, float], dict[str, float]]:
    best = {f"t{i}": rng.uniform(0.3, 0.9) for i in range(n)}
    return best, {t: s - drop + rng.gauss(0, sd) for t, s in best.items()}


def paired(alpha: float, binary: bool) -> Refuses:
    def refuses(best: dict[str, float], cand: dict[str, float]) -> bool:
        cmp = compare(best, cand, binary, resamples=500)
        return cmp is not None and cmp.refuses(alpha)
    return refuses


def unpaired_intervals(best: dict[str, float], cand: dict[str, float]) -> bool:
    """The old reading: refused only when the candidate's 95% interval lies below the best's."""
    n = len(best)
    best_low = wilson(int(sum(best.values())), n)[0]
    cand_high = wilson(int(sum(cand.values())), n)[1]
    return cand_high < best_low


def power(draw: Callable[[random.Random, float], tuple[dict[str, float], dict[str, float]]],
          refuses: Refuses, drop: float, reps: int, seed: int) -> float:
    rng = random.Random(seed)
    return sum(refuses(*draw(rng, drop)) for _ in range(reps)) / reps


def detectable(draw: Callable[[random.Random, float], tuple[dict[str, float], dict[str, float]]],
               refuses: Refuses, target: float, reps: int, hi: float, step: float = 0.01) -> float | None:
    """The smallest drop on a `step` grid with power >= target (bisection: power rises with the drop)."""
    lo_i, hi_i = 0, round(hi / step)
    if power(draw, refuses, hi_i * step, reps, 1) < target:
        return None
    while hi_i - lo_i > 1:
        mid = (lo_i + hi_i) // 2
        if power(draw, refuses, mid * step, reps, 1) >= target:
            hi_i = mid
        else:
            lo_i = mid
    return hi_i * step


def measured_churn(path: str) -> tuple[float, int]:
    """The demo suite's churn between consecutive versions of a run: (mean share of tasks
    answered differently, pairs of versions). `path`: a JSON file of EvalResults (one per
    line, as `nextstate tail evals --raw` prints them)."""
    import json

    from shared.schemas import EvalResult

    by_version: dict[int, dict[str, float]] = {}
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        r = EvalResult.model_validate(json.loads(line))
        if r.suite == "demo" and r.tasks:
            by_version[r.version] = {t.task: float(bool(t.passed)) for t in r.tasks}
    versions = sorted(by_version)
    shares = []
    for a, b in itertools.pairwise(versions):
        common = set(by_version[a]) & set(by_version[b])
        if common:
            shares.append(sum(by_version[a][t] != by_version[b][t] for t in common) / len(common))
    if not shares:
        raise SystemExit(f"{path}: no two versions with demo task results")
    return sum(shares) / len(shares), len(shares)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, nargs="+", default=[32, 64, 128])
    p.add_argument("--alpha", type=float, default=0.05)
    p.add_argument("--power", type=float, default=0.8)
    p.add_argument("--reps", type=int, default=2000, help="simulated evaluations per point")
    p.add_argument("--p0", type=float, default=0.7, help="the best's pass rate")
    p.add_argument("--churn", type=float, nargs="+", default=[0.1, 0.2, 0.3])
    p.add_argument("--churn-from", help="measure the churn from a file of EvalResults (JSON lines)")
    p.add_argument("--graded", action="store_true", help="also the paired bootstrap on graded scores")
    p.add_argument("--sd", type=float, nargs="+", default=[0.1, 0.2])
    args = p.parse_args()
    churns = list(args.churn)
    if args.churn_from:
        c, pairs = measured_churn(args.churn_from)
        print(f"measured churn: {c:.3f} (mean over {pairs} consecutive version pairs of {args.churn_from})")
        churns = [round(c, 3)]
    started = time.perf_counter()
    print(f"pass/fail (McNemar exact, one-sided alpha {args.alpha}), p0 {args.p0}, power {args.power}, "
          f"{args.reps} simulated evaluations per point")
    print("smallest detectable drop (paired | unpaired intervals, ratio) and false refusals at no drop")
    print(f"{'n':>5} {'churn':>6} {'paired':>8} {'unpaired':>9} {'ratio':>6} {'false refusals':>15}")
    for n in args.n:
        for churn in churns:
            def draw(rng: random.Random, drop: float, n: int = n, churn: float = churn
                     ) -> tuple[dict[str, float], dict[str, float]]:
                return pass_fail_pair(rng, n, args.p0, churn, drop)
            hi = min(args.p0 - churn / 2 - 0.01, 0.6)
            test = paired(args.alpha, True)
            d_paired = detectable(draw, test, args.power, args.reps, hi)
            d_unpaired = detectable(draw, unpaired_intervals, args.power, args.reps, hi)
            false = power(draw, test, 0.0, args.reps, 2)
            ratio = f"{d_paired / d_unpaired:.2f}" if d_paired and d_unpaired else "-"
            print(f"{n:>5} {churn:>6.2f} {_fmt(d_paired):>8} {_fmt(d_unpaired):>9} {ratio:>6} {false:>15.3f}")
    if args.graded:
        reps = max(100, args.reps // 10)
        print(f"\ngraded (paired bootstrap, 500 resamples, one-sided alpha {args.alpha}), {reps} per point")
        print(f"{'n':>5} {'sd':>6} {'paired':>8} {'false refusals':>15}")
        for n in args.n:
            for sd in args.sd:
                def gdraw(rng: random.Random, drop: float, n: int = n, sd: float = sd
                          ) -> tuple[dict[str, float], dict[str, float]]:
                    return graded_pair(rng, n, sd, drop)
                test = paired(args.alpha, False)
                d = detectable(gdraw, test, args.power, reps, 0.5)
                false = power(gdraw, test, 0.0, reps, 2)
                print(f"{n:>5} {sd:>6.2f} {_fmt(d):>8} {false:>15.3f}")
    print(f"({time.perf_counter() - started:.0f} s)")


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


if __name__ == "__main__":
    main()
