"""Every environment variable the service reads that is not a flag's, declared once (as vLLM's envs.py).

The flags' own variables (SPECDEC_ORCHESTRATOR_*, SPECDEC_TARGET_*, SPECDEC_DRAFT_*) come from
the flag tables (specdec/flags.py). The ones here have no flag of a service: the model cache, the
switches that turn a technique off for comparisons (each on by default; the value shown turns it
off), the C compiler, and the client commands' credentials. (SPECDEC_SUPERVISOR_PID is no
setting: `specdec serve` hands it to its children, specdec/lifetime.py.) Read them through `get(NAME)` or `on(NAME)`, never os.environ directly, so
that this table, docs/configuration.md (scripts/gen_config_docs.py renders it) and the code
cannot drift apart (tests/specdec/test_envs.py checks the code reads no other).
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class EnvVar:
    name: str
    shown: str  # the value the documentation shows (a switch's "off" value, or what it holds)
    help: str
    default: str = ""  # its value when unset
    reader: str = "worker"  # who reads it: "worker" (a worker, when it loads its model) or "client" (specdec's client commands)


VARIABLES = (
    EnvVar("SPECDEC_CACHE", "a directory",
           "The model cache (default `~/.cache/specdec`): downloaded and verified GGUF files, the converted "
           "transformers directories, the draft's requantized Q4_K blocks (`q4k/`) and the compiled native "
           "kernels (`kernels/`). `python -m specdec.model_store list` shows what it holds."),
    EnvVar("SPECDEC_NATIVE_KERNELS", "0",
           "Turns the native C kernels off: `int8-rows` runs on fbgemm, `int4-rows` and `q4k-rows` are refused, "
           "and `--quantize auto` picks `int8-rows` for a target and fbgemm's `int8` for a draft (slower).", "1"),
    EnvVar("SPECDEC_NATIVE_ISA", "avx2",
           "Keeps the native kernels on their AVX2 path on a CPU with AVX-512 VNNI (the same output bits, "
           "slower with several rows a pass).", "best"),
    EnvVar("SPECDEC_HUGE_PAGES", "0",
           "Keeps the native kernels' weights on ordinary 4 KiB pages instead of memory advised as transparent "
           "huge pages (the same output bits, slower one-row passes).", "1"),
    EnvVar("SPECDEC_LEAN_FORWARD", "0",
           "Runs transformers' own forward for every model instead of the lean Llama/Qwen2 forward "
           "(`specdec/worker/forward.py`; it also turns the decoder layers in C off).", "1"),
    EnvVar("SPECDEC_NATIVE_FORWARD", "0",
           "Runs the decoder layers with torch ops (the lean forward) instead of one call into "
           "`specdec/csrc/decoder.c` a pass.", "1"),
    EnvVar("SPECDEC_Q6K", "0",
           "Runs the Linears the GGUF holds in Q6_K as `int8-rows` (requantized) instead of on their own Q6_K "
           "blocks.", "1"),
    EnvVar("CC", "a compiler",
           "The C compiler that builds the native kernels at install, else on first use (default: `cc`, else `gcc`; "
           "it needs `-mavx2` and `-fopenmp`)."),
    EnvVar("GOMP_SPINCOUNT", "a count",
           "Every entry point sets 200000 (idle OpenMP threads spin about a millisecond, then sleep) unless "
           "`OMP_WAIT_POLICY` or `GOMP_SPINCOUNT` is already set; a worker with cores of its own may use "
           "`OMP_WAIT_POLICY=ACTIVE`."),
    EnvVar("SPECDEC_TOKEN", "a token", "The bearer token `specdec generate` and `specdec workers` send "
           "(their `--token`).", reader="client"),
    EnvVar("SPECDEC_TLS_CA", "a PEM file", "The CA that `specdec generate` and `specdec workers` verify a TLS "
           "orchestrator against (their `--tls-ca`).", reader="client"),
    EnvVar("SPECDEC_TLS_CERT", "a PEM file", "Their certificate for mutual TLS (`--tls-cert`).", reader="client"),
    EnvVar("SPECDEC_TLS_KEY", "a PEM file", "Their key for mutual TLS (`--tls-key`).", reader="client"),
)
BY_NAME = {v.name: v for v in VARIABLES}


def get(name: str) -> str:
    """The variable's value, or its default when unset or empty."""
    return os.environ.get(name) or BY_NAME[name].default


def on(name: str) -> bool:
    """A switch: on unless set to "0"."""
    return get(name) != "0"
