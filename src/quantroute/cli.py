"""The ``quantroute`` command.

Flags of ``serve`` are generated from the settings tree: ``--server-port``,
``--engine-parallel`` and so on, with the short forms ``--host``, ``--port``
and ``--repo``. ``quantroute serve --help`` lists them all.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import logging
import sys
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from quantroute.config import DEMO_REPO, Settings, default_settings, load_settings
from quantroute.errors import QuantrouteError
from quantroute.repo_cli import add_commands as add_repository_commands
from quantroute.types import Precision

log = logging.getLogger("quantroute")

_SHORT = {"server.host": "--host", "server.port": "--port", "telemetry.devices": "--devices"}


def _leaf_fields(model: type[BaseModel], prefix: str = "") -> list[tuple[str, Any]]:
    leaves: list[tuple[str, Any]] = []
    for name, info in model.model_fields.items():
        annotation = info.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            leaves += _leaf_fields(annotation, f"{prefix}{name}.")
        else:
            leaves.append((f"{prefix}{name}", info))
    return leaves


_NULL = object()  # a flag given as "null": the setting unset (a tier without a bound)


def _members(annotation: Any) -> tuple[Any, ...]:
    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    return typing.get_args(annotation) if union else (annotation,)


def _flag_type(annotation: Any) -> Callable[[str], Any]:
    """How a flag's text becomes the setting's input: JSON for a dict or list setting (as
    its environment variable takes), ``null`` for none where the setting may be unset."""
    members = _members(annotation)
    is_json = any(m in (dict, list) or typing.get_origin(m) in (dict, list) for m in members)
    nullable = type(None) in members

    def convert(text: str) -> Any:
        if nullable and text == "null":
            return _NULL
        if not is_json:
            return text
        try:
            return json.loads(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None

    return convert


def _add_settings_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("settings (also QUANTROUTE_* variables or --config FILE)")
    defaults = default_settings()  # what a fresh server has: no environment, no file
    for path, info in _leaf_fields(Settings):
        flags = ["--" + path.replace(".", "-").replace("_", "-")]
        if path in _SHORT:
            flags.insert(0, _SHORT[path])
        default = functools.reduce(getattr, path.split("."), defaults)
        group.add_argument(
            *flags,
            dest=f"set:{path}",
            default=None,
            type=_flag_type(info.annotation),
            metavar=path.rsplit(".", 1)[-1].upper(),
            help=f"{info.description or ''} (default: {default})".replace("%", "%%"),
        )


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for key, value in vars(args).items():
        if key.startswith("set:") and value is not None:
            node = tree
            *parents, leaf = key[4:].split(".")
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = None if value is _NULL else value
    return tree


def _settings(args: argparse.Namespace) -> Settings:
    return load_settings(args.config, **_overrides(args))


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from quantroute.api.app import create_app
    from quantroute.observability import configure_logging

    settings = _settings(args)
    obs = settings.observability
    configure_logging(settings.server.log_level, obs.log_format)
    app = create_app(settings, freeze_gc=True)  # this process is the app's
    # Chosen, not left to "auto": the streaming path's cost per token is measured on these
    # (benchmarks/bench_gateway.py); uvicorn[standard] installs both where they build.
    loop = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
    http = "httptools" if importlib.util.find_spec("httptools") else "h11"
    logging.getLogger(__name__).info("event loop %s, HTTP parser %s", loop, http)
    server = settings.server
    protocol: Any = http
    if http == "httptools":  # it bounds no request head: ours does (h11 has a bound of its own)
        from quantroute.api.protocol import bounded

        protocol = bounded(server.max_header_bytes, server.header_timeout_s, server.body_timeout_s)
    uvicorn.run(
        app,
        host=server.host,
        port=server.port,
        loop=loop,
        http=protocol,
        h11_max_incomplete_event_size=server.max_header_bytes,
        log_level=settings.server.log_level,
        log_config=None,  # uvicorn's lines go through our handler (JSON or plain)
        access_log=not obs.access_log,  # ours carries tokens, TTFT and the request id
        timeout_graceful_shutdown=10,
    )
    return 0


def cmd_demo_build(args: argparse.Namespace) -> int:
    """Build a demo model; print the model repository that holds it (for ``serve --repo``)."""
    from dataclasses import replace

    from quantroute.demo import (
        BPE_MODEL_NAME,
        MODEL_NAME,
        BpeBuildConfig,
        build_bpe_demo,
        build_demo,
        ensure_demo_repo,
    )

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    if args.model == MODEL_NAME:
        from quantroute.demo.onnx_export import add_onnx_branches
        from quantroute.quality import format_table, profile_model

        out = args.out or DEMO_REPO / MODEL_NAME
        build_demo(out, steps=args.steps, seed=args.seed, progress=True, max_seconds=args.seconds)
        manifest = add_onnx_branches(out, progress=True)  # from the f16 file just written
        log.info("profile:\n%s", format_table(profile_model(out, progress=True)))
        repo = out.parent
    else:
        base = BpeBuildConfig()
        train = base.train
        if args.steps is not None:
            train = replace(train, steps=args.steps)
        if args.seconds is not None:
            train = replace(train, max_seconds=args.seconds)
        config = replace(base, train=train)
        if args.out is not None:  # a folder of the caller's choosing: no cache
            manifest = build_bpe_demo(args.out, config=config, seed=args.seed, progress=True)
            repo = args.out.parent
        else:
            repo = ensure_demo_repo(
                BPE_MODEL_NAME,
                config=config,
                seed=args.seed,
                progress=True,
                rebuild=args.rebuild,
                cache_root=args.cache,
            )
            from quantroute.registry.manifest import load_manifest

            manifest = load_manifest(repo / BPE_MODEL_NAME)
    for name, spec in manifest.branches.items():
        log.info("%-8s %-24s sha256 %s", name, spec.file, spec.sha256[:16])
    log.info("serve it with: quantroute serve --repo %s", repo)
    print(repo)
    return 0


def cmd_devices(args: argparse.Namespace) -> int:
    """Read the devices once (as the server would) and print them."""
    import asyncio
    import json

    from quantroute.telemetry import format_table, snapshot_to_json
    from quantroute.telemetry.selection import (
        health_from_settings,
        margin_from_settings,
        poller_from_settings,
        provider_from_settings,
    )

    telemetry = _settings(args).telemetry
    provider = provider_from_settings(telemetry)
    health = health_from_settings(telemetry)
    try:
        snapshot = asyncio.run(poller_from_settings(provider, telemetry, health=health).poll_once())
    finally:
        provider.close()
    factors = health.factors(snapshot.device_ids)
    if args.json:
        body = snapshot_to_json(snapshot, health=factors, margin=margin_from_settings(telemetry))
        print(json.dumps(body, indent=2))
    else:
        print(format_table(snapshot, health=factors))
    return 0 if snapshot.devices else 1


def cmd_doctor(args: argparse.Namespace) -> int:
    """Check the llama.cpp build, the GPU toolchain, the devices and a decode per precision."""
    import json

    from quantroute.doctor import format_report, report_to_json, run_doctor

    settings = _settings(args)
    faults = {Precision(p): "sigill" for p in args.fault_precision}
    report = run_doctor(settings.repo, settings.telemetry, faults=faults, n_threads=args.threads)
    if args.json:
        print(json.dumps(report_to_json(report), indent=2))
    else:
        print(format_report(report))
    return 0 if report.ok else 1


def cmd_profile(args: argparse.Namespace) -> int:
    from quantroute.quality import format_table, profile_repo

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    text = args.text.read_text() if args.text else None
    result = profile_repo(
        args.repo,
        model=args.model,
        text=text,
        n_ctx=args.n_ctx,
        max_chunks=args.max_chunks,
        n_threads=args.threads,
        progress=True,
        top_k=args.top_k,
        secret=default_settings().secret,  # a remote branch's key, by the variable it names
    )
    print(format_table(result))
    for model in result.models:
        log.info("%s: wrote %s and %s", model.model, model.profile_path, model.plot_path)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="quantroute",
        description="An LLM server that picks the precision branch for every request.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser(
        "serve",
        help="serve a model repository over the OpenAI API",
        description="Serve a model repository over an OpenAI-compatible API.",
    )
    serve.add_argument("--config", type=Path, default=None, help="YAML settings file")
    _add_settings_flags(serve)
    serve.set_defaults(func=cmd_serve)

    devices = sub.add_parser(
        "devices",
        help="show the devices quantroute sees",
        description="Read every device once (NVML, nvidia-smi, host RAM or simulated) and "
        "print memory, load and health.",
    )
    devices.add_argument("--config", type=Path, default=None, help="YAML settings file")
    devices.add_argument(
        "--devices",
        dest="set:telemetry.devices",
        default=None,
        metavar="SPEC",
        help="device provider, e.g. auto, cpu, sim:2x24GiB",
    )
    devices.add_argument("--json", action="store_true", help="print JSON, as GET /v1/devices")
    devices.set_defaults(func=cmd_devices)

    doctor = sub.add_parser(
        "doctor",
        help="check that this llama.cpp build runs here",
        description="Report the llama.cpp build (backends, compiled CPU features, any this CPU "
        "lacks), the GPU and CUDA toolkit, the devices, and decode one token with a branch of "
        "every precision in the repository, each in its own process. Exits 1 if any fails.",
    )
    doctor.add_argument("--config", type=Path, default=None, help="YAML settings file")
    doctor.add_argument(
        "--repo",
        dest="set:repo",
        type=Path,
        default=None,
        metavar="PATH",
        help="model repository (default: the settings' repo, the packaged demo)",
    )
    doctor.add_argument(
        "--devices",
        dest="set:telemetry.devices",
        default=None,
        metavar="SPEC",
        help="device provider, e.g. auto, cpu, sim:2x24GiB",
    )
    doctor.add_argument("--threads", type=int, default=1, help="llama.cpp threads per check")
    doctor.add_argument("--json", action="store_true", help="print the report as JSON")
    doctor.add_argument(  # tests: make one precision's check die of SIGILL
        "--fault-precision",
        action="append",
        default=[],
        choices=[p.value for p in Precision],
        help=argparse.SUPPRESS,
    )
    doctor.set_defaults(func=cmd_doctor)

    profile = sub.add_parser(
        "profile",
        help="measure every branch's fidelity against its model's reference",
        description="Measure each branch against its model's reference branch the way "
        "llama.cpp's `llama-perplexity --kl-divergence` does (KLD, top-1 agreement, PPL, "
        "delta-p), plus speed and footprint; write profile.json and profile.png beside "
        "each manifest. A remote branch (url) is measured from its server's top-k "
        "log-probabilities: its KLD is a lower bound (docs/quality.md).",
    )
    profile.add_argument(
        "repo",
        type=Path,
        nargs="?",
        default=DEMO_REPO,
        help="model repository or model folder (default: the demo)",
    )
    profile.add_argument("--model", default=None, help="only this model")
    profile.add_argument(
        "--text",
        type=Path,
        default=None,
        help="calibration text (default: the packaged Python text)",
    )
    profile.add_argument("--n-ctx", type=int, default=None, help="chunk length in tokens")
    profile.add_argument("--max-chunks", type=int, default=None, help="score at most N chunks")
    profile.add_argument("--threads", type=int, default=None, help="llama.cpp threads")
    profile.add_argument(
        "--top-k",
        type=int,
        default=20,
        help="log-probabilities to ask a remote branch (url) for per position (default 20)",
    )
    profile.set_defaults(func=cmd_profile)

    demo = sub.add_parser(
        "demo",
        help="the demo models",
        description="Build a demo model (needs the 'train' extra).",
    )
    demo_sub = demo.add_subparsers(dest="demo_command", required=True)
    build = demo_sub.add_parser(
        "build",
        help="train a demo model and write its branches",
        description="Train a demo model on the standard library's sources and write "
        "f16/q8_0/q4_k_m GGUF files and their manifest. tiny-llama (the default) is "
        "written into the package, with ONNX Runtime branches exported from its f16 "
        "file (onnx_fp16, onnx_int8, onnx_int4), and profiled; stdlib-bpe-llama (32k BPE "
        "vocabulary, 8 layers, GQA, ChatML; about 80 MB; GGUF branches only) into a cache "
        "keyed by its inputs, reused when present, and profiled. Prints the model "
        "repository to pass to `quantroute serve --repo`.",
    )
    build.add_argument(
        "--model",
        default="tiny-llama",
        choices=["tiny-llama", "stdlib-bpe-llama"],
        help="which demo model (default: tiny-llama)",
    )
    build.add_argument(
        "--out",
        type=Path,
        default=None,
        help="model folder to write (default: the package's for tiny-llama, the cache for "
        "stdlib-bpe-llama)",
    )
    build.add_argument("--steps", type=int, default=None, help="training steps (default: built-in)")
    build.add_argument("--seed", type=int, default=0, help="random seed")
    build.add_argument(
        "--seconds",
        type=float,
        default=None,
        help="stop training after this long (the result is then not reproducible)",
    )
    build.add_argument(
        "--cache",
        type=Path,
        default=None,
        help="cache root for stdlib-bpe-llama (default: ~/.cache/quantroute/demo)",
    )
    build.add_argument(
        "--rebuild", action="store_true", help="build stdlib-bpe-llama even if it is cached"
    )
    build.set_defaults(func=cmd_demo_build)
    add_repository_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code: int = args.func(args)
    except QuantrouteError as exc:
        print(f"quantroute: {exc.message}", file=sys.stderr)
        return 2
    return code


if __name__ == "__main__":
    raise SystemExit(main())
