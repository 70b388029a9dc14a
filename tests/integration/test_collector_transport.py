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
        self.writers.append(writer)
        n = 0
        try:
            while await read_request(reader) is not None:
                n += 1
                if not await self.handler(reader, writer, n):
                    break
        finally:
            writer.close()

    async def __aenter__(self) -> Server:
        self.writers: list[asyncio.StreamWriter] = []
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()
        for writer in self.writers:  # handlers still waiting when the test ends
            writer.close()


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
    async def silent(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> bool:
        await r.read()  # until the client gives up and closes
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


# -- the engine client's JSON calls over `exchange` (no httpx models) ------------------------


def json_response(status: bytes, body: bytes) -> bytes:
    return b"HTTP/1.1 %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
        status, len(body), body,
    )  # fmt: skip


async def test_engine_json_calls_go_through_exchange_with_the_token_and_path() -> None:
    from shared.engine_client.sglang import SGLangClient

    seen: list[bytes] = []

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> bool:
        w.write(json_response(b"200 OK", b'{"ok": %d}' % n))
        return True

    class Recording(Server):
        async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.connections += 1
            self.writers.append(writer)
            n = 0
            while (req := await read_request(reader)) is not None:
                seen.append(req)
                n += 1
                await self.handler(reader, writer, n)
            writer.close()

    async with Recording(handler) as srv:
        transport = EngineTransport(1)  # one slot: a leaked slot would hang the next call
        engine = SGLangClient(srv.url + "/prefix", transport=transport, api_key="tok", timeout=1.0)
        assert engine._direct is transport
        got = [await engine.json("POST", "/generate", json_body={"input_ids": [1, 2]}) for _ in range(3)]
        await engine.aclose()
    assert got == [{"ok": 1}, {"ok": 2}, {"ok": 3}] and srv.connections == 1
    head, _, body = seen[0].partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    assert lines[0] == b"POST /prefix/generate HTTP/1.1"
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(b":") for line in lines[1:])}
    assert headers[b"authorization"] == b"Bearer tok"
    assert headers[b"host"] == f"127.0.0.1:{srv.port}".encode()
    assert int(headers[b"content-length"]) == len(body) and body == b'{"input_ids":[1,2]}'


async def test_engine_json_call_errors_map_as_over_httpx_and_free_their_slot() -> None:
    from shared.engine_client.sglang import SGLangClient
    from shared.errors import EngineRejected, EngineTimeout, EngineUnavailable

    answers = {
        1: json_response(b"400 Bad Request", b'{"error": {"message": "prompt too long"}}'),
        2: json_response(b"503 Service Unavailable", b'{"message": "overloaded"}'),
        3: json_response(b"200 OK", b"not json"),
        4: None,  # silent: read timeout
        5: b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly part",  # then the connection closes
    }
    calls = 0

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> bool:
        nonlocal calls
        calls += 1
        answer = answers.get(calls, json_response(b"200 OK", b'{"fine": true}'))
        if answer is None:
            await r.read()  # until the client gives up and closes
            return False
        w.write(answer)
        return calls != 5

    async with Server(handler) as srv:
        engine = SGLangClient(srv.url, transport=EngineTransport(1), timeout=0.5)
        with pytest.raises(EngineRejected, match="prompt too long") as rejected:
            await engine.json("POST", "/generate", json_body={})
        assert rejected.value.status_code == 400
        with pytest.raises(EngineUnavailable, match="overloaded"):
            await engine.json("POST", "/generate", json_body={})
        with pytest.raises(EngineUnavailable, match="invalid JSON"):
            await engine.json("POST", "/generate", json_body={})
        with pytest.raises(EngineTimeout):
            await engine.json("POST", "/generate", json_body={})
        with pytest.raises(EngineUnavailable, match="closed the connection"):
            await engine.json("POST", "/generate", json_body={})
        assert await engine.json("POST", "/generate", json_body={}) == {"fine": True}  # the slot is free
        await engine.aclose()
    with pytest.raises(EngineUnavailable, match="unreachable"):
        engine = SGLangClient(f"http://127.0.0.1:{free_port()}", transport=EngineTransport(1), timeout=0.5)
        await engine.json("POST", "/generate", json_body={})
