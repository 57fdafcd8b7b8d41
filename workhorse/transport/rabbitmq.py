"""kombu's py-amqp transport, with publishes that never hang on a blocked RabbitMQ.

A RabbitMQ server under a memory or disk alarm sends ``connection.blocked`` and stops
reading from the connections that publish: py-amqp's publish then waits for its confirm
forever. Here a connection remembers that it is blocked (until ``connection.unblocked``),
and a publish on it raises :class:`BrokerBlocked` at once, before sending anything (py-amqp
reads what the server sent before each publish). A publish sent before the block is known
waits for its confirm at most its ``timeout`` (``CONFIRM_TIMEOUT`` if none) and raises
:class:`PublishNotConfirmed` when the block arrives or the time is up: the server may
still take that message, so it is not sent again; the connection is done with (a late
confirm would be read as the next message's).
"""
from __future__ import annotations

import errno
import logging
import socket
import struct
from collections.abc import Callable, Sequence
from typing import Any

from amqp import spec
from amqp.exceptions import (
    ConnectionError as AMQPConnectionError,
    MessageNacked,
    RecoverableConnectionError,
    UnexpectedFrame,
)
from amqp.transport import TCPTransport
from kombu.exceptions import OperationalError
from kombu.transport import pyamqp

from .amqpframes import frame_handler
from .backlog import Backlog, stamp_amqp

log = logging.getLogger("workhorse.broker")

#: Seconds a publish waits for the server's confirm when its caller gave no timeout.
CONFIRM_TIMEOUT = 10.0
#: Frames read before a publish, at most (each drain reads one method).
_MAX_PENDING = 100
#: Bytes asked of the socket at a time (see ReadAheadTransport).
READ_AHEAD = 65536
#: A ``basic.ack`` method frame: frame type 1, channel, payload size 13, class 60 and
#: method 80 (``basic.ack``), the delivery tag, the ``multiple`` bit, the frame-end octet.
_ACK_FRAME = struct.Struct(">BHIHHQBB")
#: basic.deliver's delivery tag and the octet holding its redelivered bit.
_TAG_AND_BITS = struct.Struct(">QB").unpack_from
_DELIVER = spec.Basic.Deliver
#: A frame's header: its type, its channel, the size of its payload.
_FRAME_HEADER = struct.Struct(">BHI").unpack_from
#: errno values of a socket that is only not ready (py-amqp's list).
_UNAVAILABLE = frozenset((errno.EAGAIN, errno.EINTR, errno.ENOENT, errno.EWOULDBLOCK))


class BrokerBlocked(OperationalError):
    """RabbitMQ has blocked publishing on this connection (a memory or disk alarm);
    nothing was sent. Not retried by kombu: the alarm lasts until the operator acts."""


