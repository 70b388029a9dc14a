"""The collector's lean HTTP/1.1 transport against small real servers on localhost:
keep-alive reuse, a retry when the server had closed a kept-alive connection, streamed
chunked bodies, and the timeouts and errors the engine client maps."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
import pytest

from services.collector.engine_transport import EngineTransport
from tests.support.servers import free_port

pytestmark = pytest.mark.integration

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[bool]]


async def read_request(reader: asyncio.StreamReader) -> bytes | None:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    return head + await reader.readexactly(length)


def response(body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: %d\r\n%s\r\n%s" % (
        len(body), extra, body,
    )  # fmt: skip


class Server:
    """asyncio server; `handler(reader, writer, n)` answers the n-th request of a connection
    and returns whether to keep the connection."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        n = 0
        try:
            while await read_request(reader) is not None:
                n += 1
                if not await self.handler(reader, writer, n):
                    break
        finally:
            writer.close()

    async def __aenter__(self) -> Server:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(transport=EngineTransport(8), timeout=httpx.Timeout(1.0, connect=1.0)) as c:
        yield c


async def test_keep_alive_connections_are_reused(client: httpx.AsyncClient) -> None:
    async def ok(_: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> bool:
        w.write(response(b"hello %d" % n))
        return True

    async with Server(ok) as srv:
        bodies = [(await client.post(srv.url + "/x?q=1", content=b"{}")).text for _ in range(5)]
        assert bodies == [f"hello {i}" for i in range(1, 6)]
        assert srv.connections == 1
        got = await asyncio.gather(*(client.get(srv.url + "/y") for _ in range(4)))
        assert all(r.status_code == 200 for r in got) and srv.connections <= 4


async def test_a_kept_alive_connection_closed_by_the_server_is_retried(client: httpx.AsyncClient) -> None:
    async def once(_: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> bool:
        if n > 1:
            return False  # the server dropped it (keep-alive expiry) without answering
        w.write(response(b"fresh"))
        return True

    async with Server(once) as srv:
        assert (await client.get(srv.url)).text == "fresh"
        assert (await client.get(srv.url)).text == "fresh"
        assert srv.connections == 2


async def test_chunked_bodies_stream_as_they_arrive(client: httpx.AsyncClient) -> None:
    go_on = asyncio.Event()

    async def sse(_: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> bool:
        w.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        for i in range(3):
            data = b"data: %d\n\n" % i
            w.write(b"%x\r\n%s\r\n" % (len(data), data))
            await w.drain()
            if i == 0:
                await go_on.wait()
        w.write(b"0\r\n\r\n")
        return True

    async with Server(sse) as srv, client.stream("POST", srv.url + "/generate", content=b"{}") as r:
        lines = r.aiter_lines()
        assert await anext(lines) == "data: 0"  # before the server has sent the rest
        go_on.set()
        rest = [line async for line in lines if line]
    assert rest == ["data: 1", "data: 2"]


async def test_timeouts_and_errors(client: httpx.AsyncClient) -> None:
    async def silent(_: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> bool:
        await asyncio.sleep(5)
        return False

    async with Server(silent) as srv:
        with pytest.raises(httpx.ReadTimeout):
            await client.get(srv.url)
    with pytest.raises(httpx.ConnectError):
        await client.get(f"http://127.0.0.1:{free_port()}/")

    async def half(_: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> bool:
        w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly part")
        return False  # and the connection closes

    async with Server(half) as srv:
        with pytest.raises(httpx.RemoteProtocolError):
            await client.get(srv.url)
