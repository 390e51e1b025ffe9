"""Security: no unsafe deserialisation in the package, Redis AUTH without leaking the password,
TLS (``rediss://``), S3 credentials only from boto3's chain, destructive admin commands need ``--yes``."""

from __future__ import annotations

import ast
import inspect
import logging
import shutil
import socket
import ssl
import subprocess
import threading
from pathlib import Path

import pytest
import torch

from consistency.index import Index
from tierstore.errors import AccessDeniedError, TierStoreError, TierUnavailableError
from tierstore.keys import ShardKey
from tests.redis_server import RedisProcess

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("tierstore", "backends", "consistency")
SECRET = "s3cr3t-Pa55word-never-logged"


# -- no pickle (or eval) on any path ------------------------------------------------------------------------


def _unsafe_calls(tree: ast.AST) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] + ([node.module] if isinstance(node, ast.ImportFrom) else [])
            for n in names:
                if n and n.split(".")[0] in ("pickle", "cPickle", "dill", "marshal", "shelve", "cloudpickle"):
                    found.append((node.lineno, f"import {n}"))
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Name) and f.id in ("eval", "exec"):
            found.append((node.lineno, f"{f.id}("))
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name):
            dotted = f"{f.value.id}.{f.attr}"
            if dotted in ("pickle.load", "pickle.loads", "marshal.loads", "marshal.load", "numpy.load", "np.load"):
                if dotted.endswith("np.load") or dotted == "numpy.load":
                    kw = {k.arg: k.value for k in node.keywords}
                    if "allow_pickle" not in kw or getattr(kw["allow_pickle"], "value", True) is not False:
                        found.append((node.lineno, f"{dotted}( without allow_pickle=False"))
                else:
                    found.append((node.lineno, dotted))
            if dotted == "torch.load":
                kw = {k.arg: k.value for k in node.keywords}
                if getattr(kw.get("weights_only"), "value", None) is not True:
                    found.append((node.lineno, "torch.load( without weights_only=True"))
    return found


def test_scanner_finds_what_it_must():
    bad = ("import pickle\npickle.loads(b'')\ntorch.load(f)\ntorch.load(f, weights_only=False)\n"
           "eval('1')\nexec('x')\nmarshal.loads(b'')\nnp.load(f)\n")
    assert len(_unsafe_calls(ast.parse(bad))) == 8
    good = "torch.load(f, weights_only=True)\nmodel.eval()\nnp.load(f, allow_pickle=False)\n"
    assert _unsafe_calls(ast.parse(good)) == []


def test_no_pickle_eval_or_exec_in_the_package():
    files = [p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))]
    assert len(files) > 20
    problems = [f"{p.relative_to(ROOT)}:{line}: {what}"
                for p in files for line, what in _unsafe_calls(ast.parse(p.read_text(), str(p)))]
    assert problems == [], "unsafe deserialisation or eval:\n" + "\n".join(problems)


# -- Redis AUTH, and the password never shows ------------------------------------------------------------------


@pytest.fixture
def auth_redis(tmp_path):
    rp = RedisProcess(tmp_path / "auth-redis", password=SECRET)
    rp.workdir.mkdir()
    rp.start()
    yield rp
    rp.stop(kill=True)


def _no_secret(*texts: str) -> None:
    for t in texts:
        assert SECRET not in t, f"the password leaked: ...{t[max(0, t.find(SECRET) - 80):t.find(SECRET) + 40]}..."


def _chain(e: BaseException) -> str:
    out = []
    while e is not None:
        out += [repr(e), str(e), repr(getattr(e, "fields", ""))]
        e = e.__cause__ or e.__context__
    return "\n".join(out)


def test_redis_auth_works_and_the_password_never_leaks(auth_redis, tmp_path, shm_root, caplog):
    import tierstore

    caplog.set_level(logging.DEBUG)
    good = auth_redis.url
    wrong = good.replace(SECRET, "wrong-" + SECRET[::-1])
    no_pw = good.replace(f":{SECRET}@", "")
    errors = []
    with pytest.raises(AccessDeniedError) as ei:
        Index(good.replace(SECRET, "nope")).ping()
    errors.append(ei.value)
    for url in (no_pw,):
        with pytest.raises(AccessDeniedError) as ei:
            Index(url).ping()
        errors.append(ei.value)
    with pytest.raises(AccessDeniedError) as ei:
        tierstore.open(tmp_path / "home", redis=wrong.replace("wrong-" + SECRET[::-1], SECRET + "x"),
                       durable="none", host_root=str(shm_root / "n"), node_id="n")
    errors.append(ei.value)
    # the right password works (in the URL, or given apart)
    Index(good).ping()
    Index(no_pw, password=SECRET).ping()
    store = tierstore.open(tmp_path / "home", redis=good, durable=f"file://{tmp_path / 'd'}",
                           host_root=str(shm_root / "n"), node_id="n")
    try:
        store.begin_step("m", 1, 1)
        info = store.put(ShardKey("m", "l", 1, 0), {"w": torch.ones(3)})
        store.vote("m", 1, 0, [info])
        store.flush()
        assert torch.equal(store.get(ShardKey("m", "l", 1, 0)).tensors["w"], torch.ones(3))
        _no_secret(repr(store))
        auth_redis.stop(kill=True)  # failing while connected with the right password
        with pytest.raises(TierUnavailableError) as ei:
            store.put(ShardKey("m", "l", 2, 0), {"w": torch.ones(3)})
        errors.append(ei.value)
        with pytest.raises(TierStoreError) as ei:
            store.resolve("m")
        errors.append(ei.value)
    finally:
        try:
            store.close()
        except TierStoreError as e:
            errors.append(e)
    for e in errors:
        assert isinstance(e, TierStoreError)
        _no_secret(_chain(e))
    _no_secret(caplog.text, *(r.getMessage() for r in caplog.records))
    assert any("cannot be reached" in str(e) or "refused" in str(e) for e in errors)


