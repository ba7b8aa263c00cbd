"""Tables of measurements: one cell format for every table (benchmarks, evaluation, model cards), and the
Markdown / JSON / PNG report the benchmarks and `training/evaluate.py` write."""

from __future__ import annotations

import json
import os
import platform
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def format_cell(value: Any) -> str:
    """A table cell: `–` for a missing value, integers with thousands separators, floats to 3 significant
    digits (whole above 1000), anything else as `str`."""
    if value is None:
        return "–"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


def markdown_table(rows: list[dict], columns: dict[str, str]) -> str:
    """A Markdown table of `rows`; `columns` maps row keys to headers (a missing key is a missing value)."""
    lines = ["| " + " | ".join(columns.values()) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(format_cell(row.get(key)) for key in columns) + " |" for row in rows]
    return "\n".join(lines)


def machine() -> str:
    """The processor, its core count, and torch's version and threads: what a timing depends on."""
    return (f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__} "
            f"({torch.get_num_threads()} threads)")


def log_log_plot(rows: list[dict], x: str, xlabel: str,
                 panels: list[tuple[str | Callable[[dict], float], str]],
                 line: Callable[[dict], str] = lambda row: row["model"]) -> Callable:
    """A `plot` for `write_report`: side by side, one log-log panel per `(y, ylabel)` of `panels` (`y` a row
    key or a function of the row) against the row key `x` (ticked at its values), with one line per label
    `line(row)` (by default the model, `row["model"]`)."""

    def plot(plt):
        fig, axes = plt.subplots(1, len(panels), figsize=(6, 4) if len(panels) == 1 else (5 * len(panels), 4),
                                 squeeze=False)
        for ax, (y, ylabel) in zip(axes[0], panels, strict=True):
            value = y if callable(y) else (lambda row, key=y: row[key])
            for label in dict.fromkeys(line(row) for row in rows):
                mine = [row for row in rows if line(row) == label]
                ax.plot([row[x] for row in mine], [value(row) for row in mine], "o-", label=label)
            ax.set(xscale="log", yscale="log", xlabel=xlabel, ylabel=ylabel)
            measured = sorted({row[x] for row in rows})  # ticks at the measured x values, not at powers of 10
            ax.set_xticks(measured, [format_cell(v) for v in measured])
            ax.tick_params(axis="x", which="minor", bottom=False, labelbottom=False)
            ax.legend()
        fig.tight_layout()
        return fig

    return plot


def write_report(rows: list[dict], columns: dict[str, str], out_dir: str | Path, name: str,
                 plot: Callable | None = None, meta: dict | None = None, sections: dict[str, str] | None = None) -> str:
    """Print and save a markdown table of `rows` (`columns` maps row keys to headers), the rows as JSON (with
    `meta`), and a PNG drawn by `plot(plt)` when matplotlib is installed. `sections` ({title: Markdown}) follow
    the table in the Markdown, each under a `###` heading (the data behind them belongs in `meta`). Returns the
    Markdown written, without the machine line."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    table = "\n\n".join([markdown_table(rows, columns),
                          *(f"### {title}\n\n{text}" for title, text in (sections or {}).items())])
    print(table)
    (out / f"{name}.md").write_text(f"Machine: {machine()}\n\n{table}\n")
    (out / f"{name}.json").write_text(json.dumps({"machine": machine(), **(meta or {}), "rows": rows}, indent=2))
    written = [f"{name}.md", f"{name}.json"]
    if plot is not None:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("(install matplotlib, e.g. `pip install -e .[bench]`, for the plot)")
        else:
            fig = plot(plt)
            fig.savefig(out / f"{name}.png", dpi=120)
            plt.close(fig)
            written.append(f"{name}.png")
    print(f"wrote {', '.join(str(out / w) for w in written)}")
    return table
