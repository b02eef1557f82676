"""The environment a child process of the gateway may see: worker processes (llama.cpp)
and the chat templates' render processes alike. An allowlist, never the gateway's own
environment: the admin key, the metrics key and a cloud's credentials stay in the
gateway."""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["worker_env"]

# What of the gateway's environment a worker gets: the names, and the prefixes (locale,
# the libraries llama.cpp and CUDA read, Python's own, coverage of tests' subprocesses).
# Anything else — QUANTROUTE_SERVER__ADMIN_KEY, cloud credentials — stays in the gateway.
_ENV_NAMES = frozenset(
    {
        "PATH",
        "HOME",
        "USER",
        "LOGNAME",
        "LANG",
        "LANGUAGE",
        "TZ",
        "TMPDIR",
        "LD_LIBRARY_PATH",
        "PYTHONPATH",
        "PYTHONHOME",
        "PYTHONHASHSEED",
        "PYTHONDONTWRITEBYTECODE",
        "PYTHONUNBUFFERED",
        "PYTHONFAULTHANDLER",
        "PYTHONWARNINGS",
        "VIRTUAL_ENV",
        "COVERAGE_PROCESS_START",
        "COVERAGE_RCFILE",
    }
)
_ENV_PREFIXES = ("LC_", "CUDA_", "NVIDIA_", "GGML_", "OMP_", "KMP_", "GOMP_", "OPENBLAS_", "MKL_")
_ENV_SECRET_WORDS = ("KEY", "TOKEN", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL", "AUTH")


def worker_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The part of ``environ`` a worker may see: allowlisted names and prefixes, and of
    those none whose name speaks of a secret (``GGML_API_KEY``, say).

    >>> worker_env({"PATH": "/bin", "QUANTROUTE_SERVER__ADMIN_KEY": "k", "LC_ALL": "C"})
    {'PATH': '/bin', 'LC_ALL': 'C'}
    """
    return {
        k: v
        for k, v in environ.items()
        if (k in _ENV_NAMES or k.startswith(_ENV_PREFIXES))
        and not any(word in k.upper() for word in _ENV_SECRET_WORDS)
    }
