"""Put a model into quantroute's model repository: download one GGUF file, hash it while
it streams, and write the model's manifest from a template with that sha256.

Run by jobs/fetch-model.yaml in the quantroute image (the standard library alone),
with the volume mounted read-write. Everything lands under a temporary name and is
renamed into place, the manifest last: a gateway watching the volume sees a complete
model or none (its watcher ignores ``*.part`` files).

Environment:
  MODEL_URL          where the GGUF is (https://, or file:// for a copy at hand)
  MODEL_DIR          the model's folder in the repository (/models/<model>)
  MODEL_FILE         the file's name there (the manifest's ``file:``)
  MANIFEST_TEMPLATE  the manifest with ${F16_SHA256} where the digest goes
  MODEL_SHA256       optional: the digest the download must have (a pinned file)
"""

from __future__ import annotations

import hashlib
import os
import sys
import urllib.request
from pathlib import Path

CHUNK = 1 << 20
PLACEHOLDER = "${F16_SHA256}"


def download(url: str, part: Path) -> str:
    """``url`` written to ``part``; its sha256."""
    digest = hashlib.sha256()
    with urllib.request.urlopen(url, timeout=60) as response, part.open("wb") as out:
        while chunk := response.read(CHUNK):
            digest.update(chunk)
            out.write(chunk)
        out.flush()
        os.fsync(out.fileno())
    return digest.hexdigest()


def write_manifest(template: Path, folder: Path, sha256: str) -> Path:
    text = template.read_text()
    if PLACEHOLDER not in text:
        raise SystemExit(f"{template}: no {PLACEHOLDER} to fill")
    target = folder / "quantroute.yaml"
    part = folder / "quantroute.yaml.part"
    part.write_text(text.replace(PLACEHOLDER, sha256))
    part.replace(target)
    return target


def main() -> int:
    url = os.environ["MODEL_URL"]
    folder = Path(os.environ["MODEL_DIR"])
    name = os.environ["MODEL_FILE"]
    folder.mkdir(parents=True, exist_ok=True)
    part = folder / f"{name}.part"
    print(f"downloading {url} to {folder / name}", flush=True)
    sha256 = download(url, part)
    pinned = os.environ.get("MODEL_SHA256", "").strip().lower()
    if pinned and pinned != sha256:
        part.unlink()
        print(f"{name}: sha256 {sha256}, expected {pinned}; not kept", file=sys.stderr)
        return 1
    part.replace(folder / name)
    manifest = write_manifest(Path(os.environ["MANIFEST_TEMPLATE"]), folder, sha256)
    print(f"{name}: sha256 {sha256}; wrote {manifest}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
