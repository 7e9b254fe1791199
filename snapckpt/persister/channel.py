"""The persisters' peer channel: TCP between the node persisters of one job, authenticated per run.

Sequence of a connection (both sides know the run's secret, 32 random bytes that global rank 0 drew and
shared through the job's rendezvous store, never written to disk):

1. the server sends ``MAGIC`` (which names the peer protocol's version, :data:`PEER_PROTOCOL`) and a 32-byte
   random challenge; a client of another version refuses it with :class:`PeerVersionError`;
2. the client answers with its run id (a framed header) and ``HMAC-SHA256(secret, b"client" + challenge)``,
   then its own 32-byte challenge;
3. the server looks up that run's secret, compares with :func:`hmac.compare_digest` and, on success,
   answers ``HMAC-SHA256(secret, b"server" + client challenge)``, which the client checks the same way.
   A wrong or unknown secret is refused: the server closes the connection and logs it (the address and
   the run named); nothing else is read from it.

After that, messages are frames: a 12-byte prefix (header length, payload length: ``!IQ``), a JSON header
(never a pickle) and ``payload length`` raw bytes. Large payloads are sent with ``sendall`` of
``memoryview`` slices of the slot mapping and received with ``recv_into`` straight into the destination
mapping: no extra full copy on either side.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import socket
import struct
from typing import Any, Callable, Dict, Optional, Tuple

__all__ = ["AuthError", "ChannelError", "PeerVersionError", "PEER_PROTOCOL", "server_handshake", "client_handshake", "send_frame", "recv_header",
           "recv_payload_into", "send_payload", "CHUNK_NBYTES", "connect"]

#: The peer channel's version: bumped whenever a frame's fields change meaning (2: commit notices carry the save's
#: generation; 3: that generation counts on past a node's pruned records, and the part markers that the committer's
#: node reads name it, ``collect_parts``). Persisters of two versions cannot work together: a notice of one is
#: misread by the other.
PEER_PROTOCOL = 3
_MAGIC_PREFIX = b"SNAPCKPT-PEER"
MAGIC = _MAGIC_PREFIX + b"%d\n" % PEER_PROTOCOL  # the same length as version 1's for versions below 10
_PREFIX = struct.Struct("!IQ")
MAX_HEADER_NBYTES = 1 << 20
CHUNK_NBYTES = 16 << 20  # hashing and socket calls work on slices of this size
HANDSHAKE_TIMEOUT_SECS = 10.0


class ChannelError(OSError):
    """The peer channel broke or the peer sent something malformed."""


class AuthError(ChannelError):
    """The peer did not prove that it knows this run's secret (or this side does not know its run)."""


class PeerVersionError(AuthError):
    """The peer persister speaks another version of the peer protocol (its node runs another snapckpt version):
    nothing is exchanged with it. Not retried, like :class:`AuthError`."""


