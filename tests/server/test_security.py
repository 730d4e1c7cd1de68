"""API keys (each key owns its sessions and contexts), TLS with a self-signed certificate
made here, and the per-key and message-size limits, all through real gRPC on loopback; and the
same keys and certificate on the HTTP side, driven over HTTPS by the official `openai` package."""

from __future__ import annotations

import datetime
import ipaddress
import socket
import ssl
import urllib.error
import urllib.request

import grpc
import openai
import pytest
from engine_helpers import profile_for
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hcache.client import Client
from hcache.config import Config, EngineConfig, ServerConfig, StorageConfig
from hcache.server.app import start
from hcache.server.auth import load_keys

pytestmark = pytest.mark.model
KEY_A, KEY_B = "alice-0123456789abcdef", "bob-0123456789abcdef00"


def self_signed(tmp_path):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_pem = cert.public_bytes(serialization.Encoding.PEM)
    (tmp_path / "cert.pem").write_bytes(cert_pem)
    (tmp_path / "key.pem").write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return tmp_path / "cert.pem", tmp_path / "key.pem", cert_pem


@pytest.fixture(scope="module")
def secure(default_model, tmp_path_factory):
    d = tmp_path_factory.mktemp("secure")
    (d / "keys").write_text(f"# tenants\nalice {KEY_A}\nbob {KEY_B}\n")
    cert, key, pem = self_signed(d)
    cfg = Config(
        storage=StorageConfig([str(d / "s")]),
        engine=EngineConfig(
            store_kinds="kv", kv_budget_bytes=128 << 20, max_sessions_per_tenant=3, max_storage_bytes_per_tenant=8 << 20
        ),
        server=ServerConfig(
            port=0,
            http_port=0,
            api_keys_file=str(d / "keys"),
            tls_cert_file=str(cert),
            tls_key_file=str(key),
            max_message_bytes=64 << 10,
        ),
    )
    run = start(cfg, profile_for(default_model.model), default_model)
    yield run, pem
    run.stop(1)


def client(secure, key: str | None) -> Client:
    run, pem = secure
    return Client(f"localhost:{run.port}", api_key=key, root_cert=pem)


def code_of(fn) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as e:
        r = fn()
        if hasattr(r, "__iter__"):
            list(r)
    return e.value.code()


def test_keys_own_sessions_over_tls(secure):
    with client(secure, KEY_A) as a, client(secure, KEY_B) as b, client(secure, None) as anon:
        sid = a.create_session("Be brief.").session_id
        assert a.reply(sid, "Hi!", max_new_tokens=4).token_ids
        ctx = a.precompute_context("A short document about owls.").context_id
        # bob sees none of alice's sessions or contexts
        for fn in (
            lambda: b.get(sid),
            lambda: b.generate(sid, "hello"),
            lambda: b.evict(sid),
            lambda: b.restore(sid),
            lambda: b.delete(sid),
            lambda: b.delete(ctx),
            lambda: b.create_session(context_ids=[ctx]),
        ):
            assert code_of(fn) == grpc.StatusCode.NOT_FOUND
        assert sid not in {s.session_id for s in b.list()}
        assert sid in {s.session_id for s in a.list()}
        # no key, or a wrong one
        assert code_of(lambda: anon.get(sid)) == grpc.StatusCode.UNAUTHENTICATED
        assert code_of(lambda: anon.generate(sid, "x")) == grpc.StatusCode.UNAUTHENTICATED
        with client(secure, "wrong-key-0123456789") as bad:
            assert code_of(lambda: bad.create_session()) == grpc.StatusCode.UNAUTHENTICATED
        # health stays open
        health = health_pb2_grpc.HealthStub(anon.channel).Check(health_pb2.HealthCheckRequest())
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        # alice's session still works after all that
        assert a.reply(sid, "Bye!", max_new_tokens=4).token_ids


def test_plaintext_client_cannot_talk_to_tls_server(secure):
    run, _ = secure
    with Client(f"localhost:{run.port}", api_key=KEY_A, timeout=5) as c:
        assert code_of(lambda: c.create_session()) == grpc.StatusCode.UNAVAILABLE


def test_limits_per_key_and_message_size(secure):
    with client(secure, KEY_B) as b:
        ids = [b.create_session().session_id for _ in range(3)]
        assert code_of(lambda: b.create_session()) == grpc.StatusCode.RESOURCE_EXHAUSTED
        b.delete(ids.pop())
        ids.append(b.create_session().session_id)
        # 8 MB per key at 23 KB per token (KV, float32): about 350 tokens
        assert (
            code_of(lambda: b.generate(ids[0], "word " * 400, max_new_tokens=8)) == grpc.StatusCode.RESOURCE_EXHAUSTED
        )
        assert b.get(ids[0]).num_tokens == 0
        # a request over the 64 KB message limit is refused by gRPC itself
        assert code_of(lambda: b.generate(ids[0], "x" * (70 << 10))) == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_keys_file_validation(tmp_path):
    p = tmp_path / "k"
    p.write_text("short\n")
    with pytest.raises(ValueError, match="at least 16"):
        load_keys(p)
    p.write_text("# nothing\n")
    with pytest.raises(ValueError, match="no keys"):
        load_keys(p)
    p.write_text("a b c\n")
    with pytest.raises(ValueError, match="expected"):
        load_keys(p)
    p.write_text(f"{KEY_A}\n")
    assert next(iter(load_keys(p).values())).startswith("key-")


def openai_client(base: str, key: str, http: openai.DefaultHttpxClient) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=60, http_client=http)


def test_openai_api_over_https(secure):
    run, pem = secure
    base = f"https://127.0.0.1:{run.http_port}"
    msgs = [{"role": "user", "content": "Hi!"}]
    # trusted through the self-signed certificate, as a client given the server's CA file is
    with openai.DefaultHttpxClient(verify=ssl.create_default_context(cadata=pem.decode())) as http:
        assert http.get(f"{base}/healthz").text == "ok\n"
        ok = openai_client(base, KEY_A, http)
        assert [m.id for m in ok.models.list().data] == [run.engine.model_name]
        r = ok.chat.completions.create(model="default", messages=msgs, max_tokens=3, temperature=0)
        assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens > 0
        bad = openai_client(base, "wrong-key-0123456789", http)
        with pytest.raises(openai.AuthenticationError) as e:
            bad.chat.completions.create(model="default", messages=msgs, max_tokens=2)
        assert e.value.status_code == 401
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
    # a client that trusts only the system's CAs refuses the certificate
    with pytest.raises(urllib.error.URLError) as e:
        urllib.request.urlopen(f"{base}/healthz", timeout=30)
    assert isinstance(e.value.reason, ssl.SSLCertVerificationError)


def test_plaintext_http_to_the_tls_port_gets_no_response(secure):
    run, _ = secure
    with openai.DefaultHttpxClient() as http, pytest.raises(openai.APIConnectionError):
        openai_client(f"http://127.0.0.1:{run.http_port}", KEY_A, http).models.list()
    # nothing comes back in plaintext: the TLS handshake fails and the connection closes
    with socket.create_connection(("127.0.0.1", run.http_port), timeout=30) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        reply = b""
        while chunk := s.recv(4096):
            reply += chunk
    assert not reply.startswith(b"HTTP/") and b"ok" not in reply, reply
