"""Shared runtime of the speculative decoding service: sampling, wire encoding, model loading,
worker sessions, gRPC plumbing and the `specdec` command line. The generated protobuf modules
live in specdec/v1/ (see scripts/gen_protos.py)."""
