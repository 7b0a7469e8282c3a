"""GCS backends of one credential source share their credentials (`backends.gcscreds`): a
second backend fetches no second token. A service-account key file's token endpoint is a
local HTTP server here that counts the token requests; the objects go to fake-gcs-server
(which takes any token)."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from ckptstore.backends import gcscreds
from ckptstore.backends.gcs import GcsBackend


class TokenServer:
    """An OAuth token endpoint on 127.0.0.1 handing out numbered tokens, counting them."""

    def __init__(self) -> None:
        self.requests = 0
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                outer.requests += 1
                body = json.dumps(
                    {"access_token": f"token-{outer.requests}", "expires_in": 3600}
                ).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/token"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def key_file(self, path: Path) -> Path:
        """A service-account key file (a new RSA key) whose tokens come from here."""
        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        pem = key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ).decode()
        info = {
            "type": "service_account",
            "project_id": "ckptstore-test",
            "private_key_id": "k1",
            "private_key": pem,
            "client_email": "saver@ckptstore-test.iam.gserviceaccount.com",
            "client_id": "1",
            "token_uri": self.url,
        }
        path.write_text(json.dumps(info))
        return path


@pytest.fixture
def tokens() -> Iterator[TokenServer]:
    server = TokenServer()
    yield server
    server.server.shutdown()


async def roundtrip(bucket: str, endpoint: str, credentials: str) -> None:
    """A backend of ``credentials`` writing and reading one object (real tokens sent)."""
    backend = GcsBackend(
        bucket, "creds", endpoint_url=endpoint, credentials=credentials, emulator=False
    )
    async with backend:
        await backend.write("x", b"1")
        assert await backend.read("x") == b"1"


async def test_backends_of_one_key_file_fetch_one_token(
    tokens: TokenServer, ckptstore_gcs_server: Any, ckptstore_gcs_bucket: str, tmp_path: Path
) -> None:
    key = str(tokens.key_file(tmp_path / "key.json"))
    endpoint = ckptstore_gcs_server.endpoint
    for _ in range(3):  # as three saves by URL would
        await roundtrip(ckptstore_gcs_bucket, endpoint, key)
    assert tokens.requests == 1
    tokens.key_file(tmp_path / "key.json")  # the key rotated: new credentials
    await roundtrip(ckptstore_gcs_bucket, endpoint, key)
    assert tokens.requests == 2


async def test_default_credentials_follow_the_environment(
    tokens: TokenServer,
    ckptstore_gcs_server: Any,
    ckptstore_gcs_bucket: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    endpoint = ckptstore_gcs_server.endpoint
    first = tokens.key_file(tmp_path / "first.json")
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(first))
    await roundtrip(ckptstore_gcs_bucket, endpoint, "default")
    await roundtrip(ckptstore_gcs_bucket, endpoint, "default")
    assert tokens.requests == 1
    second = tokens.key_file(tmp_path / "second.json")
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(second))
    await roundtrip(ckptstore_gcs_bucket, endpoint, "default")
    assert tokens.requests == 2


def test_the_kept_keys_are_digests(tmp_path: Path) -> None:
    """Nothing of a key file (its path, its private key) is kept, only a digest of it."""
    key = tmp_path / "secret-name.json"
    key.write_text('{"private_key": "-----BEGIN PRIVATE KEY-----SECRET"}')
    found = gcscreds.source_key(str(key))
    assert len(found) == 64 and int(found, 16) >= 0
    assert "secret" not in found.lower() and found != gcscreds.source_key("default")
    key.write_text('{"private_key": "-----BEGIN PRIVATE KEY-----OTHER"}')
    assert gcscreds.source_key(str(key)) != found