def _mac(secret: bytes, role: bytes, challenge: bytes) -> bytes:
    return hmac.new(secret, role + challenge, hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ChannelError(f"peer closed the connection ({got} of {n} bytes received)")
        got += k
    return bytes(buf)


def send_frame(sock: socket.socket, header: Dict[str, Any], payload_nbytes: int = 0) -> None:
    """Send one frame's prefix and JSON ``header``; the caller then sends ``payload_nbytes`` bytes
    (:func:`send_payload`)."""
    data = json.dumps(header, separators=(",", ":")).encode()
    sock.sendall(_PREFIX.pack(len(data), payload_nbytes) + data)


def recv_header(sock: socket.socket) -> Tuple[Dict[str, Any], int]:
    """Receive one frame's header: ``(header dict, payload length in bytes)``.

    Raises:
        ChannelError: the peer closed the connection, or sent an oversized or non-JSON header.
    """
    hlen, plen = _PREFIX.unpack(_recv_exact(sock, _PREFIX.size))
    if hlen > MAX_HEADER_NBYTES:
        raise ChannelError(f"peer sent a {hlen}-byte header (at most {MAX_HEADER_NBYTES})")
    try:
        header = json.loads(_recv_exact(sock, hlen))
    except ValueError as e:
        raise ChannelError(f"peer sent a header that is not JSON: {str(e)[:200]}") from e
    if not isinstance(header, dict):
        raise ChannelError("peer sent a header that is not a JSON object")
    return header, plen


def send_payload(sock: socket.socket, view: memoryview, hasher: Optional[Any] = None) -> None:
    """``sendall`` ``view`` in :data:`CHUNK_NBYTES` slices (no copy), feeding ``hasher`` (``.update``)."""
    for start in range(0, len(view), CHUNK_NBYTES):
        piece = view[start:start + CHUNK_NBYTES]
        if hasher is not None:
            hasher.update(piece)
        sock.sendall(piece)


def recv_payload_into(sock: socket.socket, view: memoryview, hasher: Optional[Any] = None) -> None:
    """Receive exactly ``len(view)`` bytes into ``view`` (``recv_into``, no copy), feeding ``hasher``.

    Raises:
        ChannelError: the peer closed the connection first.
    """
    n, got, hashed = len(view), 0, 0
    while got < n:
        k = sock.recv_into(view[got:], min(n - got, CHUNK_NBYTES))
        if k == 0:
            raise ChannelError(f"peer closed the connection ({got} of {n} payload bytes received)")
        got += k
        if hasher is not None and (got - hashed >= CHUNK_NBYTES or got == n):
            hasher.update(view[hashed:got])
            hashed = got


def server_handshake(sock: socket.socket, secret_of: Callable[[str], Optional[bytes]]) -> str:
    """Authenticate a connection that this side accepted; return the run id the peer proved.

    Args:
        secret_of: the secret of a run id, ``None`` for a run this persister does not serve.

    Raises:
        AuthError: unknown run, or the peer's answer does not match the secret.
        ChannelError / OSError: the connection broke or timed out (``HANDSHAKE_TIMEOUT_SECS``).
    """
    sock.settimeout(HANDSHAKE_TIMEOUT_SECS)
    challenge = os.urandom(32)
    sock.sendall(MAGIC + challenge)
    header, plen = recv_header(sock)
    if plen != 64:
        raise AuthError("the peer's handshake has no answer")
    answer = _recv_exact(sock, 64)
    run_id = str(header.get("run_id", ""))
    secret = secret_of(run_id)
    if secret is None:
        raise AuthError(f"the peer named run {run_id[:64]!r}, which this persister does not replicate")
    if not hmac.compare_digest(answer[:32], _mac(secret, b"client", challenge)):
        raise AuthError(f"the peer does not know the secret of run {run_id}")
    sock.sendall(_mac(secret, b"server", answer[32:]))
    sock.settimeout(None)
    return run_id


def client_handshake(sock: socket.socket, run_id: str, secret: bytes) -> None:
    """Authenticate to the persister at the other end of ``sock`` as a peer of ``run_id``, and check
    that it knows the secret too.

    Raises:
        AuthError: the server refused us (closed the connection) or could not prove the secret.
        ChannelError / OSError: the connection broke or timed out.
    """
    sock.settimeout(HANDSHAKE_TIMEOUT_SECS)
    hello = _recv_exact(sock, len(MAGIC) + 32)
    if hello[:len(MAGIC)] != MAGIC:
        if hello.startswith(_MAGIC_PREFIX):
            theirs = hello[len(_MAGIC_PREFIX):].split(b"\n", 1)[0].decode("ascii", "replace")
            raise PeerVersionError(
                f"the peer persister speaks peer protocol {theirs}, this one {PEER_PROTOCOL}: the job's nodes run "
                "different snapckpt versions; install one version on every node and restart the job (a persister "
                "that outlived its ranks: `snapckpt stop CHECKPOINT_DIR` on its node)")
        raise ChannelError("the peer is not a snapckpt persister")
    mine = os.urandom(32)
    send_frame(sock, {"run_id": run_id}, 64)
    sock.sendall(_mac(secret, b"client", hello[len(MAGIC):]) + mine)
    try:
        proof = _recv_exact(sock, 32)
    except ChannelError as e:
        raise AuthError(f"the peer refused this persister's secret for run {run_id}") from e
    if not hmac.compare_digest(proof, _mac(secret, b"server", mine)):
        raise AuthError(f"the peer could not prove the secret of run {run_id}")
    sock.settimeout(None)


def connect(addr: str, port: int, run_id: str, secret: bytes, timeout_secs: float = 10.0) -> socket.socket:
    """Open an authenticated connection to the peer persister at ``addr:port`` (see :func:`client_handshake`).

    Raises:
        AuthError, ChannelError, OSError: as :func:`client_handshake`, or the peer is unreachable.
    """
    sock = socket.create_connection((addr, port), timeout=timeout_secs)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        client_handshake(sock, run_id, secret)
    except BaseException:
        sock.close()
        raise
    return sock
