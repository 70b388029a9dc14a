"""A lean HTTP/1.1 keep-alive transport for the engine client (httpx's `transport=`).

Profiled under load, httpx's default transport (httpcore + anyio + h11) was the largest
single cost of a completion in the collector: a third of its CPU, growing with the
number of pooled connections (each request scans the whole pool and polls every
socket). The collector talks to one engine over plain HTTP/1.1, so this transport does
just that, on asyncio protocols with httptools (the parser uvicorn uses):

- a LIFO pool of idle keep-alive connections per host:port, at most `max_connections`
  requests in flight (the rest wait their turn);
- the response head is returned as soon as it arrives and the body is streamed chunk by
  chunk (SSE works), chunked encoding decoded by the parser;
- timeouts from the request (httpx passes connect/read): ConnectTimeout, ReadTimeout;
  a refused or dropped connection is ConnectError / RemoteProtocolError, so the engine
  client's error mapping applies unchanged;
- a request on a reused connection that the server had already closed (keep-alive
  expiry) is retried once on a new connection, if no byte of a response had arrived.

The connection is returned to the pool when the response is closed after its body was
read to the end and the server allows keep-alive; otherwise it is closed.

`exchange` is the same request without httpx around it: raw head and body in, status and
whole body out. The engine client uses it for its JSON calls (`generate`): httpx's
request and response models (URL merging, cookies, header objects) cost more CPU per
completion than this transport itself.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import AsyncIterator
from typing import Any, cast

import httptools
import httpx

log = logging.getLogger(__name__)

_HIGH_WATER = 1 << 20  # pause reading when this much body is buffered


class _Conn(asyncio.Protocol):
    """One connection and the response currently being read on it."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self._reset()

    def _reset(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.headers: list[tuple[bytes, bytes]] = []
        self.head: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.chunks: collections.deque[bytes] = collections.deque()
        self.buffered = 0
        self.complete = False
        self.keep_alive = False
        self.got_bytes = False
        self.error: Exception | None = None
        self.wakeup: asyncio.Event = asyncio.Event()
        self.paused = False

    # -- asyncio.Protocol ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(httpx.RemoteProtocolError(f"malformed response from the engine: {exc}"))
            self.close()

    def eof_received(self) -> bool | None:
        return None  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.complete:
            self._fail(httpx.RemoteProtocolError("the engine closed the connection"))

    # -- httptools callbacks ----------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        # Asked here: once the message is complete, httptools no longer knows.
        self.keep_alive = self.parser.should_keep_alive()
        if not self.head.done():
            self.head.set_result(self.parser.get_status_code())

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > _HIGH_WATER and self.transport is not None and not self.paused:
            self.transport.pause_reading()
            self.paused = True
        self.wakeup.set()

    def on_message_complete(self) -> None:
        self.complete = True
        self.wakeup.set()

    # -- use --------------------------------------------------------------------------------

    def _fail(self, exc: Exception) -> None:
        if self.error is None:
            self.error = exc
        if not self.head.done():
            self.head.set_exception(exc)
            self.head.exception()  # retrieved here; raised again by the waiter
        self.wakeup.set()

    def begin(self, data: bytes) -> None:
        self._reset()
        assert self.transport is not None
        self.transport.write(data)

    async def next_chunk(self, timeout: float | None) -> bytes | None:
        """The next piece of body, or None at its end."""
        while True:
            if self.chunks:
                chunk = self.chunks.popleft()
                self.buffered -= len(chunk)
                if self.paused and self.buffered < _HIGH_WATER // 2 and self.transport is not None:
                    self.transport.resume_reading()
                    self.paused = False
                return chunk
            if self.complete:
                return None
            if self.error is not None:
                raise self.error
            self.wakeup.clear()
            try:
                async with asyncio.timeout(timeout):
                    await self.wakeup.wait()
            except TimeoutError:
                raise httpx.ReadTimeout("no data from the engine within the read timeout") from None

    def reusable(self) -> bool:
        return self.complete and not self.closed and self.keep_alive

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class _Body(httpx.AsyncByteStream):
    def __init__(self, pool: EngineTransport, key: tuple[str, int], conn: _Conn, timeout: float | None) -> None:
        self.pool = pool
        self.key = key
        self.conn: _Conn | None = conn
        self.timeout = timeout

    async def __aiter__(self) -> AsyncIterator[bytes]:
        conn = self.conn
        if conn is None:
            return
        while (chunk := await conn.next_chunk(self.timeout)) is not None:
            yield chunk

    async def aclose(self) -> None:
        conn, self.conn = self.conn, None
        if conn is not None:
            self.pool.release(self.key, conn)


class EngineTransport(httpx.AsyncBaseTransport):
    def __init__(self, max_connections: int = 256) -> None:
        self._idle: dict[tuple[str, int], list[_Conn]] = {}
        self._slots = asyncio.Semaphore(max_connections)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        timeouts: dict[str, Any] = request.extensions.get("timeout") or {}
        url = request.url
        if url.scheme != "http":
            raise httpx.UnsupportedProtocol(f"this transport speaks plain http, not {url.scheme}")
        key = (url.host, url.port or 80)
        body = await request.aread()
        head = [request.method.encode(), b" ", url.raw_path, b" HTTP/1.1\r\n"]
        for name, value in request.headers.raw:
            head += [name, b": ", value, b"\r\n"]
        data = b"".join([*head, b"\r\n", body])
        await self._slots.acquire()
        try:
            conn = await self._send(key, data, timeouts)
        except BaseException:
            self._slots.release()
            raise
        headers = conn.headers
        status = conn.head.result()
        return httpx.Response(status, headers=headers, stream=_Body(self, key, conn, timeouts.get("read")),
                              extensions={"http_version": b"HTTP/1.1"})  # fmt: skip

    async def exchange(
        self, host: str, port: int, head: bytes, body: bytes, connect_timeout: float | None,
        read_timeout: float | None,
    ) -> tuple[int, bytes]:
        """Send one request (`head`: request line and headers, without Content-Length or
        the blank line) and read its whole response: (status, body). Raises httpx's
        exceptions, as the transport does."""
        key = (host, port)
        data = b"".join([head, b"Content-Length: ", str(len(body)).encode(), b"\r\n\r\n", body])
        await self._slots.acquire()
        conn: _Conn | None = None
        try:
            conn = await self._send(key, data, {"connect": connect_timeout, "read": read_timeout})
            chunks = []
            while (chunk := await conn.next_chunk(read_timeout)) is not None:
                chunks.append(chunk)
            return conn.head.result(), b"".join(chunks)
        finally:
            if conn is None:
                self._slots.release()
            else:
                self.release(key, conn)

    async def _send(self, key: tuple[str, int], data: bytes, timeouts: dict[str, Any]) -> _Conn:
        for attempt in (0, 1):
            conn, reused = self._take(key), True
            if conn is None:
                conn, reused = await self._connect(key, timeouts.get("connect")), False
            conn.begin(data)
            try:
                async with asyncio.timeout(timeouts.get("read")):
                    await conn.head
                return conn
            except TimeoutError:
                conn.close()
                raise httpx.ReadTimeout("the engine sent no response within the read timeout") from None
            except httpx.RemoteProtocolError:
                conn.close()
                if not (reused and not conn.got_bytes and attempt == 0):
                    raise
                log.debug("kept-alive connection was closed by the engine; retrying on a new one")
            except BaseException:
                conn.close()
                raise
        raise AssertionError("unreachable")

    def _take(self, key: tuple[str, int]) -> _Conn | None:
        idle = self._idle.get(key)
        while idle:
            conn = idle.pop()
            if not conn.closed:
                return conn
        return None

    async def _connect(self, key: tuple[str, int], timeout: float | None) -> _Conn:
        loop = asyncio.get_running_loop()
        try:
            transport, conn = await asyncio.wait_for(
                loop.create_connection(_Conn, key[0], key[1]), timeout
            )
        except asyncio.TimeoutError:
            raise httpx.ConnectTimeout(f"could not connect to {key[0]}:{key[1]} in time") from None
        except OSError as exc:
            raise httpx.ConnectError(f"could not connect to {key[0]}:{key[1]}: {exc}") from exc
        conn.transport = transport  # uvloop may call connection_made later
        return conn

    def release(self, key: tuple[str, int], conn: _Conn) -> None:
        self._slots.release()
        if conn.reusable():
            self._idle.setdefault(key, []).append(conn)
        else:
            conn.close()

    async def aclose(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()
