"""A Grid wrapper that measures every message that crosses it.

Bytes down are the serialized size of each message the ServerApp pushes; bytes up the
size of each reply it pulls. Per node, per round. Works over any Grid: Flower's
deployment and simulation grids, and fedswarm's in-process grid.

Monitoring is counted apart: records of a reply whose name starts with
:data:`~fedswarm.protocol.REPORT_PREFIX` (``report.``; e.g. a decentralized node's model, sent only so the
server can evaluate the node average) are not the algorithm's traffic. Their bytes (the
reply's size minus its size without them, both serialized) go to ``report_up``, and
``bytes_up`` is the rest: the algorithm's messages with their framing. A node's device
telemetry (:data:`~fedswarm.protocol.TELEMETRY_RECORD`, ``report.telemetry``) is monitoring too, counted apart
again as ``telemetry_up`` (every reply carries it; ``report_up`` keeps what it meant).
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

from flwr.app import Message
from flwr.common.serde import metadata_to_proto, recorddict_to_proto
from flwr.serverapp import Grid

from fedswarm.protocol import REPORT_PREFIX, TELEMETRY_RECORD

__all__ = ["MeteredGrid", "Traffic", "WrappingGrid", "report_size",
           "serialized_size", "record_size"]



class WrappingGrid(Grid):
    """A Grid over another Grid (``inner``): run, messages' creation and the node list pass through.

    Subclasses decide what happens to the messages themselves (``push_messages``,
    ``pull_messages``, ``send_and_receive``): the base passes them through too.
    """

    def __init__(self, inner: Grid):
        self.inner = inner

    def set_run(self, run):  # type: ignore[override]
        self.inner.set_run(run)

    @property
    def run(self):  # type: ignore[override]
        return self.inner.run

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None):  # type: ignore[override]
        return self.inner.create_message(content, message_type, dst_node_id, group_id, ttl)

    def get_node_ids(self) -> Iterable[int]:
        return self.inner.get_node_ids()

    def get_nodes(self):  # type: ignore[override]
        return self.inner.get_nodes()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        return self.inner.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return self.inner.pull_messages(message_ids)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        return self.inner.send_and_receive(messages, timeout=timeout)


def _varint_len(n: int) -> int:
    size = 1
    while n >= 0x80:
        n >>= 7
        size += 1
    return size


def _field_len(n: int) -> int:
    """Bytes of a length-delimited protobuf field with a one-byte tag."""
    return 1 + _varint_len(n) + n


def serialized_size(message: Message, content_cache: dict[int, int] | None = None) -> int:
    """The size of ``message`` as Flower's protobuf ``Message`` (what goes on the wire).

    Equal to ``message_to_proto(message).ByteSize()``; the content's size is cached by
    object identity so a record broadcast to many nodes is serialized once."""
    total = _field_len(metadata_to_proto(message.metadata).ByteSize())
    if message.has_error():
        from flwr.common.serde import error_to_proto

        total += _field_len(error_to_proto(message.error).ByteSize())
    elif message.has_content():
        key = id(message.content)
        if content_cache is not None and key in content_cache:
            size = content_cache[key]
        else:
            size = recorddict_to_proto(message.content).ByteSize()
            if content_cache is not None:
                content_cache[key] = size
        total += _field_len(size)
    return total


def record_size(message: Message, key: str, total: int | None = None) -> int:
    """Bytes the record ``key`` adds to ``message`` (its serialized size minus the size of
    the message without it; 0 when it has none), computed from the record alone: the
    content's length is read back from ``total`` rather than by serializing the model again."""
    if message.has_error() or not message.has_content() or key not in message.content:
        return 0
    from flwr.app import RecordDict

    total = serialized_size(message) if total is None else total
    meta = _field_len(metadata_to_proto(message.metadata).ByteSize())
    rest = total - meta - 1  # the content field: its tag, its length's varint, its bytes
    content = next(c for c in range(rest - 1, rest - 11, -1) if _varint_len(c) == rest - c)
    item = recorddict_to_proto(RecordDict({key: message.content[key]})).ByteSize()  # its one entry
    return total - (meta + _field_len(content - item))


