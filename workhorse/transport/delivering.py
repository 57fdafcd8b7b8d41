"""A take's messages handed to their consumer without kombu's detour.

kombu's virtual transports deliver a raw message through the connection
(``Transport._deliver``), which looks up the queue's callback, a closure made by
``basic_consume`` that builds a ``Message`` (its body decoded through the codec registry,
its constructor's keyword arguments passed down two classes), records it with the QoS, and
calls the consumer. The SQLite and Redis transports take several messages at once and
deliver each at once: ``Delivering.deliver_taken`` does what that closure does, in one
call, with the same ``Message`` class and the same QoS record, wherever the closure
registered for the queue is still this channel's own (else, and for any message this
does not build the same way, kombu's path). ``tests/test_transport_delivering.py`` holds
the two paths' messages side by side.
"""
from __future__ import annotations

import binascii
from collections.abc import Callable
from typing import Any

from kombu.transport import virtual


class Delivering(virtual.Channel):
    """A virtual channel whose takes deliver through ``deliver_taken``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        #: queue -> (kombu's closure for it, the consumer's callback, no_ack)
        self._receivers: dict[str, tuple[Any, Callable[[Any], Any], bool]] = {}
        super().__init__(*args, **kwargs)

    def basic_consume(self, queue: str, no_ack: bool, callback: Callable[[Any], Any],
                      consumer_tag: str, **kwargs: Any) -> Any:
        result = super().basic_consume(queue, no_ack, callback, consumer_tag, **kwargs)
        closure = self.connection._callbacks.get(queue)
        if closure is not None:
            self._receivers[queue] = (closure, callback, bool(no_ack))
        return result

    def basic_cancel(self, consumer_tag: str) -> Any:
        queue = self._tag_to_queue.get(consumer_tag)
        result = super().basic_cancel(consumer_tag)
        if queue is not None and queue not in self._tag_to_queue.values():
            self._receivers.pop(queue, None)
        return result

    def deliver_taken(self, raw: dict[str, Any], queue: str) -> None:
        """Hand ``raw`` (kombu's message object, as ``unreadable.read`` accepted it) to
        the consumer of ``queue``, as ``connection._deliver`` would."""
        receiver = self._receivers.get(queue)
        message = None
        if receiver is not None:
            closure, callback, no_ack = receiver
            if self.connection._callbacks.get(queue) is closure:
                message = _message(raw, self)
        if message is None:
            self.connection._deliver(raw, queue)
            return
        if not no_ack:
            self.qos.append(message, message.delivery_tag)
        callback(message)


def _message(raw: dict[str, Any], channel: Any) -> virtual.Message | None:
    """``channel.Message(raw, channel=channel)``, its fields set here; None where kombu's
    constructor does more than this does (a compressed body, a body encoding other than
    base64, another Message class)."""
    cls = channel.Message
    if cls is not virtual.Message:
        return None
    properties = raw["properties"]
    headers = raw.get("headers") or {}
    if "compression" in headers:
        return None
    body = raw.get("body")
    if body:
        encoding = properties.get("body_encoding")
        if encoding == "base64":
            body = binascii.a2b_base64(body)
        elif encoding and encoding.lower() != "utf-8":
            return None
    if isinstance(body, str):
        body = body.encode("utf-8")
    message = cls.__new__(cls)
    message._raw = raw
    message.errors = []
    message.channel = channel
    message.delivery_tag = properties["delivery_tag"]
    message.content_type = raw.get("content-type")
    message.content_encoding = raw.get("content-encoding")
    message.delivery_info = properties.get("delivery_info") or {}
    message.headers = headers
    message.properties = properties
    message._decoded_cache = None
    message._state = "RECEIVED"
    message.accept = None
    message.body = body
    return message
