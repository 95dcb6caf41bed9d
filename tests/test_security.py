"""Unit tests of the security pieces: password records, the login throttle, SASL EXTERNAL, cluster tokens."""

from __future__ import annotations

import base64
import hashlib
import logging

import pytest
from pamqp import commands

from core.cluster.auth import WINDOW, PeerAuth
from core.engine import passwords
from core.engine.broker import Broker, User
from core.engine.login_throttle import MAX_DELAY, LoginThrottle
from core.model.clock import ManualScheduler
from core.model.ratelog import RateLimitedLog
from leveret.node.config import ConfigError, NodeConfig, load, validate
from tests.amqp_client import Client, plain

REMOTE = ("10.9.8.7", 40000)


# -- password records -------------------------------------------------------------------------
def test_new_passwords_are_argon2id() -> None:
    user = User.create("u", "s3cret")
    assert user.salt == b"" and user.password_hash.startswith(b"$argon2id$v=19$m=19456,t=2,p=1$")
    assert b"s3cret" not in user.password_hash
    assert passwords.verify(user.salt, user.password_hash, "s3cret") == (True, False)
    assert passwords.verify(user.salt, user.password_hash, "S3cret") == (False, False)


def _legacy(password: str) -> tuple[bytes, bytes]:
    salt = b"0123456789abcdef"
    return salt, hashlib.pbkdf2_hmac("sha256", password.encode(), salt, 1)


def _rabbit(password: str) -> tuple[bytes, bytes]:
    raw = base64.b64decode(base64.b64encode(b"\x01\x02\x03\x04" + hashlib.sha256(b"\x01\x02\x03\x04"
                                                                                   + password.encode()).digest()))
    return raw[:4], raw[4:]


@pytest.mark.parametrize("old", [_legacy, _rabbit], ids=["pbkdf2-1-iteration", "rabbit_password_hashing_sha256"])
def test_old_records_verify_and_are_rehashed_on_login(old: object) -> None:
    broker = Broker(default_user=None)
    salt, record = old("pw")  # type: ignore[operator]
    broker.users["old"] = user = User("old", salt, record, vhosts={"/"})
    saved: list[User] = []
    broker.on_user_rehashed.append(saved.append)
    with pytest.raises(Exception, match="refused"):
        broker.authenticate("old", "wrong", None)
    assert user.password_hash == record and not saved  # a wrong password changes nothing
    assert broker.authenticate("old", "pw", None) is user
    assert saved == [user] and user.salt == b"" and user.password_hash.startswith(b"$argon2id$")
    assert broker.authenticate("old", "pw", None) is user and saved == [user]  # once


def test_the_core_fallback_is_pbkdf2_600k_and_reads_back() -> None:
    kdf = passwords.Pbkdf2Sha256(iterations=1000)  # the format; 600,000 iterations take 280 ms
    record = kdf.hash("pw")
    assert record.startswith(b"$pbkdf2-sha256$1000$")
    assert kdf.verify(record, "pw") and not kdf.verify(record, "px")
    assert passwords.Pbkdf2Sha256().outdated(record) and not kdf.outdated(record)
    # A fallback record verifies under argon2 too, and asks to be upgraded.
    default = passwords.Pbkdf2Sha256()
    full = default.hash("pw")
    assert passwords.verify(b"", full, "pw") == (True, True)


# -- the login throttle -----------------------------------------------------------------------
def test_throttle_grows_per_address_and_forgets() -> None:
    now = [0.0]
    t = LoginThrottle(clock=lambda: now[0])
    delays = [t.failed("10.0.0.1") for _ in range(12)]
    assert delays[0] == 0.0 and delays[1] == pytest.approx(0.1) and delays[2] == pytest.approx(0.2)
    assert delays == sorted(delays) and delays[-1] == MAX_DELAY
    assert t.failed("10.0.0.2") == 0.0  # per address
    assert t.failed(None) == 0.0
    now[0] += 301
    assert t.delay("10.0.0.1") == 0.0 and t.failed("10.0.0.1") == 0.0


