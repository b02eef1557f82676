"""Issue #32, section 2, on files alone (no worker): what a worker is handed is the
verified bytes (``registry.verified``); a link out of the model folder fails its branch;
failure texts carry no digest of a file and no absolute path; under
``require_signatures`` an unsigned ``profile.json`` is ignored, and a manifest swapped
between its read and its signature check is refused."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import time
from pathlib import Path

import pytest

from hostile import rewrite_in_place
from qrtest import demo_model_dir, ec_keys
from quantroute.errors import ArtifactIntegrityError, ManifestError
from quantroute.quality.profile import Trust, load_profiles
from quantroute.registry import digests as digests_module
from quantroute.registry import load_manifest, scan_repository
from quantroute.registry.manifest import check_artifacts
from quantroute.registry.repository import scan_model
from quantroute.registry.signing import TrustPolicy, sign_model, verify_model
from quantroute.registry.verified import VerifiedFile


@pytest.fixture
def model(tmp_path: Path) -> Path:
    target = tmp_path / "repo" / "tiny-llama"
    shutil.copytree(demo_model_dir(), target)
    return target


def verified(model: Path, branch: str = "q4_k_m") -> VerifiedFile:
    (artifact,) = [a for a in check_artifacts(model, load_manifest(model)) if a.name == branch]
    found = artifact.verified()
    assert found is not None
    return found


def settle(monkeypatch: pytest.MonkeyPatch) -> None:
    """Files copied a moment ago count as still (no racy re-read): identity alone decides."""
    monkeypatch.setattr(digests_module, "RACY_S", 0.0)


def test_an_unchanged_settled_file_opens_without_being_read_again(
    model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settle(monkeypatch)
    file = verified(model)
    assert file.settled and file.label == "q4_k_m.gguf"
    read = []
    monkeypatch.setattr("quantroute.registry.verified.sha256_fd", lambda fd: read.append(fd) or "x")
    fd, now = file.open()
    try:
        assert now.identity == file.identity and now.links == 1 and read == []
        assert os.readlink(f"/proc/self/fd/{fd}") == str(file.path)
        assert file.moved(fd) is None
    finally:
        os.close(fd)


def test_an_in_place_rewrite_with_its_old_mtime_is_refused(
    model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settle(monkeypatch)
    file = verified(model)
    rewrite_in_place(file.path, (model / "q8_0.gguf").read_bytes())
    assert file.path.stat().st_mtime_ns == file.identity[3]  # the mtime says nothing
    with pytest.raises(ArtifactIntegrityError, match="changed on disk since it was verified"):
        file.open()


def test_the_same_size_in_place_rewrite_within_the_racy_window_is_read_again(
    model: Path,
) -> None:
    """Freshly copied (unsettled): even identical timestamps and size do not vouch."""
    file = verified(model)
    assert not file.settled
    data = bytearray(file.path.read_bytes())
    data[-1] ^= 0xFF
    st = file.path.stat()
    with file.path.open("r+b") as fh:
        fh.write(data)
    os.utime(file.path, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(ArtifactIntegrityError, match="no longer matches the manifest"):
        file.open()


def test_a_rename_over_it_with_other_bytes_is_refused_and_with_the_same_bytes_accepted(
    model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settle(monkeypatch)
    file = verified(model)
    original = file.path.read_bytes()
    (model / "x.tmp").write_bytes((model / "f16.gguf").read_bytes())
    (model / "x.tmp").replace(file.path)
    with pytest.raises(ArtifactIntegrityError, match="changed on disk"):
        file.open()
    (model / "x.tmp").write_bytes(original)
    (model / "x.tmp").replace(file.path)  # the verified bytes under a new inode
    fd, now = file.open()
    os.close(fd)
    assert now.identity != file.identity and now.sha256 == file.sha256


@pytest.mark.parametrize("swap", ["fifo", "device"])
def test_a_name_swapped_for_a_fifo_or_a_device_is_refused_at_once(
    model: Path, swap: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: opening a FIFO blocked the opening thread for ever (a writer never came),
    and a link to ``/dev/zero`` was hashed for ever; a few such spawns took every thread
    of the default pool, and the scans and placements with them."""
    settle(monkeypatch)
    file = verified(model)
    file.path.unlink()
    if swap == "fifo":
        os.mkfifo(file.path)
    else:
        file.path.symlink_to("/dev/zero")
    start = time.monotonic()
    with pytest.raises(ArtifactIntegrityError, match="cannot be opened"):
        file.open()
    artifacts = check_artifacts(model, load_manifest(model), follow_links=True)
    (refused,) = [a for a in artifacts if a.name == "q4_k_m"]
    assert refused.problem is not None and refused.verified() is None  # the scan's too
    assert time.monotonic() - start < 5


