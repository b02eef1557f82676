"""The repository commands: ``quantroute validate``, ``quantroute sign``, ``quantroute verify``.

``validate FILE`` checks one GGUF file, or one ``.onnx`` graph (with the
``tokenizer.gguf`` beside it, where there is one), the way the gateway does before
any engine opens it (in a child process bounded in time and memory); ``validate
REPO`` (a repository or one model folder) also checks the manifests, the
sha256 of every file and, with a key, the signatures. Exit status 0 when all
is sound, 1 otherwise.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from quantroute.engines.onnx.layout import TOKENIZER_FILE
from quantroute.errors import ManifestError
from quantroute.registry.gguf_check import check_gguf_isolated
from quantroute.registry.onnx_check import DataFile
from quantroute.registry.onnx_pair import check_onnx_isolated
from quantroute.registry.repository import model_dirs, scan_model
from quantroute.registry.signing import SIGNATURE_NAME, TrustPolicy, sign_model, verify_model


def _trust(args: argparse.Namespace) -> TrustPolicy:
    return TrustPolicy(
        required=getattr(args, "require_signatures", False),
        public_key=args.public_key,
        sigstore_identity=args.sigstore_identity,
        sigstore_issuer=args.sigstore_issuer,
    )


def _check_file(path: Path) -> str | None:
    """Why one model file is refused (``None``: it is sound): a GGUF's header check, or an
    ONNX graph's with its ``tokenizer.gguf`` (the layout an ONNX branch's folder has)."""
    if path.suffix != ".onnx":
        (problem,) = check_gguf_isolated([path])
        return problem
    tokenizer = path.with_name(TOKENIZER_FILE)
    beside = path.with_name(path.name + ".data")  # the exporter's external data, if any
    data = [DataFile(beside.name, beside.stat().st_size) if beside.is_file() else None]
    (found,) = check_onnx_isolated([(path, tokenizer if tokenizer.is_file() else None)], data=data)
    if found.model is not None:
        return found.model
    return None if found.tokenizer is None else f"{TOKENIZER_FILE}: {found.tokenizer}"


def cmd_validate(args: argparse.Namespace) -> int:
    path: Path = args.path
    if path.is_file():
        problem = _check_file(path)
        print(f"{path}: {'ok' if problem is None else problem}")
        return 0 if problem is None else 1
    bad = 0
    for directory in model_dirs(path):
        try:
            entry = scan_model(directory, _trust(args))
        except ManifestError as exc:
            print(f"{directory.name}: refused: {exc.message}")
            bad += 1
            continue
        signed = entry.signature or f"unsigned (no {SIGNATURE_NAME} checked)"
        print(f"{entry.manifest.model}: manifest ok; {signed}")
        for version in entry.versions:
            for a in version:
                where = f"{a.route}:{a.name}"
                if a.problem is None:
                    print(f"  {where}: ok ({a.path.name}, sha256 {a.sha256[:12]}...)")
                else:
                    print(f"  {where}: {a.problem}")
                    bad += a.url is None  # a remote branch is not a bad file
    return 1 if bad else 0


def cmd_sign(args: argparse.Namespace) -> int:
    target = sign_model(
        args.model_dir, private_key=args.private_key, password=args.password, sigstore=args.sigstore
    )
    print(f"signed {args.model_dir} -> {target}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    how = verify_model(args.model_dir, _trust(args) if _trust(args).can_verify else _required())
    print(f"{args.model_dir}: {how}")
    return 0


def _required() -> TrustPolicy:
    return TrustPolicy(required=True)  # verify without a key: say so, don't pass silently


def _trust_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--public-key", type=Path, default=None, help="EC public key (PEM)")
    parser.add_argument("--sigstore-identity", default=None, help="expected Sigstore signer")
    parser.add_argument("--sigstore-issuer", default=None, help="its OIDC issuer")


def add_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    validate = sub.add_parser(
        "validate",
        help="check a GGUF file, or a model repository, as the gateway would",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
    )
    validate.add_argument(
        "path", type=Path, help="a GGUF or .onnx file, a model folder or a repository"
    )
    _trust_flags(validate)
    validate.add_argument(
        "--require-signatures", action="store_true", help="an unsigned model is refused"
    )
    validate.set_defaults(func=cmd_validate)

    sign = sub.add_parser(
        "sign",
        help="sign a model folder (OpenSSF model signing) into model.sig",
        description="Sign the manifest and every file of a model folder into model.sig, "
        "with an elliptic-curve private key (offline) or with Sigstore (keyless, network).",
    )
    sign.add_argument("model_dir", type=Path, help="the model folder")
    sign.add_argument("--private-key", type=Path, default=None, help="EC private key (PEM)")
    sign.add_argument("--password", default=None, help="the private key's password, if any")
    sign.add_argument("--sigstore", action="store_true", help="sign with Sigstore instead")
    sign.set_defaults(func=cmd_sign)

    verify = sub.add_parser(
        "verify",
        help="verify a model folder's model.sig",
        description="Verify model.sig against the folder's files, with an EC public key "
        "or a Sigstore identity. Exit status 2 when it does not verify.",
    )
    verify.add_argument("model_dir", type=Path, help="the model folder")
    _trust_flags(verify)
    verify.set_defaults(func=cmd_verify)
