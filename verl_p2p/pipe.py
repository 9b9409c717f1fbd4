"""Sending on a multiprocessing pipe without leaving a view of a BytesIO behind in an error's traceback.

`Connection.send` pickles into a BytesIO and writes from its `getbuffer()` view. When the write fails (the peer
died: BrokenPipeError), the traceback keeps that view; chained into our own error and held in a reference cycle
(an asyncio future, a sync's failure list), it is freed by the garbage collector, which on CPython 3.12.1 can clear
the view's owner before the view (CPython gh-111049): "SystemError: deallocated BytesIO object has exported
buffers", then a segfault. `send` pickles the same bytes into a bytes object instead: no such view ever exists.
"""

from __future__ import annotations

import io
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from typing import Any


def send(conn: Connection, obj: Any) -> None:
    """`conn.send(obj)`, the same bytes on the wire (the other end's `recv` reads them); raises what it raises."""
    buf = io.BytesIO()
    ForkingPickler(buf).dump(obj)
    conn.send_bytes(buf.getvalue())
