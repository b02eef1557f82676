"""External programs some tests need (Debian's ``chromium``, ``promtool``).

Missing, such a test skips with the reason, except in CI (``QUANTROUTE_CI=1``,
set by ``.ci/run``, which installs them): there it fails.
"""

from __future__ import annotations

import os
import shutil

import pytest


def need_tool(name: str, package: str) -> str:
    """The path of program ``name``; skip (fail in CI) when it is not installed."""
    path = shutil.which(name)
    if path is not None:
        return path
    why = f"{name} is not installed (Debian package {package!r}; .ci/run installs it)"
    if os.environ.get("QUANTROUTE_CI") == "1":
        pytest.fail(why)
    pytest.skip(why)
