"""The hot path's connection to the store: one pipelined connection for the two scripts every request
runs (reserve, settle). Commands are packed and replies parsed by hiredis (C); replies are matched to
callers in order, so any number of requests share the connection without a pool.

Measured against redis-py's asyncio client on the same script: redis-py spent ~60 us of Python per
command (connection pool, retry wrapper, command packing), which at 32 concurrent requests made the
ext_proc worker the bottleneck. Everything else (reads for the sweeper, the ledger, tests) uses redis-py.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import hashlib
import urllib.parse
from typing import Any

import hiredis

from extproc.store.errors import StoreUnavailable


class ScriptPipe:
    def __init__(self, url: str, timeout_s: float):
        u = urllib.parse.urlsplit(url)
        if u.scheme not in ("redis", ""):
            raise ValueError("the hot-path connection speaks plain redis:// (use a local proxy for TLS)")
        self.host, self.port = u.hostname or "127.0.0.1", u.port or 6379
        self.db = int((u.path or "/0").lstrip("/") or 0)
        self.password = urllib.parse.unquote(u.password) if u.password else None
        self.username = urllib.parse.unquote(u.username) if u.username else None
        self.timeout_s = timeout_s
        self._writer: asyncio.StreamWriter | None = None
        self._waiting: collections.deque[tuple[asyncio.Future[Any], float]] = collections.deque()
        self._out: list[bytes] = []  # commands of this event-loop turn, written together
        self._reader_task: asyncio.Task[None] | None = None
        self._watchdog: asyncio.Task[None] | None = None
        self._connecting: asyncio.Lock | None = None
        self._loaded: dict[str, str] = {}  # sha -> script, loaded on this connection's server

    async def _connect(self) -> asyncio.StreamWriter:
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:
            if self._writer is not None:
                return self._writer
            try:
                reader, writer = await asyncio.wait_for(asyncio.open_connection(self.host, self.port), self.timeout_s)
            except (OSError, TimeoutError) as e:
                raise StoreUnavailable(f"store unavailable: {type(e).__name__}") from None
            self._writer = writer
            self._reader_task = asyncio.ensure_future(self._read(reader, writer))
            if self._watchdog is None or self._watchdog.done():
                self._watchdog = asyncio.ensure_future(self._watch())
            setup: list[tuple[Any, ...]] = []
            if self.password is not None:
                setup.append(("AUTH", *([self.username] if self.username else []), self.password))
            if self.db:
                setup.append(("SELECT", self.db))
            for cmd in setup:
                reply = await self._send(writer, cmd)
                if isinstance(reply, hiredis.ReplyError):
                    self._reset(writer)
                    raise StoreUnavailable(f"store refused {cmd[0]}")
            return writer

    async def _read(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        parser = hiredis.Reader()
        try:
            while True:
                data = await reader.read(65536)
                if not data:
                    break
                parser.feed(data)
                while (reply := parser.gets()) is not False:
                    if self._waiting:
                        fut, _ = self._waiting.popleft()
                        if not fut.done():
                            fut.set_result(reply)
        except (OSError, hiredis.ProtocolError):
            pass
        finally:
            self._reset(writer)

    def _reset(self, writer: asyncio.StreamWriter) -> None:
        """Drop the connection: every caller still waiting on it fails (fail closed), the next reconnects."""
        if self._writer is writer:
            self._writer = None
            self._loaded.clear()
            self._out.clear()
            while self._waiting:
                fut, _ = self._waiting.popleft()
                if not fut.done():
                    fut.set_exception(StoreUnavailable("store connection lost or timed out"))
        writer.close()

    async def _watch(self) -> None:
        """One timer for all commands: when the oldest unanswered command is older than the timeout, the
        connection is dropped (replies are matched by order, so it cannot be trusted any more) and
        every waiting caller fails at once. A command waits at most 1.25x the timeout."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.timeout_s / 4)
            writer = self._writer
            if writer is not None and self._waiting and loop.time() - self._waiting[0][1] > self.timeout_s:
                self._reset(writer)

    def _flush(self, writer: asyncio.StreamWriter) -> None:
        if self._out and self._writer is writer:
            writer.write(b"".join(self._out))
            self._out.clear()

    async def _send(self, writer: asyncio.StreamWriter, cmd: tuple[Any, ...]) -> Any:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        self._waiting.append((fut, loop.time()))
        if not self._out:
            loop.call_soon(self._flush, writer)
        self._out.append(hiredis.pack_command(cmd))
        return await fut

    async def evalsha(self, script: str, keys: list[str], args: list[Any]) -> Any:
        sha = _sha1(script)
        writer = self._writer or await self._connect()
        if sha not in self._loaded:
            reply = await self._send(writer, ("SCRIPT", "LOAD", script))
            if isinstance(reply, hiredis.ReplyError):
                raise StoreUnavailable(f"store refused the script: {reply}")
            self._loaded[sha] = script
        reply = await self._send(writer, ("EVALSHA", sha, len(keys), *keys, *args))
        if isinstance(reply, hiredis.ReplyError):
            if str(reply).startswith("NOSCRIPT"):  # the server restarted and forgot it
                self._loaded.pop(sha, None)
                return await self.evalsha(script, keys, args)
            raise StoreUnavailable(f"store script failed: {reply}")
        return _decode(reply)

    async def close(self) -> None:
        if self._writer is not None:
            self._reset(self._writer)
        for task in (self._reader_task, self._watchdog):
            if task is not None:
                task.cancel()


@functools.cache
def _sha1(script: str) -> str:
    return hashlib.sha1(script.encode()).hexdigest()


def _decode(reply: Any) -> Any:
    if isinstance(reply, bytes):
        return reply.decode()
    if isinstance(reply, list):
        return [_decode(r) for r in reply]
    return reply
