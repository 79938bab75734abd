"""Mutual TLS on every hop and bearer tokens on the client API, with certificates made here.

A CA of ours signs the servers' certificates (localhost, 127.0.0.1) and a client certificate; a
second, rogue CA signs another client certificate that every server must refuse.
"""

from __future__ import annotations

import time

import grpc
import pytest
import trustme

from orchestrator.client import Client
from orchestrator.remote import RemoteTarget
from specdec import healthcheck
from specdec.errors import ServiceError
from specdec.security import ClientTls
from tests.support.reference import greedy as reference
from tests.support.servers import start_orchestrator, start_stack, stop_stack, wait_for

TOKEN = "s3cret-token"


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    root = tmp_path_factory.mktemp("pki")
    ca, rogue = trustme.CA(), trustme.CA()
    files = {"ca": root / "ca.pem"}
    ca.cert_pem.write_to_path(str(files["ca"]))
    for name, issuer, identities in (("server", ca, ("localhost", "127.0.0.1")), ("client", ca, ("client.test",)),
                                     ("rogue", rogue, ("client.test",)), ("other", ca, ("other.test",))):
        cert = issuer.issue_cert(*identities)
        files[f"{name}_cert"], files[f"{name}_key"] = root / f"{name}.pem", root / f"{name}.key"
        files[f"{name}_cert"].write_bytes(b"".join(p.bytes() for p in cert.cert_chain_pems))
        cert.private_key_pem.write_to_path(str(files[f"{name}_key"]))
    (root / "tokens").write_text(f"# clients\n{TOKEN}\n\nanother-token\n")
    files["tokens"] = root / "tokens"
    return {k: str(v) for k, v in files.items()}


@pytest.fixture(scope="module")
def secure_stack(pki, target_engine, draft_engine):
    server_tls = dict(tls_cert=pki["server_cert"], tls_key=pki["server_key"], tls_client_ca=pki["ca"])
    # workers are reached as "localhost": the name their certificates carry
    stack = start_stack(target_engine, draft_engine, worker_tls=server_tls, worker_host="localhost", **server_tls,
                        worker_tls_ca=pki["ca"], worker_tls_cert=pki["client_cert"],
                        worker_tls_key=pki["client_key"], auth_token_file=pki["tokens"], http_port=0)
    tport, _, oport = stack["ports"]
    yield {"address": f"localhost:{oport}", "target": f"localhost:{tport}",
           "https": f"https://localhost:{stack['orchestrator'].http.port}",
           "model": stack["orchestrator"].slot.decoder.target_info.model_name}
    stop_stack(stack)


def good_tls(pki):
    return ClientTls(pki["ca"], pki["client_cert"], pki["client_key"])


def test_mutual_tls_on_every_hop_gives_the_right_answer(secure_stack, pki, target_engine):
    ids = target_engine.tokenizer("def fibonacci(n):").input_ids
    with Client(secure_stack["address"], tls=good_tls(pki), token=TOKEN, timeout_s=60) as client:
        r = client.generate(token_ids=ids, max_new_tokens=12, temperature=0, gamma=3)
    assert r.token_ids == reference(target_engine, ids, 12)


@pytest.mark.parametrize("who", ["plaintext", "no client certificate", "certificate from another CA"])
def test_client_without_a_valid_certificate_is_refused(secure_stack, pki, who):
    tls = {"plaintext": None, "no client certificate": ClientTls(pki["ca"]),
           "certificate from another CA": ClientTls(pki["ca"], pki["rogue_cert"], pki["rogue_key"])}[who]
    with Client(secure_stack["address"], tls=tls, token=TOKEN, timeout_s=10) as client, \
            pytest.raises(ServiceError) as e:
        client.generate(prompt="hello", max_new_tokens=2)
    assert e.value.code == grpc.StatusCode.UNAVAILABLE


def test_worker_refuses_a_caller_without_a_valid_certificate(secure_stack, pki):
    for tls in (ClientTls(pki["ca"]), ClientTls(pki["ca"], pki["rogue_cert"], pki["rogue_key"]), None):
        worker = RemoteTarget(secure_stack["target"], timeout_s=10, tls=tls)
        with pytest.raises(ServiceError) as e:
            worker.describe()
        assert e.value.code == grpc.StatusCode.UNAVAILABLE
        worker.close()
    worker = RemoteTarget(secure_stack["target"], timeout_s=10, tls=good_tls(pki))
    assert worker.describe().model_name == "tiny-target"
    worker.close()


@pytest.mark.parametrize("token", [None, "wrong", TOKEN + "x", ""])
def test_missing_or_wrong_bearer_token_is_unauthenticated(secure_stack, pki, token):
    with Client(secure_stack["address"], tls=good_tls(pki), token=token, timeout_s=10) as client:
        for call in (lambda: client.generate(prompt="hello", max_new_tokens=2),
                     lambda: list(client.stream(prompt="hello", max_new_tokens=2)),
                     client.workers):
            with pytest.raises(ServiceError) as e:
                call()
            assert e.value.code == grpc.StatusCode.UNAUTHENTICATED and "bearer token" in e.value.message


