"""Decode speed of the portable llama.cpp build against a native one on this machine.

``scripts/llama_build.sh`` compiles llama.cpp for a fixed x86-64 baseline (AVX2, FMA,
F16C, BMI2; AVX-512 and AMX off) instead of ``-march=native``. This measures what that
costs: single-sequence greedy decode, tokens/s, for each GGUF of the demo model
(``tiny-llama``: f16, q8_0, q4_k_m), under two Python interpreters whose llama_cpp
builds differ (the first is "portable", the second "native").

Each measurement runs in a child process of the interpreter under test (this file with
``--child``: stdlib and llama_cpp only, so the other venv needs nothing of quantroute).
The child uses llama_cpp's low-level API: load the model, decode the prompt, then decode
``--tokens`` tokens one at a time, each the greedy pick of llama.cpp's own sampler; only
that loop is timed. It does this ``--reps`` times per model (the KV cache cleared
between), after one untimed rep. The interpreters take turns, round by round, the order
alternating (A B, B A, ...), so drift and noise on a shared machine fall on both alike.
One llama.cpp thread: its threads spin, and a 2-core machine has no core to spare.

Output: a table of median tokens/s per build and precision over the rounds, the spread
(min-max), and the ratio portable / native; whether both builds decoded the same tokens.
JSON goes to ``benchmarks/results/build-<date>.json``, a bar chart to
``docs/img/bench_build.png``.

Run::

    python benchmarks/bench_build.py --python .venv/bin/python --python /tmp/qr-native/bin/python
    python benchmarks/bench_build.py ... --rounds 2 --reps 1     # a smoke run
    python benchmarks/bench_build.py ... --markdown              # rows for docs/benchmarks.md
    python benchmarks/bench_build.py --replot benchmarks/results/build-DATE.json
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "src" / "quantroute" / "demo" / "repo" / "tiny-llama"
BRANCHES = ("f16", "q8_0", "q4_k_m")
LABELS = ("portable", "native")
PROMPT = "def main():\n    "
N_CTX = 512  # the demo model's training context: prompt + warm-up + --tokens must fit
# /proc/cpuinfo flags that decide what a native build compiles
ISA_FLAGS = (
    "avx2", "fma", "f16c", "bmi2", "avx_vnni", "avx512f", "avx512bw", "avx512vl",
    "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16",
)  # fmt: skip


# -- the child: runs under the interpreter being measured ---------------------------


def child(cfg: dict[str, Any]) -> dict[str, Any]:
    """Time greedy single-token decode for each model in ``cfg``; stdlib + llama_cpp only."""
    import ctypes
    import hashlib

    import llama_cpp as lc

    lc.llama_backend_init()
    quiet = lc.llama_log_callback(lambda level, text, user: None)
    lc.llama_log_set(quiet, ctypes.c_void_p(0))
    lib = lc.llama_cpp._lib
    lib.ggml_commit.restype = ctypes.c_char_p
    out: dict[str, Any] = {
        "llama_cpp_python": lc.__version__,
        "ggml_commit": lib.ggml_commit().decode(),
        "system_info": lc.llama_print_system_info().decode().strip(),
        "prefix": sys.prefix,
        "models": {},
    }
    record = Path(sys.prefix) / "llama-build.json"
    if record.is_file():
        out["cmake_flags"] = json.loads(record.read_text()).get("cmake_flags")
    for name, path in cfg["models"]:
        mparams = lc.llama_model_default_params()
        mparams.n_gpu_layers = 0
        model = lc.llama_model_load_from_file(path.encode(), mparams)
        if not model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        vocab = lc.llama_model_get_vocab(model)
        cparams = lc.llama_context_default_params()
        cparams.n_ctx = cparams.n_batch = cparams.n_ubatch = N_CTX
        cparams.n_seq_max = 1
        cparams.n_threads = cparams.n_threads_batch = cfg["threads"]
        cparams.no_perf = True
        ctx = lc.llama_init_from_model(model, cparams)
        if not ctx:
            raise RuntimeError("llama.cpp could not create a context")
        sampler = lc.llama_sampler_chain_init(lc.llama_sampler_chain_default_params())
        lc.llama_sampler_chain_add(sampler, lc.llama_sampler_init_greedy())
        data = cfg["prompt"].encode()
        prompt = (lc.llama_token * N_CTX)()
        n_prompt = lc.llama_tokenize(vocab, data, len(data), prompt, N_CTX, True, False)
        if not 0 < n_prompt < N_CTX - cfg["tokens"]:
            raise RuntimeError(f"prompt of {n_prompt} tokens + {cfg['tokens']} > {N_CTX}")
        one = (lc.llama_token * 1)()
        seconds, digest = [], ""
        for rep in range(cfg["reps"] + 1):  # rep 0 warms up, untimed
            lc.llama_memory_clear(lc.llama_get_memory(ctx), True)
            if lc.llama_decode(ctx, lc.llama_batch_get_one(prompt, n_prompt)) != 0:
                raise RuntimeError("llama_decode failed on the prompt")
            tokens = [lc.llama_sampler_sample(sampler, ctx, -1)]
            t0 = time.perf_counter()
            for _ in range(cfg["tokens"]):
                one[0] = tokens[-1]
                if lc.llama_decode(ctx, lc.llama_batch_get_one(one, 1)) != 0:
                    raise RuntimeError("llama_decode failed")
                tokens.append(lc.llama_sampler_sample(sampler, ctx, -1))
            elapsed = time.perf_counter() - t0
            if rep:
                seconds.append(elapsed)
            digest = hashlib.sha256(repr(tokens).encode()).hexdigest()[:16]
        out["models"][name] = {"seconds": seconds, "tokens": cfg["tokens"], "digest": digest}
        lc.llama_sampler_free(sampler)
        lc.llama_free(ctx)
        lc.llama_model_free(model)
    return out


# -- the parent: rounds, statistics, report ------------------------------------------


@dataclass(frozen=True, slots=True)
class Cell:
    """One (build, precision): tokens/s of each round (total tokens / total decode time)."""

    label: str
    branch: str
    rounds_tok_s: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.rounds_tok_s)

    @property
    def spread(self) -> tuple[float, float]:
        return min(self.rounds_tok_s), max(self.rounds_tok_s)


def run_child(python: str, cfg: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["OMP_NUM_THREADS"] = str(cfg["threads"])  # the build links OpenMP
    # llama_cpp imports numpy, whose OpenBLAS threads otherwise spin beside the decode
    # (~4 % of the child's CPU samples under perf, on a 2-core machine).
    env["OPENBLAS_NUM_THREADS"] = "1"
    done = subprocess.run(
        [python, str(Path(__file__).resolve()), "--child", json.dumps(cfg)],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=env,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"{python}: the child failed ({done.returncode}):\n{done.stderr}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def measure(args: argparse.Namespace) -> dict[str, Any]:
    cfg = {
        "models": [(b, str(args.repo / f"{b}.gguf")) for b in args.branches],
        "threads": args.threads,
        "tokens": args.tokens,
        "reps": args.reps,
        "prompt": PROMPT,
    }
    pythons = dict(zip(LABELS, args.python, strict=True))
    rounds: dict[str, list[dict[str, Any]]] = {label: [] for label in LABELS}
    builds: dict[str, dict[str, Any]] = {}
    load_start = os.getloadavg()
    for index in range(-args.warmup_rounds, args.rounds):
        order = LABELS if index % 2 == 0 else LABELS[::-1]
        for label in order:
            result = run_child(pythons[label], cfg, args.timeout_s)
            models = result.pop("models")
            builds[label] = result | {"python": pythons[label]}
            if index < 0:
                continue
            rounds[label].append(models)
            rates = ", ".join(
                f"{b} {args.tokens * len(m['seconds']) / sum(m['seconds']):7.0f}"
                for b, m in models.items()
            )
            print(f"round {index + 1}/{args.rounds} {label:8s} tok/s: {rates}", flush=True)
    return {
        "date": dt.date.today().isoformat(),
        "machine": machine(),
        "load_avg": {"start": load_start, "end": os.getloadavg()},
        "config": cfg | {"rounds": args.rounds, "warmup_rounds": args.warmup_rounds},
        "builds": builds,
        "rounds": rounds,
    }


def cells(data: dict[str, Any]) -> dict[tuple[str, str], Cell]:
    out = {}
    for label, rounds in data["rounds"].items():
        for branch in data["config"]["models"]:
            name = branch[0]
            rates = tuple(
                r[name]["tokens"] * len(r[name]["seconds"]) / sum(r[name]["seconds"])
                for r in rounds
            )
            out[label, name] = Cell(label, name, rates)
    return out


def same_tokens(data: dict[str, Any], branch: str) -> bool:
    digests = {r[branch]["digest"] for rounds in data["rounds"].values() for r in rounds}
    return len(digests) == 1


COLUMNS = (
    "Precision", "Portable, median (tok/s)", "Portable, min-max", "Native, median (tok/s)",
    "Native, min-max", "Portable / native", "Round ratios, min-max", "Same tokens",
)  # fmt: skip


def table_rows(data: dict[str, Any]) -> list[list[str]]:
    table = cells(data)
    rows = []
    for name, _ in data["config"]["models"]:
        a, b = table["portable", name], table["native", name]
        # A round's two runs are back to back: their ratio cancels the slower drift.
        paired = [x / y for x, y in zip(a.rounds_tok_s, b.rounds_tok_s, strict=True)]
        rows.append(
            [
                name,
                f"{a.median:.0f}",
                f"{a.spread[0]:.0f}-{a.spread[1]:.0f}",
                f"{b.median:.0f}",
                f"{b.spread[0]:.0f}-{b.spread[1]:.0f}",
                f"{a.median / b.median:.3f}",
                f"{min(paired):.2f}-{max(paired):.2f}",
                "yes" if same_tokens(data, name) else "no",
            ]
        )
    return rows


def plain_table(rows: list[list[str]]) -> str:
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(COLUMNS)]
    lines = [[*COLUMNS], ["-" * w for w in widths], *rows]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in lines)


def markdown_table(rows: list[list[str]]) -> str:
    align = ["---"] + ["---:"] * (len(COLUMNS) - 2) + ["---"]
    return "\n".join("| " + " | ".join(r) + " |" for r in [[*COLUMNS], align, *rows])


def _model_name(config: dict[str, Any]) -> str:
    """The benchmarked model's folder name (tiny-llama, stdlib-bpe-llama, ...)."""
    models = config["models"]
    return Path(models[0][1]).parent.name if models else "?"


