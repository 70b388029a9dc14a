"""`nextstate eval`: what the evaluations say, and what the gate made of them.

    nextstate eval show [--json]                 per version: each suite's score with its
                                                 interval and n, promoted / refused / rolled
                                                 back / skipped and why (the paired test, its
                                                 p-value, n and effect against the best)
    nextstate eval plot -o curve.png             the learning curve: each suite's score per
                                                 version, and the mean reward of the training
                                                 samples per policy version (`batches`)
    nextstate eval run VERSION [--suite S] [--samples N]
                                                 request a (larger) evaluation of VERSION
    nextstate eval run --model PATH | --version RUN:V [--suite S…]
                                                 evaluate a model outside the run beside its
                                                 versions, never gated (eval_models.py)

Results come from the `evals` stream and the bucket (`evals/<run>/v…/<suite>.json`, which
outlives the stream's trimming); per version and suite the one the gate uses counts (the
newest, unless it rests on fewer samples); a model's results (`evals/<run>/models/…`) are
listed after the versions, the newest per suite. Decisions come from the gate's `gate-state`
and the `promotions` stream, the newest of either. The bucket is optional: without it
(no credentials, not reachable) the stream alone is shown, and stderr says why. Reading
them: services/ctl/eval_records.py (shared with eval_models.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from redis.exceptions import RedisError

from services.ctl.common import redis_error, settings_from
from services.ctl.eval_models import add_arguments, run_model_cmd
from services.ctl.eval_records import DEFAULT_SUITES, collect, gate_summary, gather
from shared import checkpoints as ckpt
from shared.errors import NextstateError, NoCheckpoint, StoreError
from shared.keys import Keys
from shared.settings import Settings
from shared.store import Bucket
from shared.streams import Bus


def register(sub: Any) -> None:
    p = sub.add_parser("eval", help="evaluation results, gate decisions, the learning curve")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--run", help="run name (default NEXTSTATE_RUN, or the stack's)")
    cmds = p.add_subparsers(dest="eval_command", required=True, metavar="ACTION")
    show = cmds.add_parser("show", parents=[common],
                           help="per version: scores with intervals, promoted or refused and why")
    show.add_argument("--json", action="store_true", help="machine-readable output")
    show.set_defaults(func=show_cmd)
    plot = cmds.add_parser("plot", parents=[common], help="write the learning curve as a PNG")
    plot.add_argument("-o", "--output", type=Path, default=Path("curve.png"), help="the PNG to write")
    plot.set_defaults(func=plot_cmd)
    run = cmds.add_parser("run", parents=[common],
                          help="request an evaluation of a version (e.g. with more samples), or of any model "
                               "beside the run (--model, --version)")
    run.add_argument("version", type=int, nargs="?", help="a version of this run (the gate sees its result)")
    run.add_argument("--suite", action="extend", nargs="+",
                     help="suites (repeatable; default: the gate's suites)")
    run.add_argument("--samples", type=int, help="tasks / prompts (default: the evaluator's)")
    run.add_argument("--timeout", type=float, default=900.0, help="job timeout in seconds (default 900)")
    run.add_argument("--retries", type=int, default=2, help="retries of a failed job (default 2)")
    add_arguments(run)
    run.set_defaults(func=run_cmd)


# -- show ----------------------------------------------------------------------------------------
def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.4g}"


def render(data: dict[str, Any]) -> str:
    gate = data.get("gate")
    if gate:
        cfg = gate.get("config") or {}
        test = f"paired test at alpha {cfg['alpha']}" if cfg.get("alpha") is not None else f"delta {cfg.get('delta')}"
        rule = (f"suites {','.join(cfg.get('suites', []))}, {test}, drift <= "
                f"{cfg.get('drift_max')}, wait {cfg.get('wait_s')}s") if cfg else "rule unknown"
        serving = "-" if gate.get("serving") is None else f"v{gate['serving']}"
        lines = [f"run {data['run']}   gate: serving {serving}, promoted "
                 f"{' '.join(f'v{v}' for v in gate.get('promoted', [])) or 'none'}   ({rule})"]
    else:
        lines = [f"run {data['run']}   gate: no decisions recorded (off, or nothing evaluated yet)"]
    if not data["versions"]:
        lines.append("no evaluation results yet")
    for row in data["versions"]:
        decision = "base" if row["version"] == 0 else (row["decision"] or "undecided")
        scores = "   ".join(
            f"{suite} {_num(s['score'])}"
            + (f" [{_num(s['ci_low'])}, {_num(s['ci_high'])}]" if s["ci_low"] is not None else "")
            + f" n={s['n']}"
            for suite, s in sorted(row["suites"].items()))
        lines.append(f"v{row['version']:<5} {decision:<12} {scores or '(no results)'}")
        if row["reasons"]:
            lines.append(f"{'':20}why: {'; '.join(row['reasons'])}")
    if data.get("models"):
        lines.append("models beside the run (`eval run --model/--version`; never gated):")
        lines += [f"  {m['model']:<17} {_scores(m['suites'])}" for m in data["models"]]
    return "\n".join(lines)


def _scores(suites: dict[str, dict[str, Any]]) -> str:
    return "   ".join(
        f"{suite} {_num(s['score'])}"
        + (f" [{_num(s['ci_low'])}, {_num(s['ci_high'])}]" if s["ci_low"] is not None else "")
        + f" n={s['n']}"
        for suite, s in sorted(suites.items()))


def show_cmd(args: argparse.Namespace) -> int:
    settings = settings_from(args)
    data = asyncio.run(gather(settings, args.run or settings.run))
    print(json.dumps(data, indent=2) if args.json else render(data))
    return 0


# -- plot ------------------------------------------------------------------------------------------
MODEL_STYLES = ["--", ":", "-.", (0, (5, 1))]  # a model beside the run: a line across its suite's panel
MARKERS = {"base": ("s", "tab:gray"), "promoted": ("o", "tab:green"), "refused": ("x", "tab:red"),
           "rolled_back": ("v", "tab:orange"), "skipped": ("+", "tab:gray"), "undecided": (".", "tab:gray")}


def draw(data: dict[str, Any], reward: dict[int, float], output: Path) -> None:
    """The learning curve as a PNG: one panel per suite, then the training reward."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    models = data.get("models") or []
    suites = sorted({s for row in [*data["versions"], *models] for s in row["suites"]})
    panels = len(suites) + 1
    fig, axes = plt.subplots(panels, 1, sharex=True, figsize=(9, 2.6 * panels), squeeze=False)
    for ax, suite in zip(axes[:, 0], suites, strict=False):
        rows = [(row["version"], row["suites"][suite],
                 "base" if row["version"] == 0 else row["decision"] or "undecided")
                for row in data["versions"] if suite in row["suites"]]
        xs = [v for v, _, _ in rows]
        ys = [s["score"] for _, s, _ in rows]
        lo = [s["score"] - s["ci_low"] if s["ci_low"] is not None else 0.0 for _, s, _ in rows]
        hi = [s["ci_high"] - s["score"] if s["ci_high"] is not None else 0.0 for _, s, _ in rows]
        ax.errorbar(xs, ys, yerr=[lo, hi], color="tab:blue", alpha=0.6, capsize=3, zorder=1)
        for decision, (marker, color) in MARKERS.items():
            pts = [(v, s["score"]) for v, s, d in rows if d == decision]
            if pts:
                ax.scatter(*zip(*pts, strict=True), marker=marker, color=color, zorder=2, label=decision)
        beside = [(m["model"], m["suites"][suite]) for m in models if suite in m["suites"]]
        for i, (name, s) in enumerate(beside):
            ax.axhline(s["score"], linestyle=MODEL_STYLES[i % len(MODEL_STYLES)], color="tab:brown", alpha=0.8,
                       zorder=1, label=name)
        scored = [s for _, s, _ in rows] + [s for _, s in beside]
        better = "higher" if all(s["higher_is_better"] for s in scored) else "lower"
        ax.set_ylabel(f"{suite}\n({better} is better)")
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize="small")
    ax = axes[-1, 0]
    if reward:
        ax.plot(list(reward), list(reward.values()), marker="o", color="tab:purple")
    else:
        ax.text(0.5, 0.5, "no training batches on the stream", ha="center", va="center",
                transform=ax.transAxes)
    ax.set_ylabel("mean training reward")
    ax.set_xlabel("policy version")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    fig.suptitle(f"nextstate run {data['run']}: learning curve")
    fig.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, format="png", dpi=100)
    plt.close(fig)


