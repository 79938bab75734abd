"""Shared runtime of the speculative decoding service: sampling, wire encoding, model loading,
worker sessions, gRPC plumbing and the `specdec` command line. The generated protobuf modules
live in specdec/v1/ (see scripts/gen_protos.py)."""


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("specdec-service")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "0+unknown"


__version__ = _version()
