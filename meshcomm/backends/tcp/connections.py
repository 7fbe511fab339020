"""Connection set-up of the tcp transport: sockets, handshakes, and the shared-memory offer.

:class:`Connections` is the socket carrier a :class:`~meshcomm.backends.tcp.transport.Transport`
holds beside its ring carrier (:class:`~meshcomm.backends.tcp.same_host.engine.ShmEngine`): it
opens,
accepts, writes, reads and drops the sockets. Connections open on first use: the sender of the
first message to a peer looks up its address in the store, connects, and says HELLO; the
peer answers ACCEPT or REJECT. When two ranks connect to each other at once, the connection
opened by the lower rank is kept and the other is refused as a duplicate.

The accepting side's screening (the HELLO, and with a secret the AUTH exchange of
:mod:`~meshcomm.backends.tcp.link_auth`) runs on the listener thread
(:mod:`~meshcomm.backends.tcp.listener`); the engine takes the screened connections and
decides ACCEPT or REJECT (a duplicate, a closed peer), since only it knows its connections.
The connecting side's AUTH exchange runs here, in the engine.

A peer's EOF between frames is only an error if this rank still needs it, now or later;
during a frame, or on a reset, it is a :class:`~meshcomm.errors.PeerError` naming the peer
(:class:`~meshcomm.backends.tcp.faults.Faults` says who to blame).

Shared memory is agreed in the handshake: a HELLO with ``F_SHM`` carries the sender's host
key; the acceptor answers ACCEPT with ``F_SHM`` when the keys match and it wants shared
memory too. Then both sides run :class:`~meshcomm.backends.tcp.same_host.rings.ShmHandshake` over
SHM
frames before any data moves (data for the peer waits in its send queue meanwhile)::

    each side sends   SHM_OFFER (or SHM_NO_OFFER: it could not create its ring)
    on the peer's     SHM_OFFER: accept it, send SHM_ACK (an ack, or a nack saying why);
                      SHM_NO_OFFER: give up, use the socket
    on the peer's     SHM_ACK: both acks ok -> shared memory, else the socket

Both sides see the same two messages, so they agree without another round. The socket stays
open either way: it carries GOODBYE and reports the peer's death (EOF).
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import time
from collections import deque
from collections.abc import Sequence

from meshcomm.backends.tcp import wire
from meshcomm.backends.tcp.abort import AbortRecord
from meshcomm.backends.tcp.addresses import addr_key, split_address, tune
from meshcomm.backends.tcp.faults import GOODBYE, NO_GOODBYE, Faults
from meshcomm.backends.tcp.link_auth import (
    AUTH_REASON,
    acceptor_proof,
    connector_proof,
    link_context,
    matches,
    new_nonce,
)
from meshcomm.backends.tcp.listener import LinkListener
from meshcomm.backends.tcp.matching import CONTROL, PLAIN, Matching, Recv, Send
from meshcomm.backends.tcp.same_host.engine import ShmEngine
from meshcomm.backends.tcp.same_host.rings import ShmHandshake, ShmPair
from meshcomm.backends.tcp.waiting import ABORT_CHECK_INTERVAL, CONNECT_ATTEMPT, Progress
from meshcomm.errors import (
    CommError,
    CommTimeout,
    LinkAuthError,
    PeerError,
    ProtocolError,
    StoreError,
)
from meshcomm.store.base import Store

__all__ = ["Channel", "Connections", "ShmMessage", "ShmSetup"]

_CONNECTING = "connecting"  # we connected and sent HELLO; waiting for ACCEPT/REJECT
_ACCEPTING = "accepting"  # accepted; waiting for the peer's HELLO
_OPEN = "open"
_CLOSED = "closed"


class Channel:
    """One socket to a peer, with its decoder, the frame being received, and control frames."""

    __slots__ = (
        "address",
        "authed",
        "ctrl",
        "current",
        "decoder",
        "goodbye",
        "hello_flags",
        "nonce",
        "peer",
        "sock",
        "state",
        "writing",
    )

    def __init__(self, sock: socket.socket, state: str, peer: int, address: str) -> None:
        self.sock = sock
        self.state = state
        self.peer = peer  # -1 until an accepted peer says who it is
        self.address = address
        self.decoder = wire.Decoder()
        self.current: object = None
        self.goodbye = False
        self.writing = False
        self.ctrl: deque[Send] = deque()  # SHM handshake frames: they go before any data
        self.nonce = b""  # our HELLO's nonce (connecting with a secret)
        self.hello_flags = 0  # our HELLO's flags
        self.authed = False  # the acceptor proved the secret (connecting with a secret)


class ShmMessage:
    """An SHM frame being received (its payload goes to ``buf``)."""

    __slots__ = ("buf", "tag")

    def __init__(self, tag: int, length: int) -> None:
        self.tag = tag
        self.buf = bytearray(length)


class ShmSetup:
    """A shared-memory handshake in progress with one peer."""

    __slots__ = ("ch", "got_offer", "hs", "why_not")

    def __init__(self, ch: Channel) -> None:
        self.ch = ch
        self.hs: ShmHandshake | None = None
        self.got_offer = False
        self.why_not = "this side"  # why this side made no offer, when it made none


class Connections:
    """The sockets of one transport: opening, accepting, writing, reading and dropping them.

    Args:
        rank: this process's global rank.
        size: the world size.
        timeout: seconds without progress before ``CommTimeout``.
        store: the job's store (peers' addresses).
        token: the job token.
        secret: the job's secret, or None (links are then not authenticated).
        links: the listener thread's end (screened connections).
        rejected: where reasons of refused handshakes go (the listener's list too).
        progress: the transport's counters.
        matching: where frames find their receives.
        rings: the ring carrier (pairs agreed here are attached there).
        faults: the transport's failure path.
        sendq: the transport's send queues, by peer (shared with the ring carrier).
        host_key: this host's key when shared memory is wanted, else None.

    Attributes:
        conns: open connections, by peer (a shared-memory peer's socket too).
        tcp: the connections whose peer's data takes the socket.
        setup: shared-memory handshakes in progress, by peer.
        rejected: reasons of handshakes this rank refused (foreign or stale peers).
        shm_fallbacks: why shared memory was not used with a same-host peer, by peer.
    """

    def __init__(
        self,
        rank: int,
        size: int,
        timeout: float,
        store: Store,
        token: bytes,
        secret: bytes | None,
        links: LinkListener,
        rejected: list[str],
        progress: Progress,
        matching: Matching,
        rings: ShmEngine,
        faults: Faults,
        sendq: dict[int, deque[Send]],
        host_key: str | None,
    ) -> None:
        self.rank = rank
        self.size = size
        self.timeout = timeout
        self.rejected = rejected
        self.shm_fallbacks: dict[int, str] = {}
        self.conns: dict[int, Channel] = {}
        self.tcp: dict[int, Channel] = {}
        self.setup: dict[int, ShmSetup] = {}
        self._connecting: dict[int, Channel] = {}
        self._accepting: set[Channel] = set()
        self._awaiting: set[int] = set()  # our connect was refused as a duplicate: theirs comes
        self._store = store
        self._token = token
        self._secret = secret
        self._links = links
        self._progress = progress
        self._matching = matching
        self._rings = rings
        self._faults = faults
        self._sendq = sendq
        self._shm_wanted = host_key is not None
        self._host_key = host_key or ""
        self._sel = selectors.DefaultSelector()
        self._sel.register(links.wake, selectors.EVENT_READ, None)  # data None: parked

    # -- opening -----------------------------------------------------------------------------
    def ensure(self, peer: int) -> None:
        if self._links.parked:
            self._accept()  # the peer's own connection may be waiting: no duplicate then
            ch = self.tcp.get(peer)
            if ch is not None:
                self._want_write(ch, True)  # the caller queues its send behind this call
        if peer in self.conns or peer in self._connecting or peer in self._awaiting:
            return  # open (shared memory being set up), or on its way
        if peer in self._faults.gone:
            raise self._faults.gone_error(peer, "send to")
        self._connect(peer)

    def _connect(self, peer: int) -> None:
        deadline = time.monotonic() + self.timeout
        delay = 0.01
        address = "?"
        while True:
            remaining = deadline - time.monotonic()
            address = self._lookup(peer, max(remaining, 0.001))
            host, port = split_address(address)
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_STREAM)
            try:
                tune(sock)
                sock.settimeout(max(0.001, min(remaining, CONNECT_ATTEMPT)))
                sock.connect((host, port))
                break
            except OSError as exc:
                sock.close()
                remaining = deadline - time.monotonic()
                if remaining <= delay:
                    message = (
                        f"rank {self.rank}: could not connect to rank {peer} at {address} "
                        f"within {self.timeout:g} s: {exc}"
                    )
                    if isinstance(exc, TimeoutError):
                        raise CommTimeout(message) from None
                    raise PeerError(message, peer) from None
            if time.monotonic() - self._progress.last_abort_check >= ABORT_CHECK_INTERVAL:
                self._progress.last_abort_check = time.monotonic()
                self._faults.check_abort()
            time.sleep(delay)
            delay = min(2 * delay, 0.5)
        sock.setblocking(False)
        ch = Channel(sock, _CONNECTING, peer, address)
        flags = wire.F_SHM if self._shm_wanted else 0
        if self._secret is not None:
            flags |= wire.F_AUTH
            ch.nonce = new_nonce()
        ch.hello_flags = flags
        hello = wire.encode_hello(
            wire.HELLO,
            rank=self.rank,
            world_size=self.size,
            token=self._token,
            flags=flags,
            reason=self._host_key if flags & wire.F_SHM else "",
            nonce=ch.nonce,
        )
        try:
            sock.send(hello)  # a fresh socket's buffer always takes a handshake
        except OSError as exc:
            sock.close()
            raise PeerError(
                f"rank {self.rank}: rank {peer} at {address} dropped the connection: {exc}", peer
            ) from None
        self._sel.register(sock, selectors.EVENT_READ, ch)
        self._connecting[peer] = ch
        self._progress.moved = True

    def _lookup(self, peer: int, timeout: float) -> str:
        key = addr_key(peer)
        try:
            self._store.wait([key], timeout=timeout)
            return self._store.get(key).decode()
        except StoreError as exc:
            raise CommTimeout(
                f"rank {self.rank}: rank {peer} did not publish its address ({key!r}) within "
                f"{self.timeout:g} s: {exc}"
            ) from None

    def _accept(self) -> None:
        """Take the connections the listener thread screened, and answer each."""
        for parked in self._links.take():
            ch = Channel(parked.sock, _ACCEPTING, -1, parked.address)
            ch.decoder = wire.Decoder(handshake=False)  # the handshake was read already
            self._sel.register(parked.sock, selectors.EVENT_READ, ch)
            self._progress.moved = True
            self._admit(ch, parked.hello)

    def _on_hello(self, ch: Channel, hello: wire.Hello) -> None:
        if ch.state is not _CONNECTING:
            raise ProtocolError(f"a second handshake from rank {ch.peer}")
        self._on_answer(ch, hello)

    def _admit(self, ch: Channel, hello: wire.Hello) -> None:
        """Answer a screened HELLO: ACCEPT, or REJECT a duplicate or a closed peer."""
        peer = hello.rank
        if peer in self._faults.gone:
            self._reject(ch, f"rank {peer} already closed its connection to rank {self.rank}")
            return
        mine = self._connecting.get(peer)
        if peer in self.conns or (mine is not None and self.rank < peer):
            # Both connected at once: the connection the lower rank opened is the one kept.
            self._reject(ch, f"duplicate connection from rank {peer} to rank {self.rank}")
            return
        if mine is not None:
            self._drop(mine)  # theirs wins: the lower rank opened it
        self._awaiting.discard(peer)
        use_shm = (
            self._shm_wanted and bool(hello.flags & wire.F_SHM) and hello.reason == self._host_key
        )
        answer = wire.encode_hello(
            wire.ACCEPT,
            rank=self.rank,
            world_size=self.size,
            token=self._token,
            flags=wire.F_SHM if use_shm else 0,
        )
        try:
            ch.sock.send(answer)
        except OSError:
            self._drop(ch)
            return
        self._opened(ch, peer, use_shm)

    def _on_answer(self, ch: Channel, hello: wire.Hello) -> None:
        peer = ch.peer
        if hello.kind == wire.AUTH:
            self._on_auth(ch, hello)
            return
        if hello.kind == wire.REJECT:
            self._drop(ch)
            if hello.reason.startswith("duplicate connection"):
                self._awaiting.add(peer)  # the peer's own connection to us is on its way
                return
            if hello.reason.startswith(AUTH_REASON):
                raise self._auth_failed(ch, f"it refused this rank: {hello.reason}")
            raise ProtocolError(
                f"rank {self.rank}: rank {peer} at {ch.address} refused the connection: "
                f"{hello.reason}"
            )
        wire.check_hello(
            hello,
            kinds=[wire.ACCEPT],
            token=self._token,
            world_size=self.size,
            peer=f"rank {peer} at {ch.address}",
            expect_rank=peer,
        )
        if self._secret is not None and not ch.authed:
            raise self._auth_failed(ch, "it accepted without proving it holds the job's secret")
        use_shm = bool(hello.flags & wire.F_SHM)
        if use_shm and not self._shm_wanted:
            raise ProtocolError(
                f"rank {self.rank}: rank {peer} at {ch.address} took a shared-memory offer "
                "that was never made"
            )
        del self._connecting[peer]
        self._opened(ch, peer, use_shm)

    def _on_auth(self, ch: Channel, auth: wire.Hello) -> None:
        """Check the acceptor's proof; answer with ours; the ACCEPT or REJECT comes next."""
        peer = ch.peer
        if self._secret is None or ch.authed:
            raise ProtocolError(
                f"rank {self.rank}: rank {peer} at {ch.address} sent an AUTH that was not asked for"
            )
        wire.check_hello(
            auth,
            kinds=[wire.AUTH],
            token=self._token,
            world_size=self.size,
            peer=f"rank {peer} at {ch.address}",
            expect_rank=peer,
        )
        context = link_context(
            self._token,
            self.size,
            connector=self.rank,
            acceptor=peer,
            address=ch.address,
            flags=ch.hello_flags,
            host_key=self._host_key if ch.hello_flags & wire.F_SHM else "",
        )
        if not matches(acceptor_proof(self._secret, context, ch.nonce, auth.nonce), auth.proof):
            raise self._auth_failed(
                ch,
                "its proof does not match this rank's secret (the ranks were given different "
                "secrets, or another process answers at that address)",
            )
        ch.authed = True
        answer = wire.encode_auth(
            rank=self.rank,
            world_size=self.size,
            token=self._token,
            nonce=ch.nonce,
            proof=connector_proof(self._secret, context, ch.nonce, auth.nonce),
        )
        ch.ctrl.append(Send(peer, [answer], len(answer), CONTROL))
        self._flush(ch)
        ch.decoder.expect_handshake()

    def _auth_failed(self, ch: Channel, why: str) -> LinkAuthError:
        """Drop a link that failed authentication; tell the job; return the error to raise."""
        peer = ch.peer
        self._drop(ch)
        reason = (
            f"rank {peer} at {ch.address} failed link authentication with rank {self.rank}: {why}"
        )
        # Every rank of the job fails within about a second instead of at its timeout.
        self._faults.publish_abort(AbortRecord(peer, reason))
        return LinkAuthError(f"rank {self.rank}: {reason}", peer, ch.address)

    def _opened(self, ch: Channel, peer: int, use_shm: bool) -> None:
        self._accepting.discard(ch)
        ch.peer = peer
        ch.state = _OPEN
        self.conns[peer] = ch
        if use_shm:
            self._begin_shm(ch)
            return
        self.tcp[peer] = ch
        if self._sendq.get(peer):
            self._flush(ch)

    def _reject(self, ch: Channel, reason: str) -> None:
        self.rejected.append(reason)
        del self.rejected[:-16]
        answer = wire.encode_hello(
            wire.REJECT, rank=self.rank, world_size=self.size, token=wire.NO_TOKEN, reason=reason
        )
        with contextlib.suppress(OSError):
            ch.sock.send(answer)
        self._drop(ch)

    def _drop(self, ch: Channel) -> None:
        if ch.state is _CLOSED:
            return
        peer = ch.peer
        self._accepting.discard(ch)
        if self.conns.get(peer) is ch:
            del self.conns[peer]
            self.tcp.pop(peer, None)
            setup = self.setup.pop(peer, None)
            if setup is not None and setup.hs is not None:
                setup.hs.close()
            self._rings.detach(peer)
        if self._connecting.get(peer) is ch:
            del self._connecting[peer]
        ch.state = _CLOSED
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(ch.sock)
        # Read what is left so close() sends FIN, not RST (RST can destroy data in flight).
        with contextlib.suppress(OSError):
            ch.sock.setblocking(False)
            while ch.sock.recv(65536):
                pass
        ch.sock.close()

    # -- shared memory -------------------------------------------------------------------------
    def _begin_shm(self, ch: Channel) -> None:
        setup = ShmSetup(ch)
        try:
            setup.hs = ShmHandshake(self._rings.own_doorbell(), ch.peer)
            tag, payload = wire.SHM_OFFER, setup.hs.offer()
        except (CommError, OSError) as exc:  # e.g. /dev/shm is full, the ring budget spent
            setup.why_not = str(exc)
            tag, payload = wire.SHM_NO_OFFER, str(exc).encode()[: wire.MAX_SHM_MESSAGE]
        self.setup[ch.peer] = setup
        self._send_control(ch, tag, payload)

    def _send_control(self, ch: Channel, tag: int, payload: bytes) -> None:
        frame = wire.encode_header(wire.SHM, comm_id=0, tag=tag, length=len(payload)) + payload
        ch.ctrl.append(Send(ch.peer, [frame], len(frame), CONTROL))
        self._flush(ch)

    def _on_shm_message(self, ch: Channel, msg: ShmMessage) -> None:
        peer = ch.peer
        setup = self.setup.get(peer)
        if setup is None or setup.ch is not ch:
            raise ProtocolError(f"rank {self.rank}: unexpected SHM frame from rank {peer}")
        payload = bytes(msg.buf)
        if msg.tag in (wire.SHM_OFFER, wire.SHM_NO_OFFER):
            if setup.got_offer:
                raise ProtocolError(f"rank {self.rank}: rank {peer} offered shared memory twice")
            setup.got_offer = True
            hs = setup.hs
            if msg.tag == wire.SHM_NO_OFFER or hs is None:
                why = payload.decode(errors="replace") if hs is not None else setup.why_not
                self._end_shm(ch, None, f"no offer ({why})")
                return
            try:
                hs.accept(payload)
                answer = hs.ack()
            except CommError as exc:  # another host after all, a bad offer: both fall back
                answer = hs.nack(str(exc))
            self._send_control(ch, wire.SHM_ACK, answer)
        elif msg.tag == wire.SHM_ACK:
            if not setup.got_offer or setup.hs is None:
                raise ProtocolError(f"rank {self.rank}: SHM ack from rank {peer} before an offer")
            try:
                pair = setup.hs.complete(payload)
            except ProtocolError:
                raise
            except CommError as exc:  # either side failed: complete() released everything
                self._end_shm(ch, None, str(exc))
                return
            self._end_shm(ch, pair, "")
        else:
            raise ProtocolError(f"rank {self.rank}: SHM frame with tag {msg.tag} from rank {peer}")

    def _end_shm(self, ch: Channel, pair: ShmPair | None, reason: str) -> None:
        peer = ch.peer
        setup = self.setup.pop(peer)
        self._progress.moved = True
        if pair is not None:
            self._rings.attach(peer, pair)
            return
        if setup.hs is not None:
            setup.hs.close()
        self.shm_fallbacks[peer] = reason
        self.tcp[peer] = ch
        if self._sendq.get(peer):
            self._flush(ch)

    @property
    def screening(self) -> int:
        """Connections the listener thread is screening now."""
        return self._links.screening

    # -- the carrier -------------------------------------------------------------------------
    def post(self, s: Send) -> None:
        """Write ``s`` to its peer's socket as far as it goes now; queue the rest (opening
        the connection first when there is none)."""
        peer = s.peer
        queue = self._sendq.get(peer)
        ch = self.tcp.get(peer)
        if ch is not None and not queue:
            bufs = s.bufs
            try:
                sent = ch.sock.send(bufs[0]) if len(bufs) == 1 else ch.sock.sendmsg(bufs)
            except BlockingIOError:
                sent = 0
            except OSError as exc:
                raise self._lost(ch, exc) from None
            if sent == s.left:
                s.left = 0
                return
            if sent:
                s.advance(sent)
                self._progress.moved = True
        if ch is not None:
            self._want_write(ch, True)
        else:
            self.ensure(peer)
        if queue is None:
            queue = self._sendq[peer] = deque()
        queue.append(s)
        self._progress.pending += 1

    def pending(self, sends: Sequence[Send], recvs: Sequence[Recv]) -> bool:
        """Whether an operation of the call (or a connection being set up) needs a socket."""
        if self._connecting or self._awaiting or self.setup or self._accepting:
            return True
        shm = self._rings.peers
        me = self.rank
        for s in sends:
            if s.left and s.peer != me and s.peer not in shm:
                return True
        for r in recvs:
            if not r.done and r.src not in shm:
                return True
        return any(ch.writing or ch.decoder.in_frame for ch in self.tcp.values())

    def flush_control(self) -> None:
        """Write the set-up frames the sockets owe their peers, as far as possible."""
        for ch in self.conns.values():
            if ch.ctrl:
                self._flush(ch)

    def waits_on(self, peer: int) -> bool:
        """Whether a send to ``peer`` waits in its queue."""
        return bool(self._sendq.get(peer))

    def unconnected(self, peers: Sequence[int]) -> list[int]:
        """Those of ``peers`` (global ranks, not this one) with no open connection."""
        return [p for p in peers if p >= 0 and p != self.rank and p not in self.conns]

    # -- writing -----------------------------------------------------------------------------
    def _flush(self, ch: Channel) -> None:
        sock = ch.sock
        for queue, control in ((ch.ctrl, True), (self._sendq.get(ch.peer), False)):
            if control is False and ch.peer not in self.tcp:
                break  # data waits for the shared-memory set-up to end
            while queue:
                s = queue[0]
                bufs = s.bufs
                try:
                    sent = sock.send(bufs[0]) if len(bufs) == 1 else sock.sendmsg(bufs)
                except BlockingIOError:
                    self._want_write(ch, True)
                    return
                except OSError as exc:
                    raise self._lost(ch, exc) from None
                self._progress.moved = True
                if sent < s.left:
                    s.advance(sent)
                    self._want_write(ch, True)
                    return
                queue.popleft()
                s.left = 0
                if s.kind == PLAIN:
                    self._progress.pending -= 1
        self._want_write(ch, False)

    def _want_write(self, ch: Channel, on: bool) -> None:
        if ch.writing != on:
            ch.writing = on
            events = selectors.EVENT_READ | (selectors.EVENT_WRITE if on else 0)
            self._sel.modify(ch.sock, events, ch)

    # -- reading -----------------------------------------------------------------------------
    def select(self, timeout: float) -> None:
        """Serve the sockets that are ready (waiting up to ``timeout`` seconds for one):
        take screened connections, read, and write what waits for room."""
        for key, mask in self._sel.select(timeout):
            ch = key.data
            if ch is None:
                self._accept()
                continue
            if ch.state is _CLOSED:  # dropped earlier in this batch (duplicate, EOF)
                continue
            if mask & selectors.EVENT_READ:
                self._read(ch)
            if mask & selectors.EVENT_WRITE and ch.state is _OPEN:
                self._flush(ch)

    def _read(self, ch: Channel) -> None:
        dec = ch.decoder
        recv_into = ch.sock.recv_into
        while True:
            view = dec.recv_view()
            try:
                n = recv_into(view)
            except BlockingIOError:
                return
            except OSError as exc:
                if ch.state is _ACCEPTING:
                    self._drop(ch)
                    return
                raise self._lost(ch, exc) from None
            if n == 0:
                self._eof(ch)
                return
            self._progress.moved = True
            dec.commit(n)
            self._drain(ch)
            if ch.state is _CLOSED or n < len(view):
                return

    def _drain(self, ch: Channel) -> None:
        dec = ch.decoder
        matching = self._matching
        while True:
            try:
                ev = dec.next_event()
            except ProtocolError as exc:
                if ch.state is _ACCEPTING:
                    self._reject(ch, str(exc))  # a stranger
                    return
                raise ProtocolError(
                    f"rank {self.rank}: bad bytes from rank {ch.peer} at {ch.address}: {exc}"
                ) from None
            if ev is wire.NEED_DATA:
                return
            if ev is wire.PAYLOAD_DONE:
                current = ch.current
                ch.current = None
                if type(current) is ShmMessage:
                    self._on_shm_message(ch, current)
                else:
                    matching.payload_done(current)
                continue
            if type(ev) is not wire.FrameHeader:
                if not isinstance(ev, wire.Hello):  # pragma: no cover - markers are above
                    raise ProtocolError(f"rank {self.rank}: unexpected decoder event {ev!r}")
                self._on_hello(ch, ev)
                if ch.state is _CLOSED:
                    return
                continue
            kind = ev.kind
            if kind == wire.DATA or kind == wire.ARRAY:  # noqa: PLR1714 - the hot path
                if ch.state is not _OPEN:
                    raise ProtocolError(f"frame {ev!r} before the handshake completed")
                ch.current, target = matching.target_for(ev, ch.peer)
                dec.set_target(target)
            elif kind == wire.SHM and ch.state is _OPEN:
                msg = ShmMessage(ev.tag, ev.length)
                ch.current = msg
                dec.set_target(memoryview(msg.buf))
            elif kind == wire.GOODBYE:
                ch.goodbye = True
                ch.current = None
                dec.set_target(memoryview(bytearray(0)))
            else:
                raise ProtocolError(
                    f"rank {self.rank}: frame {ev!r} from rank {ch.peer} is not allowed on "
                    "its socket"
                )

    # -- faults ------------------------------------------------------------------------------
    def _eof(self, ch: Channel) -> None:
        peer = ch.peer
        if ch.state is _ACCEPTING:
            self._drop(ch)
            return
        rings = self._rings
        sp = rings.peers.get(peer)
        if sp is not None:
            rings.read(sp)  # what the peer wrote before it went is still ours
        if ch.state is _CONNECTING or ch.decoder.in_frame:
            raise self._lost(ch, ConnectionError("connection closed (EOF)"))
        if rings.in_frame(peer):
            raise self._lost(ch, ConnectionError("it stopped writing its ring mid-frame"))
        # Between frames: a peer that closed (GOODBYE) or simply exited after its last
        # operation is only an error if this rank still needs it, now or later.
        waits = self.waits_on(peer) or rings.waits_on(peer) or self._matching.waits_for(peer)
        self._drop(ch)
        self._faults.gone[peer] = GOODBYE if ch.goodbye else NO_GOODBYE
        if waits:
            raise self._faults.gone_error(peer, "wait for")

    def _lost(self, ch: Channel, exc: BaseException) -> PeerError:
        """Drop the broken channel of a known peer; publish and return the error to raise."""
        self._drop(ch)
        return self._faults.lost(ch.peer, ch.address, exc)

    # -- closing -----------------------------------------------------------------------------
    def close(self, goodbye: bool) -> None:
        """Say GOODBYE (when ``goodbye``) to connected peers with nothing queued, and close
        every socket and the listener's end."""
        if goodbye:
            frame = wire.encode_header(wire.GOODBYE, comm_id=0, tag=0, length=0)
            for ch in list(self.conns.values()):
                if not self._sendq.get(ch.peer):
                    with contextlib.suppress(OSError):
                        ch.sock.send(frame)
        channels = [key.data for key in self._sel.get_map().values() if key.data is not None]
        for ch in channels:
            self._drop(ch)
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(self._links.wake)
        self._links.close()
        self._sel.close()
