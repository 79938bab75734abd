"""The TypeScript (Node) example client, clients/typescript/, against a real orchestrator.

The example's code is generated from proto/ at build time (buf + protoc-gen-es, `npm run build`;
nothing generated is committed, so it cannot go stale), compiled with tsc and run with node. Its
greedy tokens and text, unary and streamed, must equal the Python client's for the same request on
the same stack, with the bearer token from $SPECDEC_TOKEN; a wrong or missing token must get
UNAUTHENTICATED on the TypeScript side, and mutual TLS must work with the same flags as the
Python CLI's.

The npm packages come from clients/typescript/package-lock.json (`npm ci`, into
clients/typescript/node_modules, once per lock); without node or npm the tests skip.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.support.reference import greedy as reference
from tests.support.servers import client_of, start_stack, stop_stack

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "clients" / "typescript"
TOKEN = "token-of-the-typescript-client"
PROMPT = "def fibonacci(n):"
MAX_NEW_TOKENS = 12
GAMMA = 3


@contextlib.contextmanager
def _build_lock():
    """One installer/builder at a time (two test processes may start at once)."""
    with open(EXAMPLE / ".build.lock", "w") as handle:
        import fcntl

        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@pytest.fixture(scope="module")
def ts_client() -> list[str]:
    """The compiled example as a command: npm ci (when the lock changed), then npm run build."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        pytest.skip("the TypeScript client example needs node and npm on PATH (clients/typescript); "
                    f"node: {node or 'missing'}, npm: {npm or 'missing'}")
    major = int(subprocess.run([node, "--version"], capture_output=True, text=True, check=True)
                .stdout.strip().lstrip("v").split(".")[0])
    if major < 20:
        pytest.skip(f"the TypeScript client example needs Node 20 or later, found Node {major}")
    stamp = EXAMPLE / "node_modules" / (
        ".installed-" + hashlib.sha256((EXAMPLE / "package-lock.json").read_bytes()).hexdigest()[:16])
    with _build_lock():
        if not stamp.exists():
            subprocess.run([npm, "ci", "--ignore-scripts", "--no-audit", "--no-fund", "--loglevel=error"],
                           cwd=EXAMPLE, check=True, capture_output=True, timeout=300)
            stamp.touch()
        # generates src/gen from proto/ (the pinned buf of tools/buf, installed on first use) and
        # compiles to dist/; a proto change the example's code does not follow fails here
        built = subprocess.run([npm, "run", "--silent", "build"], cwd=EXAMPLE, capture_output=True, text=True,
                               timeout=300)
        assert built.returncode == 0, f"npm run build failed:\n{built.stdout}\n{built.stderr}"
    return [node, str(EXAMPLE / "dist" / "main.js")]


