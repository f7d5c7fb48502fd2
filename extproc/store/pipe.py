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


class _Replies(asyncio.Protocol):
    """The connection's receiving side: each reply, parsed by hiredis, resolves the oldest waiting
    caller (Redis answers in order), straight from the event loop's callback (no reader task)."""

    def __init__(self, pipe: ScriptPipe):
        self.pipe = pipe
        self.parser = hiredis.Reader()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed(data)
            waiting = self.pipe._waiting
            while (reply := self.parser.gets()) is not False:
                if waiting:
                    fut, _ = waiting.popleft()
                    if not fut.done():
                        fut.set_result(reply)
        except hiredis.ProtocolError:
            self.pipe._reset(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.pipe._reset(self)


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
        self._conn: _Replies | None = None
        self._waiting: collections.deque[tuple[asyncio.Future[Any], float]] = collections.deque()
        self._out: list[bytes] = []  # commands of this event-loop turn, written together
        self._watchdog: asyncio.Task[None] | None = None
        self._connecting: asyncio.Lock | None = None
        self._loaded: dict[str, str] = {}  # sha -> script, loaded on this connection's server

    async def _connect(self) -> _Replies:
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:
            if self._conn is not None:
                return self._conn
            loop = asyncio.get_running_loop()
            try:
                _, conn = await asyncio.wait_for(
                    loop.create_connection(lambda: _Replies(self), self.host, self.port), self.timeout_s)
            except (OSError, TimeoutError) as e:
                raise StoreUnavailable(f"store unavailable: {type(e).__name__}") from None
            self._conn = conn
            if self._watchdog is None or self._watchdog.done():
                self._watchdog = asyncio.ensure_future(self._watch())
            setup: list[tuple[Any, ...]] = []
            if self.password is not None:
                setup.append(("AUTH", *([self.username] if self.username else []), self.password))
            if self.db:
                setup.append(("SELECT", self.db))
            for cmd in setup:
                reply = await self._send(conn, cmd)
                if isinstance(reply, hiredis.ReplyError):
                    self._reset(conn)
                    raise StoreUnavailable(f"store refused {cmd[0]}")
            return conn

    def _reset(self, conn: _Replies) -> None:
        """Drop the connection: every caller still waiting on it fails (fail closed), the next reconnects."""
        if self._conn is conn:
            self._conn = None
            self._loaded.clear()
            self._out.clear()
            while self._waiting:
                fut, _ = self._waiting.popleft()
                if not fut.done():
                    fut.set_exception(StoreUnavailable("store connection lost or timed out"))
        if conn.transport is not None:
            conn.transport.close()

    async def _watch(self) -> None:
        """One timer for all commands: when the oldest unanswered command is older than the timeout, the
        connection is dropped (replies are matched by order, so it cannot be trusted any more) and
        every waiting caller fails at once. A command waits at most 1.25x the timeout."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.timeout_s / 4)
            conn = self._conn
            if conn is not None and self._waiting and loop.time() - self._waiting[0][1] > self.timeout_s:
                self._reset(conn)

    def _flush(self, conn: _Replies) -> None:
        if self._out and self._conn is conn and conn.transport is not None:
            conn.transport.write(b"".join(self._out))
            self._out.clear()

    def _queue(self, conn: _Replies, cmd: tuple[Any, ...]) -> asyncio.Future[Any]:
        """Queue one command; everything queued in this event-loop turn is written together."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        self._waiting.append((fut, loop.time()))
        if not self._out:
            loop.call_soon(self._flush, conn)
        self._out.append(hiredis.pack_command(cmd))
        return fut

    async def _send(self, conn: _Replies, cmd: tuple[Any, ...]) -> Any:
        return await self._queue(conn, cmd)

    async def _ready(self, script: str) -> tuple[_Replies, str]:
        """The connection, with the script loaded on its server; and the script's SHA."""
        sha = _sha1(script)
        conn = self._conn or await self._connect()
        if sha not in self._loaded:
            reply = await self._send(conn, ("SCRIPT", "LOAD", script))
            if isinstance(reply, hiredis.ReplyError):
                raise StoreUnavailable(f"store refused the script: {reply}")
            self._loaded[sha] = script
        return conn, sha

    async def load(self, *scripts: str) -> None:
        """Connect and load the scripts now, so the first request does not wait for it."""
        for script in scripts:
            await self._ready(script)

    async def evalsha(self, script: str, keys: list[str], args: list[Any]) -> Any:
        conn, sha = await self._ready(script)
        try:
            return self._result(await self._send(conn, ("EVALSHA", sha, len(keys), *keys, *args)))
        except _Reload:
            return await self.evalsha(script, keys, args)

    async def evalsha_many(self, script: str, calls: list[tuple[list[str], list[Any]]]) -> list[Any]:
        """Many calls of one script, written together; each is still its own atomic script. A failed
        call is returned as its exception (StoreUnavailable), the others as their results."""
        conn, sha = await self._ready(script)
        futs = [self._queue(conn, ("EVALSHA", sha, len(k), *k, *a)) for k, a in calls]
        out: list[Any] = []
        for (keys, args), fut in zip(calls, futs, strict=True):
            try:
                out.append(self._result(await fut))
            except _Reload:
                out.append(await self.evalsha(script, keys, args))
            except StoreUnavailable as e:
                out.append(e)
        return out

    def _result(self, reply: Any) -> Any:
        if isinstance(reply, hiredis.ReplyError):
            if str(reply).startswith("NOSCRIPT"):  # the server restarted and forgot it
                self._loaded.clear()
                raise _Reload
            raise StoreUnavailable(f"store script failed: {reply}")
        return _decode(reply)

    async def close(self) -> None:
        if self._conn is not None:
            self._reset(self._conn)
        if self._watchdog is not None:
            self._watchdog.cancel()


class _Reload(Exception):
    """NOSCRIPT: the server restarted since the script was loaded; load it and call again."""


@functools.cache
def _sha1(script: str) -> str:
    return hashlib.sha1(script.encode()).hexdigest()


def _decode(reply: Any) -> Any:
    if isinstance(reply, bytes):
        return reply.decode()
    if isinstance(reply, list):
        return [_decode(r) for r in reply]
    return reply