def test_amqp_refusals_are_delayed_and_a_right_password_still_gets_in() -> None:
    clock = ManualScheduler()
    broker = Broker(default_user=None, scheduler=clock)
    broker.add_user("alice", "right", vhosts={"/"})

    def attempt(password: str) -> Client:
        c = Client(broker, peer=REMOTE)
        c.send_raw(b"AMQP\x00\x00\x09\x01")
        c.read()
        c.send(0, commands.Connection.StartOk(client_properties={"capabilities": {
            "authentication_failure_close": True}}, mechanism="PLAIN", response=plain("alice", password)))
        return c

    first = attempt("wrong")
    assert isinstance(first.read()[0][1], commands.Connection.Close)  # a first typo: at once
    second = attempt("wrong")
    assert second.read() == []  # held back ...
    clock.advance(0.05)
    assert second.read() == []
    clock.advance(0.06)
    reply = second.read()
    assert isinstance(reply[0][1], commands.Connection.Close) and reply[0][1].reply_code == 403  # ... then refused
    ok = attempt("right")
    assert isinstance(ok.read()[0][1], commands.Connection.Tune)  # no wait for the right password


# -- SASL EXTERNAL ------------------------------------------------------------------------------
def _start(identity: str | None, broker: Broker) -> tuple[Client, commands.Connection.Start]:
    c = Client(broker, peer=REMOTE)
    c.conn.peer_identity = identity
    c.send_raw(b"AMQP\x00\x00\x09\x01")
    start = c.read()[0][1]
    assert isinstance(start, commands.Connection.Start)
    return c, start


def test_external_is_offered_only_with_a_verified_certificate() -> None:
    broker = Broker(default_user=None)
    broker.add_user("certuser", "unused", vhosts={"/"})
    _, start = _start(None, broker)
    assert "EXTERNAL" not in start.mechanisms.split()
    c, start = _start("certuser", broker)
    assert "EXTERNAL" in start.mechanisms.split()
    tune = c.expect(0, commands.Connection.StartOk(mechanism="EXTERNAL", response=""), commands.Connection.Tune)
    assert tune and c.conn.username == "certuser"
    stranger, _ = _start("nobody", broker)
    stranger.send(0, commands.Connection.StartOk(mechanism="EXTERNAL", response="",
                                                 client_properties={"capabilities": {
                                                     "authentication_failure_close": True}}))
    assert isinstance(stranger.read()[0][1], commands.Connection.Close)
    plain_client, _ = _start(None, broker)
    plain_client.send(0, commands.Connection.StartOk(mechanism="EXTERNAL", response="certuser",
                                                     client_properties={"capabilities": {
                                                         "authentication_failure_close": True}}))
    refused = plain_client.read()[0][1]
    assert isinstance(refused, commands.Connection.Close) and "unsupported" in refused.reply_text


# -- cluster tokens -----------------------------------------------------------------------------
def test_cluster_tokens_are_single_use_and_time_bound() -> None:
    now = [1000.0]
    a = PeerAuth(secret=b"s" * 32, clock=lambda: now[0])
    b = PeerAuth(secret=b"s" * 32, clock=lambda: now[0])
    m = "/leveret.internal.v1.Node/Stats"
    md = a.metadata((), m)
    assert b.refusal(md, m) is None
    assert b.refusal(md, m) == "cluster credentials replayed"
    assert b.refusal((), m) is not None
    wrong = "wrong cluster secret, or a token minted for another method"
    assert b.refusal(PeerAuth(secret=b"t" * 32).metadata((), m), m) == wrong
    assert b.refusal(a.metadata((), m), "/leveret.internal.v1.Node/Purge") == wrong  # the method is covered
    assert b.refusal(a.metadata((), m)) is not None  # unchecked by the listener's interceptor: refused
    old = a.metadata((), m)
    now[0] += WINDOW + 1
    assert "old" in (b.refusal(old, m) or "")
    forged = ((k, v[:-1] + ("0" if v[-1] != "0" else "1")) for k, v in a.metadata((), m))
    assert b.refusal(tuple(forged), m) == wrong
    with pytest.raises(ValueError):
        PeerAuth()