# -- TLS: rediss:// through a TLS terminator in front of the server ----------------------------------------------


def _self_signed(d: Path) -> tuple[Path, Path]:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not on PATH: cannot make a self-signed certificate")
    cert, key = d / "cert.pem", d / "key.pem"
    p = subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                        str(cert), "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                       capture_output=True, text=True)
    if p.returncode != 0:
        pytest.skip(f"openssl could not make a certificate: {p.stderr[-200:]}")
    return cert, key


class TLSTerminator:
    """TLS on a loopback port, piping plain bytes to a server (the valkey binary here has no TLS built in)."""

    def __init__(self, cert: Path, key: Path, backend_port: int) -> None:
        self.ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.ctx.load_cert_chain(cert, key)
        self.backend_port = backend_port
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.handshakes = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                raw, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(raw,), daemon=True).start()

    def _serve(self, raw: socket.socket) -> None:
        try:
            tls = self.ctx.wrap_socket(raw, server_side=True)
        except (ssl.SSLError, OSError):
            raw.close()
            return
        self.handshakes += 1
        up = socket.create_connection(("127.0.0.1", self.backend_port))

        def pipe(src, dst):
            try:
                while data := src.recv(65536):
                    dst.sendall(data)
            except OSError:
                pass
            finally:
                for s in (src, dst):
                    try:
                        s.close()
                    except OSError:
                        pass

        threading.Thread(target=pipe, args=(up, tls), daemon=True).start()
        pipe(tls, up)

    def close(self) -> None:
        self.sock.close()


def test_rediss_url_is_accepted_and_verified(tmp_path, redis_proc):
    cert, key = _self_signed(tmp_path)
    term = TLSTerminator(cert, key, redis_proc.port)
    try:
        idx = Index(f"rediss://127.0.0.1:{term.port}/0", ssl_ca_certs=str(cert))
        idx.ping()
        assert idx.bump_epoch("tls-model") >= 1 and term.handshakes >= 1
        idx.close()
        # an untrusted certificate is refused, typed, and not retried into plain text
        with pytest.raises(TierUnavailableError):
            Index(f"rediss://127.0.0.1:{term.port}/0", socket_timeout=5).ping()
        # and a rediss:// URL never talks plain text to a plain server
        with pytest.raises(TierUnavailableError):
            Index(f"rediss://127.0.0.1:{redis_proc.port}/0", ssl_ca_certs=str(cert), socket_timeout=3).ping()
    finally:
        term.close()


def test_rediss_is_documented():
    from tierstore import config, connect

    assert "rediss://" in (Index.__doc__ or "") + (Index.__init__.__doc__ or "")
    assert "rediss://" in (config.__doc__ or "") and "rediss://" in (connect.open.__doc__ or "")


# -- S3 credentials only from boto3's standard chain -------------------------------------------------------------


def test_s3_backend_takes_no_credentials():
    from backends.s3 import S3Backend, S3Config

    for fn in (S3Backend.__init__, S3Config):
        params = " ".join(inspect.signature(fn).parameters).lower()
        for word in ("access", "secret", "token", "credential", "password", "session"):
            assert word not in params, f"{fn.__qualname__} takes a {word} parameter"
    src = inspect.getsource(__import__("backends.s3", fromlist=["x"]))
    assert "aws_access_key_id" not in src and "aws_secret_access_key" not in src


# -- destructive admin commands need --yes -----------------------------------------------------------------------


def test_admin_deletes_only_with_yes(store, tmp_path, capsys):
    admin = pytest.importorskip("tierstore.cli.admin", reason="tierstore/cli/admin.py is not in the tree")
    for step in range(1, 5):
        store.begin_step("m", step, 1)
        info = store.put(ShardKey("m", "l", step, 0), {"w": torch.full((4,), float(step))})
        store.vote("m", step, 0, [info])
    store.flush()
    conn = ["--redis", store.index.url, "--durable", f"file://{tmp_path / 'durable'}",
            "--host-root", str(store.config.host_root), "--home", str(tmp_path / "home")]
    before = store.list("m")
    assert admin.main([*conn, "gc", "m", "--keep-last", "1"]) == 0
    assert store.list("m") == before, "gc without --yes deleted something"
    assert admin.main([*conn, "rebuild-index"]) != 0
    assert "--yes" in capsys.readouterr().err
    assert store.list("m") == before
    assert admin.main([*conn, "gc", "m", "--keep-last", "1", "--yes"]) == 0
    after = store.list("m")
    assert len(after) < len(before) and ShardKey("m", "l", 4, 0) in after
