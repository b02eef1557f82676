"""Model signatures in the OpenSSF model-signing format (the ``model-signing`` package).

A model folder is signed whole — its manifest and every file — into
``model.sig`` beside them (a Sigstore bundle). Two ways to sign and verify:

- an elliptic-curve key pair (PEM files), entirely offline::

      quantroute sign repo/tiny-llama --private-key signing.pem
      quantroute verify repo/tiny-llama --public-key signing.pub.pem

- Sigstore (keyless: an OIDC identity, the public transparency log), where
  configured: ``--sigstore`` to sign, ``repository.sigstore_identity`` and
  ``repository.sigstore_issuer`` to verify. It needs the network.

What is left out of the signature: the signature itself and ``profile.png``
(a picture nothing reads). ``profile.json`` decides quality routing, so it is
signed with the model when it is there at signing (profile, then sign); one
written after the signature is not named in it, and under
``repository.require_signatures`` it is ignored: the model routes as if
unprofiled (``api.catalog``, ``quality.profile``). Files not named in the
signature are not hashed on verifying (a new file only matters once the
signed manifest names it, and then the manifest changed). Verifying reads
each file through the scan's :class:`~quantroute.registry.digests.Digests`,
so the signature and the manifest's sha256s share one read of each file, and
tells the caller the digest of every file it verified (``signed``): what is
read afterwards (the manifest, the profile) must have those bytes.
``repository.require_signatures`` makes an unsigned or unverifiable
model a refused one; without it, a model with no ``model.sig`` is served
unsigned, but a signature that is there must verify.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from quantroute.errors import ArtifactIntegrityError
from quantroute.registry.digests import Digests

if TYPE_CHECKING:
    from model_signing import hashing

log = logging.getLogger(__name__)

SIGNATURE_NAME = "model.sig"
UNSIGNED_FILES = (SIGNATURE_NAME, "profile.png")


@dataclass(frozen=True, slots=True)
class TrustPolicy:
    """How signatures are checked: with ``public_key`` (EC, offline) or a Sigstore
    identity; ``required`` refuses models that are unsigned or can't be verified."""

    required: bool = False
    public_key: Path | None = None
    sigstore_identity: str | None = None
    sigstore_issuer: str | None = None

    @property
    def can_verify(self) -> bool:
        return self.public_key is not None or self.sigstore_identity is not None


def _hashing(digests: Digests | None = None, seen: dict[Path, str] | None = None) -> hashing.Config:
    """model-signing's default serialization (a sha256 per file), ignoring what is
    unsigned; with ``digests``, each file's sha256 is asked of it (read once a scan),
    and noted in ``seen`` (path -> sha256)."""
    from model_signing import hashing

    config = hashing.Config()  # type: ignore[no-untyped-call]
    config = config.set_ignored_paths(paths=list(UNSIGNED_FILES))
    if digests is not None:
        _read_through(config, digests, {} if seen is None else seen)
    return config


def _read_through(config: hashing.Config, digests: Digests, seen: dict[Path, str]) -> None:
    """Give ``config`` a file hasher that asks ``digests``: the same sha256 of the
    file's bytes that model-signing's default one computes (``"sha256"``, per file),
    so a signature made with the default verifies. model-signing (pinned, 1.1.1) has
    no public hook for a hasher: this sets its serializer, as
    ``use_file_serialization`` does."""
    from model_signing._hashing import hashing as digest
    from model_signing._hashing import io, memory
    from model_signing._serialization import file

    class Known(io.SimpleFileHasher):
        def compute(self) -> digest.Digest:
            hexdigest = digests.sha256(self._file)
            seen[Path(self._file)] = hexdigest
            return digest.Digest(self.digest_name, bytes.fromhex(hexdigest))

    config._serializer = file.Serializer(lambda path: Known(path, memory.SHA256()))


# model-signing's own error text (never client input): no nested quantifier, bounded
_HEX = re.compile(r"[0-9a-fA-F]{16,}")
_CHANGED = re.compile(r"Hash mismatch for '([^'\n]{1,200})'")


