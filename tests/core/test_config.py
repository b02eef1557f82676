from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from quantroute.cli import _overrides, build_parser
from quantroute.config import DEMO_REPO, load_settings
from quantroute.errors import ConfigError


def test_defaults_serve_the_packaged_demo_on_loopback() -> None:
    s = load_settings()
    assert s.repo == DEMO_REPO
    assert (s.server.host, s.server.port) == ("127.0.0.1", 8000)


def test_precedence_flags_over_env_over_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = tmp_path / "qr.yaml"
    cfg.write_text("server:\n  port: 7001\n  keepalive_s: 3\nengine:\n  parallel: 2\n")
    assert load_settings(cfg).server.port == 7001
    monkeypatch.setenv("QUANTROUTE_SERVER__PORT", "7002")
    s = load_settings(cfg)
    assert (s.server.port, s.server.keepalive_s, s.engine.parallel) == (7002, 3.0, 2)
    assert load_settings(cfg, server={"port": "7003"}).server.port == 7003


def test_config_file_from_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tmp_path / "qr.yaml"
    cfg.write_text("limits:\n  max_n: 2\n")
    monkeypatch.setenv("QUANTROUTE_CONFIG", str(cfg))
    assert load_settings().limits.max_n == 2


def test_missing_config_file_and_bad_values_are_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        load_settings(tmp_path / "absent.yaml")
    with pytest.raises(ConfigError, match=r"server\.port"):
        load_settings(server={"port": 70000})
    with pytest.raises(ConfigError, match="nonsense"):
        load_settings(nonsense=1)
    with pytest.raises(ConfigError, match="unknown device provider"):
        load_settings(telemetry={"devices": "bogus"})


def test_cli_flags_come_from_the_settings_tree() -> None:
    args = build_parser().parse_args(
        ["serve", "--port", "9001", "--engine-parallel", "8", "--repo", "/models"]
    )
    tree = _overrides(args)
    assert tree == {"server": {"port": "9001"}, "engine": {"parallel": "8"}, "repo": "/models"}
    s = load_settings(None, **tree)
    assert (s.server.port, s.engine.parallel, s.repo) == (9001, 8, Path("/models"))


def test_a_dict_or_list_flag_takes_json_and_null_unsets(capsys: pytest.CaptureFixture[str]) -> None:
    """As their environment variables do: ``--engine-faults '{"f16": ...}'`` was a string
    pydantic refused ("Input should be a valid dictionary")."""
    argv = ["serve", "--engine-faults", '{"f16": "oom-at-decode"}', "--telemetry-cpu-affinity",
            "[[0], [1]]", "--routing-tiers-high-min-top1", "null"]  # fmt: skip
    s = load_settings(None, **_overrides(build_parser().parse_args(argv)))
    assert s.engine.faults == {"f16": "oom-at-decode"}
    assert s.telemetry.cpu_affinity == [[0], [1]]
    assert s.routing.tiers.high.min_top1 is None and s.routing.tiers.high.max_kld == 0.001
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--engine-faults", "{f16: oom}"])
    assert "not JSON" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    assert "(default: 0.001)" in capsys.readouterr().out  # the tier's own, not the field's


def test_an_environment_variable_that_starts_like_a_setting_must_name_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One ``_`` where ``__`` joins names, or a misspelt name, was ignored without a word."""
    for name, hint in (
        ("QUANTROUTE_ENGINE_PARALLEL", "QUANTROUTE_ENGINE__PARALLEL?"),
        ("QUANTROUTE_SERVERPORT", "QUANTROUTE_SERVER__PORT?"),
        ("QUANTROUTE_REPOO", ""),
    ):
        with monkeypatch.context() as m:
            m.setenv(name, "8")
            with pytest.raises(ConfigError, match=name) as info:
                load_settings()
            assert hint in str(info.value) and "8" not in str(info.value).replace(name, "")
    # another tool's variable (the build's), and a real setting, pass
    monkeypatch.setenv("QUANTROUTE_LLAMA_BACKEND", "cpu")
    monkeypatch.setenv("QUANTROUTE_ENGINE__PARALLEL", "3")
    assert load_settings().engine.parallel == 3


def test_every_subcommand_has_help(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--help"], ["serve", "--help"], ["demo", "--help"], ["demo", "build", "--help"]):
        with pytest.raises(SystemExit) as info:
            build_parser().parse_args(argv)
        assert info.value.code == 0
        assert "usage: quantroute" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("workers", "cores", "threads"), [(3, 2, 1), (1, 2, 1), (1, 16, 15), (3, 16, 5), (0, 4, 3)]
)
def test_default_threads_split_the_cores(workers: int, cores: int, threads: int) -> None:
    from quantroute.api.catalog import default_threads

    assert default_threads(workers, cores) == threads


def test_every_settings_section_refuses_a_misspelled_key() -> None:
    """A typo must not leave a safety setting at its default (require_signature → off)."""
    from quantroute.config import Settings

    sections = [
        name
        for name, field in Settings.model_fields.items()
        if isinstance(field.annotation, type) and hasattr(field.annotation, "model_fields")
    ]
    assert "repository" in sections and "server" in sections
    for name in sections:
        with pytest.raises(ConfigError):
            load_settings(**{name: {"no_such_setting_xyz": True}})


@pytest.mark.parametrize(
    ("variable", "value", "says"),
    [
        ("QUANTROUTE_SERVER__GRPC_PROT", "1", "no such setting; accepted: admin_key, allowed_"),
        ("QUANTROUTE_SERVER__PORT", "abc", "valid integer"),
        ("QUANTROUTE_SERVER__LOG_LEVEL", "loud", "'debug', 'info', 'warning' or 'error'"),
        ("QUANTROUTE_TELEMETRY__CPU_AFFINITY", "[[", "telemetry.cpu_affinity"),
    ],
)
def test_a_bad_setting_stops_serve_with_one_line_naming_it(
    variable: str, value: str, says: str, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """Not a pydantic traceback: ``quantroute serve`` prints one line naming the setting,
    its variable and what it accepts, and exits 2 before anything starts."""
    from quantroute.cli import main

    monkeypatch.setenv(variable, value)
    assert main(["serve"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err
    assert err.startswith("quantroute: ")
    assert variable in err or "telemetry.cpu_affinity" in err
    assert says in err


def test_a_wrong_type_in_the_config_file_is_one_line(tmp_path: Path, capsys: Any) -> None:
    from quantroute.cli import main

    bad = tmp_path / "bad.yaml"
    bad.write_text("server:\n  port: eighty\n")
    assert main(["serve", "--config", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("quantroute: setting server.port (") and "\n" not in err
    assert "valid integer" in err
