"""One PNG from blocking.py results: state bytes (x, log) vs blocking time (y, log), one line per method.

    python benchmarks/plot.py benchmarks/results/blocking-cpu.json --out benchmarks/results/blocking.png
    python benchmarks/plot.py blocking-cpu.json blocking-cuda.json --out blocking.png

Every numeric key of a row that ends in ``_s`` is a method (``easyckpt_launch_s``, ``torch_save_fsync_s``,
and any added later, e.g. ``dcp_save_s``, ``dcp_async_save_s``), so new methods are plotted without
changes here. With several files, each line's label names its file's device (or the file's name).
Needs matplotlib (the optional ``plot`` extra); it renders with the Agg backend, no display needed.
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

MARKERS = "osD^v<>ph*Xd"
STYLES = ["-", "--", ":", "-."]


def series(results: list[tuple[Path, dict[str, Any]]]) -> dict[tuple[str, str], list[tuple[float, float]]]:
    """{(method, file tag): [(bytes, seconds), ...] sorted by bytes} for every numeric ``*_s`` key of every row."""
    tags = [label_of(path, result) for path, result in results]
    if len(set(tags)) < len(tags):
        tags = [path.stem for path, _ in results]
    found: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for (path, result), tag in zip(results, tags):
        rows = result.get("rows")
        if not isinstance(rows, list):
            raise ValueError(f"{path}: no 'rows' list (is it a blocking.py result?)")
        for row in rows:
            size = row.get("bytes")
            if not isinstance(size, (int, float)) or isinstance(size, bool) or size <= 0:
                raise ValueError(f"{path}: a row without a positive 'bytes': {row}")
            for key, value in row.items():
                if not key.endswith("_s") or isinstance(value, bool) or not isinstance(value, (int, float)):
                    continue
                if not math.isfinite(value) or value <= 0:
                    continue  # cannot be shown on a log axis
                found.setdefault((key[:-2], tag), []).append((float(size), float(value)))
    return {key: sorted(points) for key, points in found.items()}


def label_of(path: Path, result: dict[str, Any]) -> str:
    machine = result.get("machine") or {}
    return str(machine.get("gpu") or machine.get("device") or path.stem)


def render(lines: dict[tuple[str, str], list[tuple[float, float]]], out: Path, title: str) -> None:
    """One line per (method, file): a method keeps its colour and marker across files, a file its line style."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5), dpi=120)
    try:
        methods = sorted({method for method, _ in lines})
        tags = list(dict.fromkeys(tag for _, tag in lines))
        colours = matplotlib.colormaps["tab10" if len(methods) <= 10 else "tab20"]
        for (method, tag), points in sorted(lines.items()):
            xs, ys = zip(*points)
            number = methods.index(method)
            ax.plot(xs, ys, color=colours(number % colours.N), marker=MARKERS[number % len(MARKERS)],
                    linestyle=STYLES[tags.index(tag) % len(STYLES)],
                    label=method if len(tags) == 1 else f"{method} ({tag})")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("state size (bytes)")
        ax.set_ylabel("time the training loop is blocked (s)")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
        fig.tight_layout()
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, format="png")
    finally:
        plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", type=Path, nargs="+", help="JSON written by blocking.py --out")
    parser.add_argument("--out", type=Path, required=True, help="the PNG to write")
    parser.add_argument("--title", default="Blocking time per checkpoint")
    args = parser.parse_args(argv)
    results = [(path, json.loads(path.read_text())) for path in args.results]
    lines = series(results)
    if not lines:
        parser.error("no numeric '*_s' values in the rows of " + ", ".join(map(str, args.results)))
    render(lines, args.out, args.title)
    labels = sorted(f"{method} ({tag})" for method, tag in lines)
    print(f"{args.out}: {len(lines)} lines: " + ", ".join(labels))
    return {"benchmark": "plot", "out": str(args.out), "inputs": [str(p) for p in args.results],
            "lines": {f"{method} ({tag})": [list(p) for p in points] for (method, tag), points in lines.items()}}


if __name__ == "__main__":
    main()