class PublishNotConfirmed(AMQPConnectionError):
    """A published message was not confirmed (the server blocked publishing meanwhile, or
    stayed silent): it may still be delivered. A connection error, but not one kombu
    retries: sending it again could deliver it twice."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self)!r})"


class Channel(pyamqp.Channel):
    connection: Connection

    def _basic_publish(self, msg: Any, *args: Any, **kwargs: Any) -> Any:
        self.connection.raise_if_blocked()
        stamp_amqp(msg.properties)
        return super()._basic_publish(msg, *args, **kwargs)

    def backlog(self, queue: str) -> Backlog:
        """``queue``'s ready messages and consumers (a passive declare). AMQP 0-9-1 cannot
        show the oldest message without taking it: its send time stays unknown."""
        _, ready, consumers = self.queue_declare(queue=queue, passive=True)
        return Backlog(ready, None, consumers)

    basic_publish = _basic_publish

    def dispatch_method(self, method_sig: Any, payload: bytes, content: Any) -> Any:
        """py-amqp's, with a short path for a delivery: its five arguments read with one
        struct (py-amqp's general reader costs a Python loop over their letters), the
        body decoded by its content encoding as py-amqp does, and the consumer's listener
        called. Anything else (another method, a channel closing, a one-shot wait for a
        delivery, no listener) goes py-amqp's way."""
        if (method_sig != _DELIVER or content is None or self.is_closing
                or _DELIVER in self._pending or type(payload) is not bytes):
            return super().dispatch_method(method_sig, payload, content)
        listener = self._callbacks.get(_DELIVER)
        if listener is None:
            return super().dispatch_method(method_sig, payload, content)
        # Consumer tag, delivery tag, redelivered, exchange, routing key: sLbss.
        end = 5 + payload[4]
        consumer_tag = payload[5:end].decode("utf-8", "surrogatepass")
        delivery_tag, bits = _TAG_AND_BITS(payload, end)
        start = end + 9
        end = start + 1 + payload[start]
        exchange = payload[start + 1:end].decode("utf-8", "surrogatepass")
        routing_key = payload[end + 1:end + 1 + payload[end]].decode("utf-8", "surrogatepass")
        properties = content.properties
        if self.auto_decode and "content_encoding" in properties:
            try:
                content.body = content.body.decode(properties["content_encoding"])
            except Exception:  # noqa: BLE001 - as py-amqp: the body stays bytes
                pass
        listener(consumer_tag, delivery_tag, bits & 1 == 1, exchange, routing_key, content)
        return None

    def ack_tags(self, tags: Sequence[int]) -> None:
        """Ack each delivery in ``tags`` (``basic.ack``, ``multiple`` false: one frame
        each, exactly as ``basic_ack`` sends them) in one write to the socket.

        ``basic_ack`` goes through py-amqp's generic path (argument encoding, a locked
        frame buffer, a write per frame) at some 20 Python calls an ack; the broker thread
        acks a turn's tasks here at once. The connection's owner calls it, and no other
        thread writes on that connection (py-amqp's frame lock is not taken)."""
        transport = self._transport()
        if not tags:
            return
        transport.write(self._ack_frames(tags))
        self.connection.bytes_sent += 1    # what heartbeat_check counts: something was sent

    def _transport(self) -> Any:
        """The connection's transport; raises as ``basic_ack`` does if there is none."""
        connection = self.connection
        transport = connection.transport if connection is not None else None
        if transport is None:
            raise RecoverableConnectionError("connection already closed")
        return transport

    def _ack_frames(self, tags: Sequence[int]) -> bytes:
        pack, channel_id = _ACK_FRAME.pack, self.channel_id
        return b"".join([pack(1, channel_id, 13, 60, 80, tag, 0, 0xCE) for tag in tags])

    def ack_tags_now(self, tags: Sequence[int]) -> bool | None:
        """``ack_tags`` without waiting for the socket (another thread than the
        connection's owner calls it, while the owner is parked and writes nothing): True
        if the frames were written whole; None if nothing was written (this socket cannot
        be written so, or its buffer is full), the owner is to ack them; False if they
        were written in part: the rest goes first in the transport's next write, and
        ``finish_write`` sends it. A connection that failed raises, as ``ack_tags``."""
        write_now = getattr(self._transport(), "write_now", None)
        if write_now is None or not tags:
            return None
        written: bool | None = write_now(self._ack_frames(tags))
        if written is not None:
            self.connection.bytes_sent += 1
        return written

    def basic_publish_confirm(self, *args: Any, confirm_timeout: float | None = None,
                              **kwargs: Any) -> Any:
        if not self._confirm_selected:   # py-amqp's flag: confirm mode asked for once
            self._confirm_selected: bool = True
            self.confirm_select()
        result = self._basic_publish(*args, **kwargs)
        timeout = confirm_timeout or kwargs.get("timeout") or CONFIRM_TIMEOUT
        connection = self.connection
        connection.awaiting_confirm = True
        try:
            self.wait([spec.Basic.Ack, spec.Basic.Nack], callback=_raise_if_nacked,
                      timeout=timeout)
        except TimeoutError:
            raise PublishNotConfirmed(
                f"RabbitMQ did not confirm a published message within {timeout:g} s (is "
                "it blocking publishers? see rabbitmq-diagnostics alarms): it may still be "
                "delivered, so it is not sent again") from None
        finally:
            connection.awaiting_confirm = False
        return result


def _raise_if_nacked(method: Any, *args: Any) -> None:
    if method == spec.Basic.Nack:
        raise MessageNacked()


class ReadAheadTransport(TCPTransport):
    """py-amqp's TCP transport, reading what the socket holds instead of what one frame
    needs. py-amqp reads a frame in three ``recv`` calls (its header, its payload, its end
    octet), and sets the socket's timeout before and after each (two ``ioctl``): a
    delivery (three frames) cost the worker's broker thread 9 ``recv`` and 6 ``ioctl``
    calls. Here one ``recv`` takes up to READ_AHEAD bytes, later reads are served from
    them, and a frame already buffered whole is read without touching the socket or its
    timeout (``Connection.blocking_read``).

    Bytes read ahead are invisible to select(): whoever drains must go on while
    ``frame_buffered()`` (``_AmqpDriver.tick`` does, before the broker thread waits)."""

    _ahead = b""            # bytes read from the socket ...
    _pos = 0                # ... of which those before this offset are used
    #: The part of a ``write_now`` the socket did not take: it goes first in the next
    #: write, so the frames leave in the order they were written.
    _unsent = b""

    @property
    def _read_buffer(self) -> bytes:
        """py-amqp's name for what was read and not used (it puts a partial frame back in
        front of it when a read times out)."""
        return self._ahead[self._pos:]

    @_read_buffer.setter
    def _read_buffer(self, value: bytes) -> None:
        self._ahead, self._pos = value, 0

    def frame_buffered(self) -> bool:
        """Is a whole frame (header, payload, end octet) waiting in the buffer?"""
        ahead, pos = self._ahead, self._pos
        if len(ahead) - pos < 8:
            return False
        return len(ahead) - pos >= _FRAME_HEADER(ahead, pos)[2] + 8

    def take_frame(self) -> tuple[int, int, bytes] | None:
        """The next frame, as py-amqp's ``read_frame`` returns it, if it is buffered
        whole; else None (nothing is taken). A frame whose end octet is wrong is taken and
        raises py-amqp's ``UnexpectedFrame``, as there."""
        ahead, pos = self._ahead, self._pos
        if len(ahead) - pos < 8:
            return None
        kind, channel, size = _FRAME_HEADER(ahead, pos)
        end = pos + 7 + size
        if end >= len(ahead):
            return None
        self._pos = end + 1
        if ahead[end] != 0xCE:
            raise UnexpectedFrame(f"Received frame_end {ahead[end]:#04x} while expecting 0xce")
        return kind, channel, ahead[pos + 7:end]

    def read_now(self) -> bool | None:
        """Add what the socket holds to the buffer, without waiting: True if it held
        something, False if nothing, None if this socket cannot be read so (it waits up to
        a timeout of its own first: py-amqp's path is for that). A closed or broken
        connection raises as py-amqp's ``read_frame`` does."""
        sock = self.sock
        if sock.gettimeout() not in (None, 0.0):
            return None
        data = self._at_once(sock.recv, READ_AHEAD)
        if data is None:
            return False
        if not data:
            self.connected = False
            raise OSError("Server unexpectedly closed connection")
        self._ahead, self._pos = self._ahead[self._pos:] + data, 0
        return True

    def write(self, s: Any) -> None:
        """py-amqp's, after what ``write_now`` left unsent."""
        if self._unsent:
            s, self._unsent = self._unsent + s, b""
        super().write(s)

    def write_now(self, data: bytes) -> bool | None:
        """Write ``data`` without waiting for the socket: True if it took all of it; None
        if it took none (full), or this socket cannot be written so (it waits up to a
        timeout of its own first): nothing was written; False if it took a part: the rest
        is kept, to go first in the next ``write`` (``finish_write``). A broken connection
        raises as ``write`` does."""
        sock = self.sock
        if self._unsent or sock.gettimeout() not in (None, 0.0):
            return None
        sent = self._at_once(sock.send, data)
        if not sent:
            return None
        if sent == len(data):
            return True
        self._unsent = data[sent:]
        return False

    def _at_once(self, call: Callable[[Any, int], Any], argument: Any) -> Any:
        """``call(argument, MSG_DONTWAIT)`` on the socket: what it returns, or None if
        the socket is not ready. A broken connection raises as py-amqp's reads and writes
        do, and counts as disconnected."""
        try:
            return call(argument, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return None
        except OSError as exc:
            if exc.errno not in _UNAVAILABLE:
                self.connected = False
            raise

    def finish_write(self) -> None:
        """Send what ``write_now`` left unsent, waiting for the socket as ``write`` does."""
        if self._unsent:
            self.write(b"")

    def _read(self, n: int, initial: bool = False,
              _errnos: tuple[int, ...] = (errno.EAGAIN, errno.EINTR)) -> bytes:
        """Exactly ``n`` bytes, as py-amqp's own ``_read`` (the same errors, the same
        ``socket.timeout`` on an empty non-blocking socket at a frame's start)."""
        ahead, pos = self._ahead, self._pos
        end = pos + n
        if end <= len(ahead):
            self._pos = end
            return ahead[pos:end]
        rbuf = ahead[pos:]
        recv = self.sock.recv
        try:
            while len(rbuf) < n:
                try:
                    data = recv(max(n - len(rbuf), READ_AHEAD))
                except OSError as exc:
                    if exc.errno in _errnos:
                        if initial and self.raise_on_initial_eintr:
                            raise TimeoutError() from None
                        continue
                    raise
                if not data:
                    raise OSError("Server unexpectedly closed connection")
                rbuf += data
        except BaseException:
            self._ahead, self._pos = rbuf, 0
            raise
        self._ahead, self._pos = rbuf, n
        return rbuf[:n]


class Connection(pyamqp.Connection):
    Channel = Channel

    def blocking_read(self, timeout: float | None = None) -> Any:
        """py-amqp's: read a frame and hand it to the frame handler; True once a method is
        handed over (``drain_events`` reads until one is). Here, with a timeout, frames
        buffered whole are taken from the buffer (no socket, no timeout set around the
        read: two ``ioctl`` calls a frame) one after another until one completes a method
        (a delivery's three frames in one call). A read that must not wait
        (``timeout=0``) finding the socket empty raises ``socket.timeout`` at once, as
        py-amqp's ends a drain, without setting the socket's timeout twice."""
        transport = self.transport
        take = getattr(transport, "take_frame", None)
        if take is None or timeout is None:
            return super().blocking_read(timeout)
        frame = take()
        if frame is None:
            got = transport.read_now() if timeout == 0 else None
            if got is False:
                raise TimeoutError()
            frame = take() if got else None
            if frame is None:       # a frame in part, or a socket with its own timeout
                return super().blocking_read(timeout)
        on_frame = self.on_inbound_frame
        while not on_frame(frame):
            frame = take()
            if frame is None:
                return False
        return True

    def deliver_ready(self) -> bool | None:
        """Read what the socket holds now, never waiting, and hand each frame buffered
        whole to the frame handler (a delivery whose three frames are in reaches its
        consumer; one in part waits for the rest in the buffer). True if done; None if
        this socket cannot be read so (TLS, or a socket with a timeout of its own):
        nothing was read. A closed or broken connection raises as ``drain_events``."""
        transport = self.transport
        read = getattr(transport, "read_now", None)
        if read is None or read() is None:
            return None
        take, on_frame = transport.take_frame, self.on_inbound_frame
        while (frame := take()) is not None:
            on_frame(frame)
        return True

    def Transport(self, host: str, connect_timeout: float | None, ssl: Any = False,
                  read_timeout: float | None = None, write_timeout: float | None = None,
                  socket_settings: Any = None, **kwargs: Any) -> Any:
        """py-amqp's, but a plain TCP connection reads ahead (``ReadAheadTransport``)."""
        if ssl:
            return super().Transport(host, connect_timeout, ssl, read_timeout, write_timeout,
                                     socket_settings, **kwargs)
        return ReadAheadTransport(host, connect_timeout=connect_timeout,
                                  read_timeout=read_timeout, write_timeout=write_timeout,
                                  socket_settings=socket_settings, **kwargs)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        #: Why the server blocks publishing now; None while it does not.
        self.blocked_reason: str | None = None
        #: A publish waits for its confirm: a block now means it may never come.
        self.awaiting_confirm = False
        kwargs.update(on_blocked=self._blocked, on_unblocked=self._unblocked)
        # Deliveries' content headers decoded by our reader (the same values, in half
        # the time: see amqpframes).
        kwargs.setdefault("frame_handler", frame_handler)
        super().__init__(*args, **kwargs)

    def raise_if_blocked(self) -> None:
        """Read what the server sent meanwhile; raise BrokerBlocked if it blocks us."""
        for _ in range(_MAX_PENDING):
            try:
                self.drain_events(timeout=0)
            except TimeoutError:
                break
        if self.blocked_reason is not None:
            raise BrokerBlocked(
                f"RabbitMQ {self.host} blocks publishing on this connection "
                f"({self.blocked_reason}): a memory or disk alarm on the server; nothing was "
                "sent. Publishing resumes when the alarm clears (rabbitmq-diagnostics alarms)")

    def _blocked(self, reason: str) -> None:
        self.blocked_reason = reason
        log.warning("RabbitMQ %s blocks publishing on a connection (%s): a memory or disk "
                    "alarm on the server; publishes on it fail until it is unblocked",
                    self.host, reason)
        if self.awaiting_confirm:
            raise PublishNotConfirmed(
                f"RabbitMQ {self.host} blocked publishing ({reason}) before confirming a "
                "published message: it may still be delivered, so it is not sent again")

    def _unblocked(self) -> None:
        self.blocked_reason = None
        log.info("RabbitMQ %s unblocked publishing on a connection", self.host)


class Transport(pyamqp.Transport):
    Connection = Connection


class SSLTransport(pyamqp.SSLTransport):
    Connection = Connection