def run_ts(ts_client: list[str], *args: str, env_token: str | None = None) -> subprocess.CompletedProcess:
    """The example with these arguments; $SPECDEC_TOKEN set to env_token (unset when None)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECDEC_")}
    if env_token is not None:
        env["SPECDEC_TOKEN"] = env_token
    return subprocess.run([*ts_client, *args], capture_output=True, text=True, env=env, timeout=120)


def lines_of(result: subprocess.CompletedProcess) -> list[dict]:
    assert result.returncode == 0, f"rc {result.returncode}\n{result.stdout}\n{result.stderr}"
    return [json.loads(line) for line in result.stdout.splitlines()]


def greedy_args(server: str) -> list[str]:
    return ["--server", server, "--prompt", PROMPT, "--max-new-tokens", str(MAX_NEW_TOKENS), "--temperature", "0",
            "--gamma", str(GAMMA)]


@pytest.fixture(scope="module")
def stack(target_engine, draft_engine, tmp_path_factory):
    """Target, draft and an orchestrator that requires a bearer token."""
    tokens = tmp_path_factory.mktemp("ts-auth") / "tokens"
    tokens.write_text(f"{TOKEN}\n")
    parts = start_stack(target_engine, draft_engine, auth_token_file=str(tokens))
    yield parts
    stop_stack(parts)


@pytest.fixture(scope="module")
def python_answers(stack):
    """What the Python client gets for the same greedy request: (unary result, stream chunks)."""
    kwargs = dict(prompt=PROMPT, max_new_tokens=MAX_NEW_TOKENS, temperature=0, gamma=GAMMA)
    with client_of(stack["address"], token=TOKEN) as client:
        return client.generate(**kwargs), list(client.stream(**kwargs))


def test_unary_and_streamed_greedy_output_equals_the_python_clients(ts_client, stack, python_answers,
                                                                    target_engine):
    lines = lines_of(run_ts(ts_client, *greedy_args(stack["address"]), "--call", "both", env_token=TOKEN))
    unary = [x for x in lines if x["call"] == "generate"]
    chunks = [x for x in lines if x["call"] == "stream" and x["event"] == "chunk"]
    streamed = [x for x in lines if x["call"] == "stream" and x["event"] == "result"]
    assert len(unary) == 1 and len(streamed) == 1 and lines[-1] == streamed[0], lines
    unary, streamed = unary[0], streamed[0]

    py_result, py_chunks = python_answers
    py_stream_ids = [t for c in py_chunks for t in c.token_ids]
    expected = reference(target_engine, target_engine.tokenizer(PROMPT).input_ids, MAX_NEW_TOKENS)
    assert py_result.token_ids == py_stream_ids == expected  # the Python side is right to begin with

    assert unary["token_ids"] == py_result.token_ids
    assert unary["text"] == py_result.text
    assert unary["finish_reason"] == py_result.finish_reason
    assert unary["stats"]["generated_tokens"] == len(py_result.token_ids)
    assert unary["stats"]["sampling"] == "greedy"
    assert unary["stats"]["gamma"] == GAMMA

    assert streamed["token_ids"] == py_stream_ids
    assert streamed["text"] == "".join(c.text_delta for c in py_chunks) == py_result.text
    assert streamed["finish_reason"] == py_chunks[-1].finish_reason
    assert streamed["stats"]["generated_tokens"] == MAX_NEW_TOKENS
    # it really streamed: several chunks (at most gamma + 1 tokens a round), each printed as it came
    assert streamed["chunks"] == len(chunks) >= MAX_NEW_TOKENS // (GAMMA + 1)
    assert [t for c in chunks for t in c["token_ids"]] == streamed["token_ids"]
    assert "".join(c["text_delta"] for c in chunks) == streamed["text"]


def test_token_argument_and_a_prompt_of_token_ids(ts_client, stack, python_answers, target_engine):
    """--token works like $SPECDEC_TOKEN; the prompt given as token ids gives the same tokens."""
    ids = ",".join(str(t) for t in target_engine.tokenizer(PROMPT).input_ids)
    args = [*greedy_args(stack["address"]), "--call", "generate", "--token", TOKEN]
    assert lines_of(run_ts(ts_client, *args))[0]["token_ids"] == python_answers[0].token_ids
    assert lines_of(run_ts(ts_client, *args, "--token-ids", ids))[0]["token_ids"] == python_answers[0].token_ids


@pytest.mark.parametrize("call", ["generate", "stream"])
@pytest.mark.parametrize("how", ["wrong --token over a right $SPECDEC_TOKEN", "wrong $SPECDEC_TOKEN", "no token"])
def test_a_wrong_or_missing_token_is_unauthenticated(ts_client, stack, call, how):
    args = [*greedy_args(stack["address"]), "--call", call]
    if how.startswith("wrong --token"):
        result = run_ts(ts_client, *args, "--token", TOKEN + "x", env_token=TOKEN)
    elif how == "wrong $SPECDEC_TOKEN":
        result = run_ts(ts_client, *args, env_token="wrong")
    else:
        result = run_ts(ts_client, *args)
    assert result.returncode == 1, f"{result.stdout}\n{result.stderr}"
    assert result.stdout == ""  # no answer, not even a first chunk
    assert result.stderr.startswith("UNAUTHENTICATED: ") and "bearer token" in result.stderr, result.stderr


def test_mutual_tls_with_the_python_clis_flags(ts_client, target_engine, draft_engine, tmp_path):
    """--tls-ca/--tls-cert/--tls-key as the Python CLI takes them: the orchestrator verified, our
    certificate presented; without our certificate the handshake is refused."""
    trustme = pytest.importorskip("trustme")
    ca = trustme.CA()
    files = {name: tmp_path / f"{name}.pem" for name in ("ca", "server", "server_key", "client", "client_key")}
    ca.cert_pem.write_to_path(str(files["ca"]))
    for name, identities in (("server", ("localhost", "127.0.0.1")), ("client", ("client.test",))):
        cert = ca.issue_cert(*identities)
        files[name].write_bytes(b"".join(p.bytes() for p in cert.cert_chain_pems))
        cert.private_key_pem.write_to_path(str(files[f"{name}_key"]))
    (tmp_path / "tokens").write_text(f"{TOKEN}\n")
    stack = start_stack(target_engine, draft_engine, tls_cert=str(files["server"]), tls_key=str(files["server_key"]),
                        tls_client_ca=str(files["ca"]), auth_token_file=str(tmp_path / "tokens"))
    try:
        args = [*greedy_args(stack["address"]), "--call", "generate", "--tls-ca", str(files["ca"])]
        mine = ["--tls-cert", str(files["client"]), "--tls-key", str(files["client_key"])]
        result = lines_of(run_ts(ts_client, *args, *mine, env_token=TOKEN))
        expected = reference(target_engine, target_engine.tokenizer(PROMPT).input_ids, MAX_NEW_TOKENS)
        assert result[0]["token_ids"] == expected
        refused = run_ts(ts_client, *args, env_token=TOKEN)
        assert refused.returncode == 1 and refused.stdout == "", refused.stderr
        # refused in the handshake: under TLS 1.3 the client learns it when the server resets the
        # stream (Connect reports CANCELED), or earlier (UNAVAILABLE); never an answer
        assert re.match(r"[A-Z_]+: ", refused.stderr) and not refused.stderr.startswith("UNAUTHENTICATED"), \
            refused.stderr
    finally:
        stop_stack(stack)