def caption(data: dict[str, Any]) -> str:
    m, c = data["machine"], data["config"]
    return (
        f"{data['date']}, {m['cpu']} ({m['cpus']} CPUs); {_model_name(c)}, {c['tokens']} tokens x "
        f"{c['reps']} reps per round, {c['rounds']} rounds, {c['threads']} thread; "
        f"llama-cpp-python {data['builds']['portable']['llama_cpp_python']}, "
        f"ggml {data['builds']['portable']['ggml_commit']}"
    )


def save_chart(data: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = cells(data)
    names = [name for name, _ in data["config"]["models"]]
    fig, ax = plt.subplots(figsize=(8, 4.4))
    width, xs = 0.38, range(len(names))
    for offset, label, color in (
        (-width / 2, "portable", "#1f77b4"),
        (width / 2, "native", "#999"),
    ):
        found = [table[label, n] for n in names]
        medians = [c.median for c in found]
        err = [[c.median - c.spread[0] for c in found], [c.spread[1] - c.median for c in found]]
        bars = ax.bar([x + offset for x in xs], medians, width, yerr=err, capsize=3, color=color)
        bars.set_label(f"{label} build")
        ax.bar_label(bars, fmt="%.0f", label_type="center", fontsize=8, color="white")
    ticks = [
        f"{n}\nportable / native {table['portable', n].median / table['native', n].median:.2f}x"
        for n in names
    ]
    ax.set_xticks(list(xs), ticks, fontsize=9)
    ax.set_ylabel("decode, tokens/s (median of rounds; bars: min-max)")
    ax.set_title("Single-sequence greedy decode: portable vs -march=native build", fontsize=10)
    ax.margins(y=0.15)
    ax.legend(loc="upper left", ncol=2, fontsize=9)
    fig.suptitle(caption(data), fontsize=7, y=0.02, va="bottom")
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def machine() -> dict[str, Any]:
    found: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            found.setdefault(key.strip(), value.strip())  # the first CPU's
    cpu = found.get("model name") or platform.processor() or "unknown"
    flags = set(found.get("flags", "").split())
    return {
        "platform": platform.platform(),
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "isa_flags": {f: f in flags for f in ISA_FLAGS},
    }


def report(data: dict[str, Any], args: argparse.Namespace) -> None:
    rows = table_rows(data)
    print()
    print(caption(data))
    for label, build in data["builds"].items():
        print(f"  {label}: {build['python']} -- {build['system_info']}")
    print(plain_table(rows))
    if args.markdown:
        print()
        print(markdown_table(rows))
    save_chart(data, args.chart)
    print(f"chart: {args.chart}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument(
        "--python",
        action="append",
        default=[],
        help="an interpreter whose llama_cpp to measure; twice: portable, then native",
    )
    p.add_argument("--repo", type=Path, default=DEMO, help="folder of {f16,q8_0,q4_k_m}.gguf")
    p.add_argument("--branches", nargs="+", default=list(BRANCHES))
    p.add_argument("--tokens", type=int, default=448, help="decoded tokens per rep (timed)")
    p.add_argument("--reps", type=int, default=5, help="timed reps per model per round")
    p.add_argument("--rounds", type=int, default=10, help="rounds per build (interleaved)")
    p.add_argument("--warmup-rounds", type=int, default=1)
    p.add_argument("--threads", type=int, default=1, help="llama.cpp threads")
    p.add_argument("--timeout-s", type=float, default=600.0, help="per child process")
    p.add_argument("--markdown", action="store_true", help="also a table for docs/")
    p.add_argument("--out", type=Path, default=None, help="JSON (default: benchmarks/results/)")
    p.add_argument("--chart", type=Path, default=ROOT / "docs" / "img" / "bench_build.png")
    p.add_argument("--replot", type=Path, help="report and plot a saved JSON, measure nothing")
    args = p.parse_args(argv)
    if args.child is not None:
        print(json.dumps(child(json.loads(args.child))))
        return 0
    if args.replot:
        report(json.loads(args.replot.read_text()), args)
        return 0
    if len(args.python) != 2:
        p.error("give --python twice: the portable build's interpreter, then the native one's")
    data = measure(args)
    out = args.out or ROOT / "benchmarks" / "results" / f"build-{data['date']}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1) + "\n")
    report(data, args)
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