def test_a_file_of_another_size_is_refused_without_being_read(
    model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    file = verified(model)  # racy (just copied): an equal identity would be read again
    read: list[int] = []
    monkeypatch.setattr("quantroute.registry.verified.sha256_fd", lambda fd: read.append(fd) or "x")
    with file.path.open("ab") as f:
        f.write(b"\0")
    with pytest.raises(ArtifactIntegrityError, match="verified size"):
        file.open()
    assert read == []


def test_a_file_swapped_while_its_header_is_checked_fails_its_branch(
    model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The header check reads the path after the hash did: a swap in between (hostile
    bytes hashed, harmless ones checked, the hostile ones back for the worker) would pass
    a file whose header was never checked. The file must still be the hashed one."""
    from quantroute.registry import manifest as manifest_module

    real = manifest_module._check_in_process

    def swapping(path: Path) -> str | None:
        found = real(path)
        if path.name == "q4_k_m.gguf":  # the same bytes, written again: another ctime
            rewrite_in_place(path, path.read_bytes())
        return found

    monkeypatch.setattr(manifest_module, "_check_in_process", swapping)
    artifacts = {a.name: a for a in check_artifacts(model, load_manifest(model))}
    assert artifacts["q4_k_m"].problem == (
        "tiny-llama:q4_k_m: q4_k_m.gguf: changed while it was being checked"
    )
    assert artifacts["f16"].problem is None and artifacts["q4_k_m"].verified() is None


def test_a_descriptor_open_for_a_worker_sees_an_in_place_rewrite(
    model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settle(monkeypatch)
    file = verified(model)
    fd, now = file.open()
    try:
        rewrite_in_place(file.path, b"X" + file.path.read_bytes()[1:])  # same size, mtime
        why = now.moved(fd)
        assert why is not None and "changed on disk after it was verified" in why
    finally:
        os.close(fd)
    file = verified(model, "q8_0")
    fd, now = file.open()
    try:  # a rename over its name unlinks it (its ctime moves): its bytes did not
        (model / "x.tmp").write_bytes(b"GGUF")
        (model / "x.tmp").replace(file.path)
        assert now.moved(fd) is None
    finally:
        os.close(fd)


def test_a_link_added_beside_an_in_place_rewrite_does_not_hide_it(
    model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``ln`` moves the link count as a rename over the name does, but the file can still
    be written: a rewrite with its old mtime and a link added is still a rewrite."""
    settle(monkeypatch)
    file = verified(model)
    fd, now = file.open()
    try:
        rewrite_in_place(file.path, b"X" + file.path.read_bytes()[1:])
        os.link(file.path, model / "another-name.gguf")
        why = now.moved(fd)
        assert why is not None and "changed on disk after it was verified" in why
    finally:
        os.close(fd)


def test_a_link_out_of_the_model_folder_fails_its_branch_unless_allowed(
    model: Path, tmp_path: Path
) -> None:
    outside = tmp_path / "elsewhere.gguf"
    shutil.copyfile(model / "q4_k_m.gguf", outside)
    (model / "q4_k_m.gguf").unlink()
    (model / "q4_k_m.gguf").symlink_to(outside)
    (model / "inside.gguf").symlink_to(model / "q8_0.gguf")  # a link that stays in: fine
    manifest_path = model / "quantroute.yaml"
    manifest_path.write_text(manifest_path.read_text().replace("q8_0.gguf", "inside.gguf"))
    manifest = load_manifest(model)
    by_name = {a.name: a for a in check_artifacts(model, manifest)}
    problem = by_name["q4_k_m"].problem
    assert problem is not None and "leads out of the model folder" in problem
    assert str(tmp_path) not in problem
    assert by_name["q8_0"].problem is None
    allowed = {a.name: a for a in check_artifacts(model, manifest, follow_links=True)}
    assert allowed["q4_k_m"].problem is None
    scan = scan_repository(model.parent, isolated=False)
    (entry,) = scan.models
    assert next(a for a in entry.artifacts if a.name == "q4_k_m").problem == problem


def test_a_mismatch_names_no_digest_of_the_file_and_no_absolute_path(
    model: Path, tmp_path: Path
) -> None:
    """A branch pointed (by a link, with follow_links) at any readable file must not tell
    its digest: not in the problem, not in the artifact's sha256."""
    secret = tmp_path / "secret.txt"
    secret.write_text("the operator's secret\n")
    actual = hashlib.sha256(secret.read_bytes()).hexdigest()
    (model / "q4_k_m.gguf").unlink()
    (model / "q4_k_m.gguf").symlink_to(secret)
    manifest = load_manifest(model)
    (a,) = [a for a in check_artifacts(model, manifest, follow_links=True) if a.name == "q4_k_m"]
    assert a.problem == "tiny-llama:q4_k_m: q4_k_m.gguf does not match the manifest's sha256"
    assert a.sha256 == manifest.branches["q4_k_m"].sha256 and a.size_bytes == 0
    for i in range(len(actual) - 5):
        assert actual[i : i + 6] not in a.problem
    assert a.verified() is None


def test_manifest_errors_name_the_file_relative_to_the_repository(model: Path) -> None:
    (model / "quantroute.yaml").write_text("model: [unclosed\n")
    with pytest.raises(ManifestError) as caught:
        load_manifest(model)
    assert caught.value.message == "tiny-llama/quantroute.yaml is not valid YAML"
    (model / "quantroute.yaml").unlink()
    with pytest.raises(ManifestError) as caught:
        load_manifest(model)
    assert str(model.parent) not in caught.value.message
    assert caught.value.message.startswith("cannot read tiny-llama/quantroute.yaml")


def test_a_signature_mismatch_shows_no_digest(model: Path, tmp_path: Path) -> None:
    private, public = ec_keys(tmp_path, "k")
    sign_model(model, private_key=private)
    with (model / "q8_0.gguf").open("r+b") as fh:
        fh.seek(100)
        fh.write(b"\x00\x01\x02")
    with pytest.raises(ArtifactIntegrityError) as caught:
        verify_model(model, TrustPolicy(required=True, public_key=public))
    message = caught.value.message
    assert "does not verify" in message
    assert not re.search(r"[0-9a-f]{16}", message), message
    assert str(tmp_path) not in message


def test_profile_json_is_signed_with_the_model(model: Path, tmp_path: Path) -> None:
    private, public = ec_keys(tmp_path, "k")
    policy = TrustPolicy(required=True, public_key=public)
    sign_model(model, private_key=private)  # profile.json is there: it is signed
    entry = scan_model(model, policy, isolated=False)
    assert "profile.json" in entry.signed
    assert (
        entry.signed["profile.json"]
        == hashlib.sha256((model / "profile.json").read_bytes()).hexdigest()
    )
    profiles, _ = load_profiles(model, entry.artifacts, Trust(True, entry.signed["profile.json"]))
    assert all(p is not None for p in profiles.values())
    # a signed profile.json changed afterwards: the signature no longer verifies
    doc = (model / "profile.json").read_text()
    (model / "profile.json").write_text(doc.replace('"top1": 0.', '"top1": 0.9', 1))
    with pytest.raises(ArtifactIntegrityError, match="does not verify"):
        scan_model(model, policy, isolated=False)


def test_an_unsigned_profile_is_ignored_where_signatures_are_required(
    model: Path, tmp_path: Path
) -> None:
    """Written after signing (not named in the signature): under require_signatures the
    model routes as if unprofiled; without it, the profile counts."""
    private, public = ec_keys(tmp_path, "k")
    profile = (model / "profile.json").read_bytes()
    (model / "profile.json").unlink()
    sign_model(model, private_key=private)
    (model / "profile.json").write_bytes(profile)
    entry = scan_model(model, TrustPolicy(required=True, public_key=public), isolated=False)
    assert "profile.json" not in entry.signed and "quantroute.yaml" in entry.signed
    profiles, warnings = load_profiles(model, entry.artifacts, Trust(True, None))
    assert set(profiles.values()) == {None}
    assert "profile.json is ignored" in warnings[0] and "not cover" in warnings[0]
    open_profiles, _ = load_profiles(model, entry.artifacts, Trust(False, None))
    assert all(p is not None for p in open_profiles.values())
    # signed, then swapped after the signature was checked: not the verified bytes
    swapped, warnings = load_profiles(model, entry.artifacts, Trust(True, "0" * 64))
    assert set(swapped.values()) == {None} and "changed after" in warnings[0]


def test_a_manifest_swapped_between_its_read_and_its_signature_check_is_refused(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from quantroute.registry import repository

    private, public = ec_keys(tmp_path, "k")
    sign_model(model, private_key=private)
    signed = (model / "quantroute.yaml").read_bytes()
    evil = signed.replace(b"description:", b"description: evil", 1)
    verify = repository.verify_model

    def swap_back(*args: object, **kwargs: object) -> str | None:
        (model / "quantroute.yaml").write_bytes(signed)  # the signed one, for the check
        return verify(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(repository, "verify_model", swap_back)
    (model / "quantroute.yaml").write_bytes(evil)  # what the scan parses
    time.sleep(0.01)
    with pytest.raises(ArtifactIntegrityError, match="changed while it was being verified"):
        scan_model(model, TrustPolicy(required=True, public_key=public), isolated=False)


@pytest.mark.parametrize(
    "data",
    [
        b"model: 2001-02-30\n",  # a YAML timestamp that is no date: ValueError
        b"model: x\nreference: " + b"9" * 5000 + b"\n",  # past Python's digit limit
        b"[" * 1000,  # flow nesting past the recursion limit (and seconds of scanning)
        b"model: x\n" + b"#" * (1 << 20),  # over the size cap
    ],
    ids=["no such date", "5000 digits", "deep nesting", "over 1 MiB"],
)
def test_a_hostile_manifest_is_a_manifest_error_at_once(model: Path, data: bytes) -> None:
    from quantroute.registry.manifest import parse_manifest, read_manifest

    (model / "quantroute.yaml").write_bytes(data)
    started = time.monotonic()
    with pytest.raises(ManifestError) as caught:
        parse_manifest(model, read_manifest(model))
    assert time.monotonic() - started < 0.5
    assert caught.value.message.startswith("tiny-llama/quantroute.yaml ")
