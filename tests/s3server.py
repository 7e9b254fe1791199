"""A real S3 server for the remote-tier tests: moto's server mode on 127.0.0.1, started once per session.

Each test gets its own bucket (:func:`s3_bucket` in conftest.py) and the standard AWS variables in its
environment (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_DEFAULT_REGION``),
which the ranks and their persister inherit: snapckpt reaches the server the way it reaches any
S3-compatible store, with no test hook. moto accepts any credentials by default; :func:`enforce_auth`
turns on its IAM authentication (``/moto-api/reset-auth``) for a test of wrong credentials.
"""
from __future__ import annotations

import contextlib
import threading
import urllib.request
import uuid
from dataclasses import dataclass
from typing import Dict, List, Optional

from _harness import free_port

_lock = threading.Lock()
_server = None
_endpoint: Optional[str] = None

#: The fake credentials every test uses (moto accepts any).
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "snapckpt-test-key", "AWS_SECRET_ACCESS_KEY": "snapckpt-test-secret",
               "AWS_DEFAULT_REGION": "us-east-1"}


def endpoint() -> str:
    """The server's URL, starting it on a free port of 127.0.0.1 on first use (it lives until the session
    ends: its threads are daemons)."""
    global _server, _endpoint
    with _lock:
        if _server is None:
            import logging
            from moto.server import ThreadedMotoServer
            logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
            port = free_port(session=True)  # bound for the session: reserved as long
            _server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
            _server.start()
            _endpoint = f"http://127.0.0.1:{port}"
        return _endpoint


def stop() -> None:
    """Stop the server (end of the session)."""
    global _server
    with _lock:
        if _server is not None:
            _server.stop()
            _server = None


@contextlib.contextmanager
def enforce_auth():
    """While inside, the server authenticates every S3 request against its IAM users (moto's
    ``INITIAL_NO_AUTH_ACTION_COUNT``, set through ``POST /moto-api/reset-auth``): no key is known to it, so
    every key is refused with ``403 InvalidAccessKeyId``, as AWS refuses a wrong key. Afterwards it
    accepts any key again."""
    def reset(count: str) -> None:
        # text/plain: a form content type would leave moto's request.data empty
        urllib.request.urlopen(urllib.request.Request(f"{endpoint()}/moto-api/reset-auth", data=count.encode(),
                                                      headers={"Content-Type": "text/plain"}, method="POST"),
                               timeout=10).read()

    reset("0")
    try:
        yield
    finally:
        reset("inf")


@dataclass
class Bucket:
    """One test's bucket on the server."""

    name: str
    endpoint: str
    client: object  # a boto3 S3 client

    def url(self, prefix: str = "run") -> str:
        return f"s3://{self.name}/{prefix}"

    def keys(self, prefix: str = "") -> Dict[str, int]:
        """``{key: size}`` of every object under ``prefix``."""
        out: Dict[str, int] = {}
        token = None
        while True:
            kw = {"Bucket": self.name, "Prefix": prefix}
            if token:
                kw["ContinuationToken"] = token
            reply = self.client.list_objects_v2(**kw)
            for o in reply.get("Contents", []):
                out[o["Key"]] = o["Size"]
            if not reply.get("IsTruncated"):
                return out
            token = reply["NextContinuationToken"]

    def get(self, key: str) -> bytes:
        return self.client.get_object(Bucket=self.name, Key=key)["Body"].read()

    def multipart_uploads(self, prefix: str = "") -> List[str]:
        return [u["Key"] for u in self.client.list_multipart_uploads(Bucket=self.name, Prefix=prefix)
                .get("Uploads", [])]


def new_bucket() -> Bucket:
    """A fresh bucket on the session's server."""
    import boto3
    ep = endpoint()
    client = boto3.client("s3", endpoint_url=ep, aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
                          aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"], region_name="us-east-1")
    name = f"snap-{uuid.uuid4().hex[:12]}"
    client.create_bucket(Bucket=name)
    return Bucket(name, ep, client)


class FaultProxy:
    """A TCP proxy on 127.0.0.1 in front of the S3 server that fails on demand: ``mode`` is ``"pass"``
    (bytes piped both ways), ``"503"`` (each request answered ``503 Slow Down``, then the connection
    closed), ``"reset"`` (each connection closed at once, a reset for the client) or ``"stall"`` (each
    connection accepted and never answered, a hung server). ``failed`` counts
    the connections it failed. Setting ``mode`` affects new connections only; :meth:`fail` also cuts the
    connections the client keeps alive (a server that went down under a transfer)."""

    def __init__(self, target: str) -> None:
        import socket
        host, port = target.rsplit("//", 1)[1].split(":")
        self.target = (host, int(port))
        self.mode = "pass"
        self.failed = 0
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self.endpoint = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._stop = False
        self._live: set = set()  # the sockets of piped connections
        self._held: list = []  # the connections of mode "stall"
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self._stop = True
        self._sock.close()
        for c in self._held:
            c.close()

    def fail(self, mode: str) -> None:
        """Fail every new connection the ``mode`` way and reset the live ones (requests in flight fail), the
        held ones of mode ``"stall"`` too (``fail("pass")``: a hung server that answers again)."""
        import socket
        import struct
        self.mode = mode
        held, self._held = self._held, []
        for c in held:
            c.close()
        for s in list(self._live):
            try:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _accept(self) -> None:
        while not self._stop:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn) -> None:
        import socket
        import struct
        mode = self.mode
        if mode == "reset":
            self.failed += 1
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # RST, not FIN
            conn.close()
            return
        if mode == "stall":  # accepted, never answered (a hung server): held until the proxy closes
            self.failed += 1
            self._held.append(conn)
            return
        if mode == "503":
            self.failed += 1
            conn.settimeout(5)
            try:
                head = conn.recv(65536)
                body = b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"
                conn.sendall(b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nConnection: close\r\n"
                             b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n"
                             + (b"" if head.startswith(b"HEAD ") else body))  # a HEAD answer has no body
            except OSError:
                pass
            conn.close()
            return
        up = socket.create_connection(self.target)
        self._live.update((conn, up))

        def pipe(a, b):
            try:
                while True:
                    data = a.recv(1 << 16)
                    if not data:
                        break
                    b.sendall(data)
            except OSError:
                pass
            finally:
                for s in (a, b):
                    self._live.discard(s)
                    try:
                        s.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass

        threading.Thread(target=pipe, args=(up, conn), daemon=True).start()
        pipe(conn, up)