def _plain(reason: str, model_dir: Path) -> str:
    """model-signing's complaint, fit to show: which files differ, never a digest (its
    mismatch text prints every file's actual one) and no absolute path (the model
    folder becomes its name)."""
    if reason.startswith("Signature mismatch"):
        parts = []
        if changed := _CHANGED.findall(reason):
            parts.append("changed since signing: " + ", ".join(changed[:8]))
        if "Missing files" in reason:
            parts.append("files it names are missing")
        if "Extra files" in reason:
            parts.append("files it does not name are present")
        reason = "; ".join(parts) or "the files are not the signed ones"
    line = reason.splitlines()[0]
    for root in sorted({str(model_dir.resolve()), str(model_dir.absolute())}, key=len)[::-1]:
        line = line.replace(root, model_dir.name)
    return _HEX.sub("…", line)[:300]


def sign_model(
    model_dir: Path,
    *,
    private_key: Path | None = None,
    password: str | None = None,
    sigstore: bool = False,
) -> Path:
    """Sign ``model_dir`` into ``model_dir/model.sig`` with the EC ``private_key``, or
    with Sigstore (``sigstore=True``: interactive or ambient OIDC, network)."""
    from model_signing import signing

    if (private_key is None) == (not sigstore):
        raise ValueError("sign with exactly one of a private key or Sigstore")
    config = signing.Config().set_hashing_config(_hashing())  # type: ignore[no-untyped-call]
    if private_key is not None:
        config = config.use_elliptic_key_signer(private_key=private_key, password=password)
    else:
        config = config.use_sigstore_signer(use_ambient_credentials=True)
    target = model_dir / SIGNATURE_NAME
    tmp = model_dir / f".{SIGNATURE_NAME}.tmp"
    try:
        config.sign(model_dir, tmp)
    except ValueError as exc:  # a key model-signing can't read, say
        tmp.unlink(missing_ok=True)
        raise ArtifactIntegrityError(f"cannot sign {model_dir.name}: {exc}") from exc
    tmp.replace(target)  # readers never see half a signature
    return target


def verify_model(
    model_dir: Path,
    policy: TrustPolicy,
    digests: Digests | None = None,
    *,
    signed: dict[str, str] | None = None,
) -> str | None:
    """Check ``model_dir``'s signature under ``policy``: what verified it, in words, or
    ``None`` for an unsigned model that ``policy`` does not require to be signed.
    Raises :class:`ArtifactIntegrityError` for a signature that does not verify (a
    changed byte, another key), or a required one that is missing or can't be checked.
    ``signed`` is filled with the files it verified (path relative to ``model_dir`` ->
    the sha256 it verified)."""
    signature = model_dir / SIGNATURE_NAME
    if not signature.is_file():
        if policy.required:
            raise ArtifactIntegrityError(
                f"{model_dir.name}: no {SIGNATURE_NAME}, and the repository requires signatures"
            )
        return None
    if not policy.can_verify:
        if policy.required:
            raise ArtifactIntegrityError(
                f"{model_dir.name}: signatures are required but no key or Sigstore identity "
                "is configured (repository.public_key / repository.sigstore_identity)"
            )
        log.warning("%s: has %s but nothing to verify it with", model_dir.name, SIGNATURE_NAME)
        return None
    from model_signing import verifying

    config = verifying.Config()  # type: ignore[no-untyped-call]
    seen: dict[Path, str] = {}
    config = config.set_hashing_config(_hashing(digests or Digests(), seen))
    config = config.set_ignore_unsigned_files(True)
    if policy.public_key is not None:
        config = config.use_elliptic_key_verifier(public_key=policy.public_key)
        how = f"EC key {policy.public_key.name}"
    else:
        assert policy.sigstore_identity is not None
        config = config.use_sigstore_verifier(
            identity=policy.sigstore_identity, oidc_issuer=policy.sigstore_issuer or ""
        )
        how = f"Sigstore identity {policy.sigstore_identity}"
    try:
        config.verify(model_dir, signature)
    except Exception as exc:  # model-signing raises ValueError and its backends' own errors
        reason = _plain(str(exc), model_dir) if str(exc) else type(exc).__name__
        raise ArtifactIntegrityError(
            f"{model_dir.name}: the signature does not verify ({reason})"
        ) from exc
    if signed is not None:
        root = model_dir.resolve()
        for path, hexdigest in seen.items():
            resolved = path.resolve()
            if resolved.is_relative_to(root):
                signed[resolved.relative_to(root).as_posix()] = hexdigest
    return f"verified by {how}"