def test_rate_limited_log_says_how_many_it_kept_back(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    r = RateLimitedLog(logging.getLogger("t.ratelog"), interval=10, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="t.ratelog"):
        assert [r.warning("h", "refused") for _ in range(4)] == [True, False, False, False]
        assert r.warning("other", "refused")
        now[0] = 11
        assert r.warning("h", "refused")
    assert len(caplog.records) == 3 and caplog.records[-1].repeats_not_logged == 3  # type: ignore[attr-defined]


# -- configuration ------------------------------------------------------------------------------
def test_cluster_mode_needs_a_secret_or_certificates() -> None:
    base = {"etcd": "http://127.0.0.1:2379", "store": "postgres", "postgres_dsn": "postgresql://x"}
    with pytest.raises(ConfigError, match="--cluster-secret-file"):
        validate(load(None, base, environ={}))
    validate(load(None, {**base, "cluster_secret_file": "/s"}, environ={}))
    with pytest.raises(ConfigError, match="--cluster-tls-key"):
        validate(load(None, {**base, "cluster_tls_cert": "/c"}, environ={}))


def test_tls_options() -> None:
    assert NodeConfig().resolved_amqps_port == 0
    cfg = load(None, {"tls_cert": "/c", "tls_key": "/k"}, environ={"LEVERET_TLS_FAIL_IF_NO_PEER_CERT": "true"})
    assert cfg.resolved_amqps_port == 5671 and cfg.tls_fail_if_no_peer_cert is True
    assert load(None, {"tls_cert": "/c", "tls_key": "/k", "amqps_port": 0}, environ={}).resolved_amqps_port == 0
    with pytest.raises(ConfigError, match="--tls-ca"):
        validate(load(None, {"tls_cert": "/c", "tls_key": "/k", "tls_verify": "peer"}, environ={}))
    with pytest.raises(ConfigError, match="true or false"):
        load(None, {}, environ={"LEVERET_GRPC_TLS": "maybe"})


def test_server_tls_is_1_2_plus_with_aead_forward_secret_suites(tmp_path: object) -> None:
    import ssl
    from pathlib import Path

    import trustme

    from leveret.node.tls import ServerTLS, TLSFiles

    root = Path(str(tmp_path))
    ca = trustme.CA()
    leaf = ca.issue_cert("127.0.0.1")
    leaf.cert_chain_pems[0].write_to_path(str(root / "c.pem"))
    leaf.private_key_pem.write_to_path(str(root / "k.pem"))
    ca.cert_pem.write_to_path(str(root / "ca.pem"))
    tls = ServerTLS(TLSFiles(str(root / "c.pem"), str(root / "k.pem"), str(root / "ca.pem"), "peer", True))
    ctx = tls.context
    assert ctx.minimum_version == ssl.TLSVersion.TLSv1_2 and ctx.verify_mode == ssl.CERT_REQUIRED
    for c in ctx.get_ciphers():
        assert c["protocol"] == "TLSv1.3" or (c["aead"] and c["kea"] in ("kx-ecdhe", "kx-dhe")), c["name"]
    assert ServerTLS(TLSFiles(str(root / "c.pem"), str(root / "k.pem"))).reload() is True
    (root / "k.pem").write_text("not a key")
    assert tls.reload() is False  # a broken file keeps the old certificate


def test_an_unknown_user_costs_a_kdf_run_too() -> None:
    import time

    broker = Broker(default_user=None)
    broker.add_user("known", "pw", vhosts={"/"})
    timings = {}
    for name in ("known", "nobody"):
        started = time.perf_counter()
        for _ in range(3):
            with pytest.raises(Exception, match="refused"):
                broker.authenticate(name, "wrong", None)
        timings[name] = time.perf_counter() - started
    assert timings["nobody"] > timings["known"] / 3, timings  # ~equal; a skipped KDF would be ~1000x faster


def test_recent_logins_skip_the_kdf_only_for_the_same_record_and_password() -> None:
    now = [0.0]
    recent = passwords.RecentLogins(ttl=600, clock=lambda: now[0])
    recent.remember("u", b"record-1", "pw")
    assert recent.known("u", b"record-1", "pw")
    assert not recent.known("u", b"record-1", "px")
    assert not recent.known("u", b"record-2", "pw")  # the password changed (or was re-hashed)
    assert not recent.known("v", b"record-1", "pw")
    now[0] = 601
    assert not recent.known("u", b"record-1", "pw")

    broker = Broker(default_user=None)
    broker.add_user("u", "old", vhosts={"/"})
    broker.authenticate("u", "old", None)
    import time

    started = time.perf_counter()
    broker.authenticate("u", "old", None)
    assert time.perf_counter() - started < 0.005  # no argon2 run (26 ms)
    broker.add_user("u", "new", vhosts={"/"})  # a password change replaces the record
    with pytest.raises(Exception, match="refused"):
        broker.authenticate("u", "old", None)
    assert broker.authenticate("u", "new", None).name == "u"


def test_make_test_ca_writes_a_working_set(tmp_path: object) -> None:
    import ssl
    from pathlib import Path

    from leveret.cli.main import main
    from leveret.node.tls import ServerTLS, TLSFiles

    out = Path(str(tmp_path)) / "certs"
    assert main(["tls", "make-test-ca", str(out), "--client", "alice"]) == 0
    assert (out / "server.key").stat().st_mode & 0o777 == 0o600
    server = ServerTLS(TLSFiles(str(out / "server.pem"), str(out / "server.key"), str(out / "ca.pem"), "peer"))
    client = ssl.create_default_context(cafile=str(out / "ca.pem"))
    client.load_cert_chain(str(out / "client-alice.pem"), str(out / "client-alice.key"))
    a_in, a_out, b_in, b_out = ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO()
    s = server.context.wrap_bio(a_in, a_out, server_side=True)
    c = client.wrap_bio(b_in, b_out, server_hostname="127.0.0.1")
    done = [False, False]
    for _ in range(10):
        for i, (end, out_bio, in_bio) in enumerate(((c, b_out, a_in), (s, a_out, b_in))):
            if not done[i]:
                try:
                    end.do_handshake()
                    done[i] = True
                except ssl.SSLWantReadError:
                    pass
            in_bio.write(out_bio.read())
    assert all(done)
    from amqp_frontend.tls_accept import peer_identity

    assert peer_identity(s.getpeercert()) == "alice"  # the EXTERNAL user name


async def test_grpc_refusals_are_delayed_too() -> None:
    import time

    import grpc
    import grpc.aio

    from leveret.node.grpc_server import GRPCServer
    from leveret_client.proto import leveret_pb2 as pb
    from leveret_client.proto import leveret_pb2_grpc as pb_grpc

    server = GRPCServer(Broker())
    await server.start("127.0.0.1", 0)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = pb_grpc.BrokerStub(channel)
            waits = []
            for _ in range(4):
                started = time.monotonic()
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await stub.ListQueues(pb.ListQueuesRequest(), metadata=(("username", "guest"),
                                                                            ("password", "guess")))
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
                waits.append(time.monotonic() - started)
            assert waits[3] >= 0.2 > waits[0], waits  # 0, 0, 0.1, 0.2 s before each check (Broker.login)
            started = time.monotonic()
            await stub.ListQueues(pb.ListQueuesRequest(), metadata=(("username", "guest"), ("password", "guest")))
            assert time.monotonic() - started >= 0.4  # a right password waits too, as on AMQP
            started = time.monotonic()
            await stub.ListQueues(pb.ListQueuesRequest(), metadata=(("username", "guest"), ("password", "guest")))
            assert time.monotonic() - started < 0.2  # once logged in: the cache, no throttle
    finally:
        await server.stop(0)
