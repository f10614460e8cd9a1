"""pdlab.external.silence, through stream_completion: a stream silent for longer than the session's read
timeout is broken off as a timeout (one line, a connection error); a stream that keeps sending outlives the
limit however long it runs in all; a cancel by the caller stays the caller's."""

import asyncio
import json
import time

import aiohttp
import pytest

from pdlab.external.stream import StreamError, stream_completion

LIMIT_S = 1.0
STEADY_CHUNKS, STEADY_GAP_S = 25, LIMIT_S / 10  # 2.5 limits in all; a gap is a tenth of one, so a loaded box
# that stalls the server or the client for a few hundred milliseconds does not break the steady stream off


def _chunk(i: int) -> bytes:
    return b"data: " + json.dumps({"choices": [{"index": 0, "text": "", "token_ids": [i]}]}).encode() + b"\n\n"


async def _serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """POST /steady: STEADY_CHUNKS chunks STEADY_GAP_S apart; /silent: one chunk, then nothing."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(int(v) for k, _, v in (h.partition(b":") for h in head.split(b"\r\n")) if k.lower() == b"content-length")
    await reader.readexactly(length)
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n")
    steady = head.split(b" ")[1] == b"/steady"
    for i in range(STEADY_CHUNKS if steady else 1):
        writer.write(_chunk(i))
        await writer.drain()
        if steady:
            await asyncio.sleep(STEADY_GAP_S)
    if steady:
        writer.write(b"data: [DONE]\n\n")
        await writer.drain()
        writer.close()
    else:
        await asyncio.sleep(60)


async def _both() -> tuple[list, float, float, BaseException]:
    server = await asyncio.start_server(_serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=5, sock_read=LIMIT_S)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        got: list = []
        last = [0.0]

        def on_chunk(event: dict, t: float) -> None:
            got.append(event["choices"][0]["token_ids"][0])
            last[0] = time.monotonic()

        async def silent() -> BaseException:
            try:
                await stream_completion(session, f"http://127.0.0.1:{port}/silent", {}, on_chunk)
            except StreamError as e:
                return e
            raise AssertionError("the silent stream ended without an error")

        steady, error = await asyncio.gather(
            stream_completion(session, f"http://127.0.0.1:{port}/steady", {}, lambda e, t: got.append(-1)),
            silent())
        ended = time.monotonic()
    server.close()
    return got, last[0], ended, error


def test_a_silent_stream_is_broken_off_and_a_steady_one_is_not():
    got, silent_last, ended, error = asyncio.run(_both())
    assert got.count(-1) == STEADY_CHUNKS  # the steady stream outlived its limit twice over, not broken off
    assert isinstance(error, StreamError) and error.connection and "no answer in time" in str(error)
    assert ended - silent_last >= LIMIT_S  # not before the limit after its last byte


def test_a_cancel_by_the_caller_stays_a_cancel():
    async def go() -> None:
        server = await asyncio.start_server(_serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(sock_read=LIMIT_S)) as session:
            task = asyncio.ensure_future(stream_completion(session, f"http://127.0.0.1:{port}/steady", {},
                                                           lambda e, t: None))
            await asyncio.sleep(LIMIT_S / 2)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        server.close()

    asyncio.run(go())
