"""Model signatures (OpenSSF model-signing format), offline with EC keys: a signed folder
verifies; one changed byte, another key or a missing required signature does not."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from qrtest import demo_model_dir, ec_keys
from quantroute.cli import main
from quantroute.errors import ArtifactIntegrityError, ManifestError
from quantroute.registry import scan_repository
from quantroute.registry.signing import SIGNATURE_NAME, TrustPolicy, sign_model, verify_model


@pytest.fixture
def model(tmp_path: Path) -> Path:
    target = tmp_path / "repo" / "tiny-llama"
    shutil.copytree(demo_model_dir(), target)
    return target


def test_sign_then_verify_and_catch_one_changed_byte(model: Path, tmp_path: Path) -> None:
    private, public = ec_keys(tmp_path, "k")
    (model / "profile.json").unlink()
    assert sign_model(model, private_key=private) == model / SIGNATURE_NAME
    policy = TrustPolicy(required=True, public_key=public)
    assert verify_model(model, policy) == "verified by EC key k.pub.pem"
    # a profile.json written after signing is not named in the signature: not checked
    # (and, where signatures are required, not used: test_sec_bytes_verified.py)
    (model / "profile.json").write_text("{}")
    assert verify_model(model, policy) is not None
    with (model / "q4_k_m.gguf").open("r+b") as fh:
        fh.seek(1000)
        byte = fh.read(1)
        fh.seek(1000)
        fh.write(bytes([byte[0] ^ 1]))
    with pytest.raises(ArtifactIntegrityError, match="signature does not verify"):
        verify_model(model, policy)


def test_another_key_and_a_missing_signature(model: Path, tmp_path: Path) -> None:
    private, _ = ec_keys(tmp_path, "a")
    _, other = ec_keys(tmp_path, "b")
    assert verify_model(model, TrustPolicy()) is None  # unsigned, not required: served
    with pytest.raises(ArtifactIntegrityError, match="requires signatures"):
        verify_model(model, TrustPolicy(required=True, public_key=other))
    sign_model(model, private_key=private)
    with pytest.raises(ArtifactIntegrityError, match="does not verify"):
        verify_model(model, TrustPolicy(public_key=other))  # present: must verify
    with pytest.raises(ArtifactIntegrityError, match="no key or Sigstore identity"):
        verify_model(model, TrustPolicy(required=True))


def test_a_repository_that_requires_signatures_leaves_out_unsigned_models(
    model: Path, tmp_path: Path
) -> None:
    private, public = ec_keys(tmp_path, "k")
    unsigned = model.parent / "other"
    shutil.copytree(model, unsigned)
    manifest = unsigned / "quantroute.yaml"
    manifest.write_text(manifest.read_text().replace("model: tiny-llama", "model: other"))
    sign_model(model, private_key=private)
    scan = scan_repository(model.parent, TrustPolicy(required=True, public_key=public))
    assert [m.manifest.model for m in scan.models] == ["tiny-llama"]
    assert scan.models[0].signature == "verified by EC key k.pub.pem"
    assert scan.failed == (unsigned,) and "requires signatures" in scan.problems[0]
    assert issubclass(ArtifactIntegrityError, ManifestError)


def test_the_sign_and_verify_commands(
    model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    private, public = ec_keys(tmp_path, "k")
    assert main(["sign", str(model), "--private-key", str(private)]) == 0
    assert main(["verify", str(model), "--public-key", str(public)]) == 0
    assert "verified by EC key" in capsys.readouterr().out
    assert main(["validate", str(model), "--public-key", str(public)]) == 0
    assert "verified by EC key" in capsys.readouterr().out
    (model / "q8_0.gguf").write_bytes(b"GGUF")
    assert main(["verify", str(model), "--public-key", str(public)]) == 2
    assert "does not verify" in capsys.readouterr().err
    assert main(["verify", str(model)]) == 2  # no key given: never a silent pass