def plot_cmd(args: argparse.Namespace) -> int:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise NextstateError("`nextstate eval plot` needs matplotlib: pip install 'nextstate[ctl]'") from None
    settings = settings_from(args)
    run = args.run or settings.run
    data = asyncio.run(gather(settings, run, batches=True))
    reward: dict[int, float] = data.pop("reward")
    if not data["versions"] and not reward and not data["models"]:
        raise NextstateError(f"nothing to plot for run {run}: no evaluation results and no training batches")
    draw(data, reward, args.output)
    beside = f", {len(data['models'])} model(s) beside it" if data["models"] else ""
    print(f"wrote {args.output} ({len(data['versions'])} evaluated version(s), "
          f"{len(reward)} policy version(s) with training samples{beside})")
    return 0


# -- run ------------------------------------------------------------------------------------------
def run_cmd(args: argparse.Namespace) -> int:
    if args.model is not None or args.source is not None:
        return run_model_cmd(args)
    if args.version is None:
        raise NextstateError("give VERSION (of this run), --model PATH or --version RUN:V")
    try:
        from shared.evaljobs import enqueue_eval, rq_connection
    except ImportError:
        raise NextstateError("this installation has no evaluation jobs (shared/evaljobs.py)") from None
    if args.samples is not None and args.samples < 1:
        raise NextstateError("--samples must be at least 1")
    settings = settings_from(args)
    run = args.run or settings.run
    keys = Keys(settings.redis.prefix)
    try:
        with Bucket(settings.bucket.model_copy(update={"timeout": 5.0}), retries=1) as bucket:
            ckpt.read_manifest(bucket, ckpt.manifest_key(run, args.version))
    except NoCheckpoint:
        raise NextstateError(f"run {run} has no committed v{args.version} to evaluate "
                             f"(`nextstate rollback --list` shows the versions)") from None
    except (StoreError, OSError) as exc:
        print(f"nextstate: could not check v{args.version} in the bucket ({exc}); enqueuing anyway",
              file=sys.stderr)
    try:
        suites = args.suite or asyncio.run(default_suites(settings, run, args.version))
        conn = rq_connection(settings.redis.url, socket_timeout=settings.redis.socket_timeout,
                             connect_timeout=settings.redis.connect_timeout)
        try:
            for suite in suites:
                job = enqueue_eval(conn, keys, run, args.version, suite, samples=args.samples,
                                   timeout_s=args.timeout, retries=args.retries)
                print(f"enqueued {job}: {suite} on {run} v{args.version}"
                      + (f" with {args.samples} samples" if args.samples else ""))
        finally:
            conn.close()
    except RedisError as exc:
        raise redis_error(exc, settings) from exc
    print("its results appear in `nextstate eval show` once an evaluator ran them "
          "(an id enqueued before runs once)")
    return 0


async def default_suites(settings: Settings, run: str, version: int) -> list[str]:
    """The gate's suites, else those this version was evaluated on, else demo and drift."""
    async with Bus(settings) as bus:
        gate = gate_summary(await bus.redis.hgetall(bus.keys.gate_state))
        if gate and gate["config"].get("suites"):
            return [str(s) for s in gate["config"]["suites"]]
        data = await collect(bus, run, [])
    seen = sorted({s for row in data["versions"] if row["version"] == version for s in row["suites"]})
    return seen or list(DEFAULT_SUITES)