def test_every_listed_token_works_and_health_needs_none(secure_stack, pki):
    with Client(secure_stack["address"], tls=good_tls(pki), token="another-token", timeout_s=30) as client:
        assert client.generate(prompt="hello", max_new_tokens=2).finish_reason in ("length", "eos")
        client.wait_until_ready(5)  # the health service, without a token
    args = [secure_stack["address"], "--tls-ca", pki["ca"], "--tls-cert", pki["client_cert"],
            "--tls-key", pki["client_key"]]
    assert healthcheck.main(args) == 0
    assert healthcheck.main(args[:3]) == 1, "no client certificate: the handshake fails"


def test_the_http_door_takes_the_same_certificates_and_tokens(secure_stack, pki):
    import ssl

    import httpx

    body = {"model": secure_stack["model"], "prompt": "def", "max_tokens": 3, "temperature": 0}
    auth = {"Authorization": f"Bearer {TOKEN}"}
    good = ssl.create_default_context(cafile=pki["ca"])
    good.load_cert_chain(pki["client_cert"], pki["client_key"])
    r = httpx.post(secure_stack["https"] + "/v1/completions", json=body, headers=auth, verify=good, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    r = httpx.post(secure_stack["https"] + "/v1/completions", json=body, headers={"Authorization": "Bearer no"},
                   verify=good, timeout=60)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    rogue = ssl.create_default_context(cafile=pki["ca"])
    rogue.load_cert_chain(pki["rogue_cert"], pki["rogue_key"])
    for refused in (ssl.create_default_context(cafile=pki["ca"]), rogue):  # no client certificate; another CA's
        with pytest.raises((httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError)):
            httpx.post(secure_stack["https"] + "/v1/completions", json=body, headers=auth, verify=refused, timeout=30)
    with pytest.raises((httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError)):  # plaintext
        httpx.post(secure_stack["https"].replace("https", "http") + "/v1/completions", json=body, headers=auth,
                   timeout=30)


def test_under_mutual_tls_a_session_belongs_to_the_openers_certificate(secure_stack, pki):
    """Another client the CA signed, holding the session's id and even its secret, is refused."""
    from specdec.protocol import SamplingParams

    opener = RemoteTarget(secure_stack["target"], timeout_s=10, tls=good_tls(pki))
    other = RemoteTarget(secure_stack["target"], timeout_s=10,
                         tls=ClientTls(pki["ca"], pki["other_cert"], pki["other_key"]))
    try:
        opener.describe(), other.describe()  # both are valid clients of the worker
        opener.open_session("owned", [1, 2, 3])
        other._secrets["owned"] = opener.secret("owned")  # leaked, say
        for call in (lambda: other.truncate("owned", 1), lambda: other.close_session("owned"),
                     lambda: other.verify("owned", 3, [], [4], SamplingParams(temperature=0))):
            with pytest.raises(ServiceError) as e:
                call()
            assert e.value.code == grpc.StatusCode.NOT_FOUND
        assert opener.verify("owned", 3, [], [4], SamplingParams(temperature=0)).length == 4
        opener.close_session("owned")
    finally:
        opener.close()
        other.close()


# ---- admin scope: adding workers, and where they are ---------------------------------------


@pytest.fixture()
def worker_addresses(stack):
    tport, dport, _ = stack["ports"]
    return [f"127.0.0.1:{tport}"], [f"127.0.0.1:{dport}"]


def test_without_admin_tokens_no_one_adds_workers_or_sees_where_they_are(worker_addresses):
    parts, address = start_orchestrator(*worker_addresses, admin_token_file=None)
    try:
        with Client(address, timeout_s=30) as client:
            workers = client.workers()
            assert {w["role"] for w in workers} == {"target", "draft"}
            assert all(w["address"] == "" and w["source"] == "" and w["state"] == "serving" for w in workers)
            with pytest.raises(ServiceError) as e:
                client.add_workers(target=["127.0.0.1:1"])
            assert e.value.code == grpc.StatusCode.PERMISSION_DENIED and "--admin-token-file" in e.value.message
            assert len(client.workers()) == 2  # nothing was added
    finally:
        parts.stop(None)


def test_only_an_admin_token_adds_workers_and_sees_addresses(worker_addresses, tmp_path):
    (tmp_path / "clients").write_text("client-token\n")
    (tmp_path / "admins").write_text("admin-token\n")
    parts, address = start_orchestrator(*worker_addresses, auth_token_file=str(tmp_path / "clients"),
                                        admin_token_file=str(tmp_path / "admins"))
    try:
        with Client(address, timeout_s=30, token="client-token") as client:
            assert client.generate(prompt="def", max_new_tokens=2, temperature=0).token_ids
            assert all(w["address"] == "" for w in client.workers())
            with pytest.raises(ServiceError) as e:
                client.add_workers(target=["127.0.0.1:1"])
            assert e.value.code == grpc.StatusCode.PERMISSION_DENIED
        with Client(address, timeout_s=30, token="admin-token") as admin:
            assert admin.generate(prompt="def", max_new_tokens=2, temperature=0).token_ids  # an admin is a client too
            assert sorted(w["address"] for w in admin.workers()) == sorted(sum(worker_addresses, []))
            added = admin.add_workers(target=["127.0.0.1:1"])
            assert "127.0.0.1:1" in {w["address"] for w in added}
    finally:
        parts.stop(None)


def test_one_client_cannot_hold_more_than_max_per_client_streams(worker_addresses, tmp_path):
    (tmp_path / "clients").write_text("alice\nbob\n")
    parts, address = start_orchestrator(*worker_addresses, max_per_client=1, auth_token_file=str(tmp_path / "clients"))
    try:
        with Client(address, timeout_s=60, token="alice") as alice, Client(address, timeout_s=60, token="bob") as bob:
            stream = alice.stream(prompt="def", max_new_tokens=200, temperature=0, gamma=0)
            next(stream)  # alice's first request is in flight
            with pytest.raises(ServiceError) as e:
                alice.generate(prompt="def", max_new_tokens=2)
            assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-per-client 1" in e.value.message
            assert bob.generate(prompt="def", max_new_tokens=2, temperature=0).token_ids  # others still get in
            stream.close()
            wait_for(lambda: parts.admission.running == 0, 30, "alice's stream ended")
            assert alice.generate(prompt="def", max_new_tokens=2, temperature=0).token_ids
    finally:
        parts.stop(None)


def test_token_files_are_followed_without_a_restart(worker_addresses, tmp_path):
    import os

    tokens = tmp_path / "clients"
    tokens.write_text("first\n")
    parts, address = start_orchestrator(*worker_addresses, auth_token_file=str(tokens))

    def works(token: str) -> bool:
        with Client(address, timeout_s=30, token=token) as client:
            try:
                return bool(client.generate(prompt="def", max_new_tokens=1, temperature=0).token_ids)
            except ServiceError as err:
                assert err.code == grpc.StatusCode.UNAUTHENTICATED
                return False

    try:
        assert works("first") and not works("second")
        tokens.write_text("second\n")  # "first" revoked, "second" issued
        stat = tokens.stat()
        os.utime(tokens, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # a new mtime even on coarse clocks
        wait_for(lambda: works("second"), 30, "the new token accepted")
        assert not works("first")
        tokens.write_text("")  # emptied by mistake: the tokens read before stay
        os.utime(tokens, ns=(stat.st_atime_ns, stat.st_mtime_ns + 2 * 10**9))
        time.sleep(1.5)  # past the once-a-second recheck (a pause, not a timing claim)
        assert works("second")
    finally:
        parts.stop(None)


def test_a_renewed_certificate_is_served_without_a_restart(target_engine, tmp_path):
    """The worker's certificate files are replaced by ones another CA signed: new connections get
    them (a client trusting only the new CA gets in), with no restart."""
    from specdec.worker.config import WorkerConfig
    from tests.support.servers import create_target

    old_ca, new_ca = trustme.CA(), trustme.CA()
    cert, key = tmp_path / "server.pem", tmp_path / "server.key"
    old_ca_file, new_ca_file = tmp_path / "old-ca.pem", tmp_path / "new-ca.pem"
    old_ca.cert_pem.write_to_path(str(old_ca_file))
    new_ca.cert_pem.write_to_path(str(new_ca_file))

    def install(ca):
        issued = ca.issue_cert("localhost")
        cert.write_bytes(b"".join(p.bytes() for p in issued.cert_chain_pems))
        issued.private_key_pem.write_to_path(str(key))

    install(old_ca)
    worker, port = create_target(WorkerConfig("target", "t", host="127.0.0.1", tls_cert=str(cert), tls_key=str(key)),
                                 target_engine)

    def accepted(ca_file) -> bool:
        remote = RemoteTarget(f"localhost:{port}", timeout_s=5, tls=ClientTls(str(ca_file)))
        try:
            return remote.describe().model_name == "tiny-target"
        except ServiceError:
            return False
        finally:
            remote.close()

    try:
        assert accepted(old_ca_file) and not accepted(new_ca_file)
        install(new_ca)
        wait_for(lambda: accepted(new_ca_file), 30, "the renewed certificate served")
        assert not accepted(old_ca_file)
    finally:
        worker.stop(None)
