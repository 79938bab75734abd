"""Shared runtime of the speculative decoding service: sampling, wire encoding, model loading,
worker sessions, gRPC plumbing and the `specdec` command line. The generated protobuf modules
live in the client distribution, clients/python/specdec_client/v1/ (see scripts/gen_protos.py);
specdec.v1 re-exports them."""


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("specdec-service")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "0+unknown"


__version__ = _version()
