"""How profiles are shown: ``profile.png`` and the text table ``quantroute profile`` prints.

The plot has one point per branch: x is decode tokens/s, y is mean KLD against the
reference on a log scale (lower is better); the marker's area grows with the
branch's weights (its file). Each point is labelled with its branch's name (two
branches may share a precision: ``f16`` in GGUF and ``onnx_fp16`` in ONNX), and the
legend below the axes gives each branch's precision, KLD, top-1, weights and
measured resident memory, one line each, so that points close together cannot
overlap them. The reference has KLD 0, which a log axis cannot show: it sits at the
bottom as a downward triangle. The table's rows are branches too.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from quantroute.quality.profile import BranchProfile, ProfileMethod

PLOT_NAME = "profile.png"


def _bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB"):
        if size < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.2f} GiB"


def plot_profiles(model: str, profiles: Sequence[BranchProfile], path: Path) -> Path:
    """Draw ``profiles`` into a PNG at ``path`` (matplotlib's Agg canvas, no display)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.collections import PathCollection
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.0, 4.6 + 0.18 * len(profiles)), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()

    positive = [p.mean_kld for p in profiles if p.mean_kld > 0 and math.isfinite(p.mean_kld)]
    floor = min(positive) / 10 if positive else 1e-6
    top = max(positive) * 4 if positive else 1e-3
    biggest = max((p.file_bytes for p in profiles), default=1) or 1
    speeds = [p.decode_tps for p in profiles]

    for p in profiles:
        at_floor = not (p.mean_kld > 0 and math.isfinite(p.mean_kld))
        y = floor if at_floor else p.mean_kld
        size = 80 + 900 * p.file_bytes / biggest
        note = "reference, KLD 0" if p.mean_kld == 0 else f"KLD {p.mean_kld:.2g}"
        ax.scatter(
            [p.decode_tps],
            [y],
            s=size,
            marker="v" if at_floor else "o",
            alpha=0.6,
            edgecolors="black",
            linewidths=0.8,
            zorder=3,
            label=f"{p.branch} ({p.precision}): {note}, top-1 {100 * p.top1:.1f}%, "
            f"weights {_bytes(p.file_bytes)}, RSS {_bytes(p.rss_bytes)}",
        )
        ax.annotate(
            p.branch, (p.decode_tps, y), xytext=(9, 7), textcoords="offset points", fontsize=8
        )

    ax.set_yscale("log")
    ax.set_ylim(floor / 2.5, top)
    if speeds:
        span = max(speeds) - min(speeds)
        pad = max(span * 0.25, max(speeds) * 0.1, 1.0)
        ax.set_xlim(max(0.0, min(speeds) - pad), max(speeds) + pad)
    ax.set_xlabel("decode speed (tokens/s)  →  faster")
    ax.set_ylabel("mean KL divergence vs reference (log)  ↓  better")
    ax.set_title(f"{model}: quality against speed (marker area: weights)")
    ax.grid(True, which="major", alpha=0.3)
    if profiles:
        legend = ax.legend(
            loc="upper left", bbox_to_anchor=(0.0, -0.13), fontsize=7.5, frameon=False
        )
        for handle in legend.legend_handles:  # one marker size in the legend, not the weights'
            if isinstance(handle, PathCollection):
                handle.set_sizes([40])
    fig.tight_layout()
    fig.savefig(path, bbox_inches="tight")
    return path


_COLUMNS = (
    "branch",
    "precision",
    "mean KLD",
    "p99 KLD",
    "max KLD",
    "top-1 %",
    "PPL",
    "ln(PPL/PPL_ref)",
    "RMS dp %",
    "file",
    "RSS",
    "prefill tok/s",
    "decode tok/s",
)


def render_table(
    model: str, method: ProfileMethod, profiles: Sequence[BranchProfile], elapsed_s: float
) -> str:
    """One model's profile as an aligned plain-text table under a one-line summary."""
    m = method
    head = (
        f"{model}: reference {m.reference_branch}, n_ctx {m.n_ctx}, {m.n_chunks} chunks, "
        f"{m.n_scored_tokens} scored tokens, calibration {m.calibration_sha256[:12]}, "
        f"{m.n_threads} threads, {m.llama_cpp_version}"
        + (f", {m.onnxruntime_version}" if m.onnxruntime_version else "")
        + f" ({elapsed_s:.1f} s)"
    )
    rows = [_COLUMNS]
    for p in profiles:
        q = p.quality
        rows.append(
            (
                p.branch,
                str(p.precision),
                f"{q.mean_kld:.6f} ± {q.kld_stderr:.6f}",
                f"{q.kld_p99:.5f}",
                f"{q.kld_max:.4f}",
                f"{100 * q.top1:.2f} ± {100 * q.top1_sigma:.2f}",
                f"{q.ppl_q:.4f}",
                f"{q.ln_ppl_ratio:+.5f} ± {q.ln_ppl_ratio_stderr:.5f}",
                f"{100 * q.rms_dp:.3f}",
                _bytes(p.file_bytes),
                _bytes(p.rss_bytes),
                f"{p.prefill_tps:,.0f}",
                f"{p.decode_tps:,.0f}",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(_COLUMNS))]
    lines = [head]
    for k, r in enumerate(rows):
        cells = [
            c.ljust(w) if i < 2 else c.rjust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)