def report_size(message: Message, total: int | None = None) -> int:
    """Bytes of ``message``'s monitoring records (:data:`REPORT_PREFIX`), the telemetry record
    (:data:`TELEMETRY_RECORD`) excepted: its serialized size minus the size of the same
    message without them (0 when it has none)."""
    if message.has_error() or not message.has_content():
        return 0
    keys = [k for k in message.content if k.startswith(REPORT_PREFIX) and k != TELEMETRY_RECORD]
    if not keys:
        return 0
    from flwr.app import RecordDict

    rest = RecordDict({k: v for k, v in message.content.items() if k not in keys and k != TELEMETRY_RECORD})
    without = _field_len(metadata_to_proto(message.metadata).ByteSize()) + _field_len(
        recorddict_to_proto(rest).ByteSize())
    total = serialized_size(message) if total is None else total
    return total - without - record_size(message, TELEMETRY_RECORD, total)


@dataclass
class Traffic:
    """What crossed the grid since the last :meth:`MeteredGrid.take`."""

    bytes_up: int = 0
    bytes_down: int = 0
    report_up: int = 0  # monitoring records (report.*) in replies, not in bytes_up
    telemetry_up: int = 0  # the nodes' telemetry records (report.telemetry), in neither
    node_up: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    node_down: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    replies: list[Message] = field(default_factory=list)
    sent_to: dict[str, int] = field(default_factory=dict)  # message id -> the node it was sent to

    def node_of(self, reply: Message) -> int:
        """The node a reply is about: its sender, or, for an error the SuperLink wrote in the
        name of a node that vanished (sender: the SuperLink), the node the message went to."""
        if reply.has_error():
            node = self.sent_to.get(reply.metadata.reply_to_message_id)
            if node is not None:
                return node
        return reply.metadata.src_node_id


class MeteredGrid(WrappingGrid):
    """Delegates to ``inner`` and counts serialized bytes both ways."""

    def __init__(self, inner: Grid):
        super().__init__(inner)
        self._lock = threading.Lock()
        self._traffic = Traffic()
        self._carry: set[str] = set()  # carry_over(): in flight past the next take

    # -- accounting --------------------------------------------------------------------
    def take(self) -> Traffic:
        """Return the traffic so far and start counting afresh (the messages named by
        :meth:`carry_over` since the last take move to the new count's ``sent_to``)."""
        with self._lock:
            t, self._traffic = self._traffic, Traffic()
            carried, self._carry = self._carry, set()
            for mid in carried & set(t.sent_to):
                self._traffic.sent_to[mid] = t.sent_to.pop(mid)
        return t

    def carry_over(self, message_ids: Iterable[str]) -> None:
        """Messages still in flight at the next :meth:`take`, whose replies an asynchronous
        strategy takes in a later round: not counted as unanswered in this one."""
        with self._lock:
            self._carry |= set(message_ids)

    def _count_down(self, messages: list[Message]) -> None:
        cache: dict[int, int] = {}
        with self._lock:
            for m in messages:
                n = serialized_size(m, cache)
                self._traffic.bytes_down += n
                self._traffic.node_down[m.metadata.dst_node_id] += n

    def _count_up(self, replies: list[Message]) -> None:
        with self._lock:
            for m in replies:
                n = serialized_size(m)
                telemetry = record_size(m, TELEMETRY_RECORD, n)
                report = report_size(m, n)
                self._traffic.bytes_up += n - report - telemetry
                self._traffic.report_up += report
                self._traffic.telemetry_up += telemetry
                self._traffic.node_up[self._traffic.node_of(m)] += n - report - telemetry
                self._traffic.replies.append(m)

    # -- Grid: messages (the rest is WrappingGrid's) -------------------------------------
    def _remember(self, messages: list[Message], ids: Iterable[str] | None = None) -> None:
        ids = list(ids) if ids is not None else [m.metadata.message_id for m in messages]
        with self._lock:
            for m, mid in zip(messages, ids, strict=False):  # ids may be fewer if a push failed
                if mid:
                    self._traffic.sent_to[mid] = m.metadata.dst_node_id

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        msgs = list(messages)
        self._count_down(msgs)
        ids = list(self.inner.push_messages(msgs))
        self._remember(msgs, ids)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        replies = list(self.inner.pull_messages(message_ids))
        self._count_up(replies)
        return replies

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        msgs = list(messages)
        self._count_down(msgs)
        replies = list(self.inner.send_and_receive(msgs, timeout=timeout))
        self._remember(msgs)
        self._count_up(replies)
        return replies
