"""The root of the settings tree, and how it is read: the only module that reads
environment variables.

Precedence, highest first: command-line flags, environment variables
(``QUANTROUTE_SERVER__PORT=8001``, nested with ``__``), a YAML config file
(``--config FILE`` or ``QUANTROUTE_CONFIG``), then the defaults the sections give.
Every field has a default and a description; the CLI's flags are generated
from this tree (``quantroute serve --help`` lists them).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, ValidationError
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
)

from quantroute.config.cluster import ClusterSettings
from quantroute.config.engine import EngineSettings
from quantroute.config.observability import ObservabilitySettings
from quantroute.config.quality import DriftSettings
from quantroute.config.registry import RepositorySettings
from quantroute.config.resilience import AdmissionSettings, ResilienceSettings, StreamSettings
from quantroute.config.routing import RoutingSettings
from quantroute.config.server import AuthSettings, LimitSettings, ServerSettings
from quantroute.config.telemetry import TelemetrySettings
from quantroute.errors import ConfigError

DEMO_REPO = Path(__file__).resolve().parents[1] / "demo" / "repo"
ENV_PREFIX = "QUANTROUTE_"


class Settings(BaseSettings):
    """Everything quantroute can be told. See docs/configuration.md."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, env_nested_delimiter="__", extra="forbid"
    )

    repo: Path = Field(DEMO_REPO, description="Model repository: one folder per model.")
    server: ServerSettings = Field(default_factory=ServerSettings)  # type: ignore[arg-type]
    limits: LimitSettings = Field(default_factory=LimitSettings)  # type: ignore[arg-type]
    engine: EngineSettings = Field(default_factory=EngineSettings)  # type: ignore[arg-type]
    telemetry: TelemetrySettings = Field(default_factory=TelemetrySettings)  # type: ignore[arg-type]
    drift: DriftSettings = Field(default_factory=DriftSettings)  # type: ignore[arg-type]
    resilience: ResilienceSettings = Field(default_factory=ResilienceSettings)  # type: ignore[arg-type]
    auth: AuthSettings = Field(default_factory=AuthSettings)  # type: ignore[arg-type]
    admission: AdmissionSettings = Field(default_factory=AdmissionSettings)  # type: ignore[arg-type]
    routing: RoutingSettings = Field(default_factory=RoutingSettings)
    streams: StreamSettings = Field(default_factory=StreamSettings)  # type: ignore[arg-type]
    observability: ObservabilitySettings = Field(default_factory=ObservabilitySettings)  # type: ignore[arg-type]
    repository: RepositorySettings = Field(default_factory=RepositorySettings)  # type: ignore[arg-type]
    cluster: ClusterSettings = Field(default_factory=ClusterSettings)  # type: ignore[arg-type]

    def secret(self, name: str) -> str | None:
        """The environment variable ``name``, read where every variable is read: a
        remote branch's key, which its manifest names (``api_key_env``), never holds.
        Read when the branch's engine is built; never logged; ``None`` when unset."""
        return os.environ.get(name) or None


def load_settings(config_file: Path | None = None, **overrides: Any) -> Settings:
    """Build the settings from flags (``overrides``), environment, file and defaults.

    >>> load_settings(server={"port": 9000}).server.port
    9000
    """
    path = config_file or os.environ.get(f"{ENV_PREFIX}CONFIG")
    read = _reading(environment=True, yaml_file=Path(path) if path else None)

    if path and not Path(path).is_file():
        raise ConfigError(f"config file not found: {path}")
    _check_environment(os.environ)
    try:
        return read(**overrides)
    except ValidationError as exc:
        raise _config_error(exc) from exc
    except ValueError as exc:  # pydantic-settings' SettingsError: a variable it can't decode
        raise ConfigError(f"settings: {exc}".split("\n", 1)[0]) from exc


def default_settings() -> Settings:
    """What a fresh server has: the defaults alone, no environment and no file (the
    defaults ``--help`` and docs/configuration.md show)."""
    return _reading(environment=False, yaml_file=None)()  # type: ignore[call-arg]  # every field has its default


def _reading(*, environment: bool, yaml_file: Path | None) -> type[Settings]:
    """:class:`Settings` reading, after its arguments, the environment (or not) and a
    YAML file (or none)."""

    class _Read(Settings):
        @classmethod
        def settings_customise_sources(
            cls,
            settings_cls: type[BaseSettings],
            init_settings: PydanticBaseSettingsSource,
            env_settings: PydanticBaseSettingsSource,
            dotenv_settings: PydanticBaseSettingsSource,
            file_secret_settings: PydanticBaseSettingsSource,
        ) -> tuple[PydanticBaseSettingsSource, ...]:
            sources = [init_settings, env_settings] if environment else [init_settings]
            if yaml_file is not None:
                sources.append(YamlConfigSettingsSource(settings_cls, yaml_file=yaml_file))
            return tuple(sources)

    return _Read


def _config_error(exc: ValidationError) -> ConfigError:
    """A settings error in one line: the setting (and its variable), what is wrong, and
    what it accepts (a section's names for an unknown key)."""
    first = exc.errors()[0]
    loc = [str(p) for p in first["loc"]]
    where = ".".join(loc)
    variable = ENV_PREFIX + "__".join(loc).upper()
    message = str(first["msg"]).removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        section: Any = Settings
        for part in loc[:-1]:
            fields = getattr(section, "model_fields", {})
            section = fields[part].annotation if part in fields else None
        if isinstance(section, type) and issubclass(section, BaseModel):
            names = ", ".join(sorted(section.model_fields))
            message = f"no such setting; accepted: {names}"
    return ConfigError(f"setting {where} ({variable} or the config file): {message}", param=where)


def _check_environment(environ: Mapping[str, str]) -> None:
    """A ``QUANTROUTE_`` variable that starts like a setting but names none is an error:
    ``QUANTROUTE_ENGINE_PARALLEL`` (one ``_`` where ``__`` joins the names) or
    ``QUANTROUTE_REPOO`` would otherwise be ignored without a word. A name inside a
    section (``QUANTROUTE_ENGINE__BOGUS``) is the settings' own check; one that starts like
    no setting (the build's ``QUANTROUTE_LLAMA_BACKEND``) is another tool's."""
    roots = set(Settings.model_fields)
    for name in sorted(environ):
        rest = name[len(ENV_PREFIX) :].lower() if name.startswith(ENV_PREFIX) else None
        if rest is None or rest == "config" or rest.split("__", 1)[0] in roots:
            continue
        root = next((r for r in sorted(roots, key=len, reverse=True) if rest.startswith(r)), None)
        if root is not None:
            tail = rest[len(root) :].lstrip("_")
            kind = Settings.model_fields[root].annotation
            section = isinstance(kind, type) and issubclass(kind, BaseModel)
            meant = f"{ENV_PREFIX}{root.upper()}__{tail.upper()}"
            hint = f" (nested names are joined with __: {meant}?)" if section and tail else ""
            raise ConfigError(f"unknown setting in the environment: {name}{hint}", param=name)


OTEL_PREFIX = "OTEL_"


def otel_environment(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The standard OpenTelemetry variables (``OTEL_*``) as set, for
    :mod:`quantroute.observability.otel` to resolve against ``observability.*``: the one
    other place the environment speaks to quantroute, read here like every setting."""
    source = os.environ if environ is None else environ
    return {k: v for k, v in source.items() if k.startswith(OTEL_PREFIX)}
