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

from extproc.metrics import count_unreplicated
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
    def __init__(self, url: str, timeout_s: float, replica_acks: int = 0, replica_ack_timeout_ms: int = 0):
        u = urllib.parse.urlsplit(url)
        if u.scheme not in ("redis", ""):
            raise ValueError("the hot-path connection speaks plain redis:// (use a local proxy for TLS)")
        self.host, self.port = u.hostname or "127.0.0.1", u.port or 6379
        self.db = int((u.path or "/0").lstrip("/") or 0)
        self.password = urllib.parse.unquote(u.password) if u.password else None
        self.username = urllib.parse.unquote(u.username) if u.username else None
        self.timeout_s = timeout_s
        # After each written batch of scripts, WAIT for this many replicas (Valkey's WAIT: the writes
        # reached their memory) before any script of it is answered, so a failover cannot lose an
        # acknowledged reservation or settlement to asynchronous replication. 0: no WAIT.
        self.replica_acks, self.replica_ack_timeout_ms = replica_acks, replica_ack_timeout_ms
        self._batch_ack: asyncio.Future[int] | None = None  # the WAIT of the batch being queued
        self._ack_in_flight = False
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
            if self._batch_ack is not None and not self._batch_ack.done():
                self._batch_ack.set_exception(StoreUnavailable("store connection lost or timed out"))
            self._batch_ack, self._ack_in_flight = None, False
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
        if not (self._out and self._conn is conn and conn.transport is not None):
            return
        if conn.transport.is_closing():  # the server closed it (a refusal, a restart) before we noticed
            self._reset(conn)
            return
        if self.replica_acks and self._batch_ack is not None:
            if self._ack_in_flight:
                return  # written when the previous batch's WAIT answers: a WAIT blocks the connection
            # One WAIT after the batch: it answers once the replicas hold everything written before it.
            loop = asyncio.get_running_loop()
            ack, self._batch_ack = self._batch_ack, None
            wait: asyncio.Future[Any] = loop.create_future()
            self._waiting.append((wait, loop.time()))
            self._out.append(hiredis.pack_command(("WAIT", self.replica_acks, self.replica_ack_timeout_ms)))  # type: ignore[arg-type]
            self._ack_in_flight = True
            wait.add_done_callback(functools.partial(self._acked, conn, ack))
        conn.transport.write(b"".join(self._out))
        self._out.clear()

    def _acked(self, conn: _Replies, ack: asyncio.Future[int], wait: asyncio.Future[Any]) -> None:
        self._ack_in_flight = False
        if not ack.done():
            if wait.cancelled() or wait.exception() is not None or not isinstance(wait.result(), int):
                ack.set_exception(StoreUnavailable("store connection lost while waiting for its replicas"))
            else:
                if wait.result() < self.replica_acks:
                    count_unreplicated()  # the writes stand on the primary, with fewer copies than asked
                ack.set_result(wait.result())
        self._flush(conn)

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

    async def command(self, *cmd: Any) -> Any:
        """One command on this connection (cluster discovery: CLUSTER SHARDS); a refusal raises."""
        conn = self._conn or await self._connect()
        reply = await self._send(conn, cmd)
        if isinstance(reply, hiredis.ReplyError):
            raise StoreUnavailable(f"store refused {cmd[0]}: {reply}")
        return _decode(reply)

    def _script(self, conn: _Replies, sha: str, keys: list[str],
                args: list[Any]) -> tuple[asyncio.Future[Any], asyncio.Future[int] | None]:
        """Queue one script call: its reply, and (with replica_acks) the WAIT of the batch it is written in."""
        fut = self._queue(conn, ("EVALSHA", sha, len(keys), *keys, *args))
        if not self.replica_acks:
            return fut, None
        if self._batch_ack is None:
            self._batch_ack = asyncio.get_running_loop().create_future()
            # A caller whose script failed never awaits the WAIT: its failure is still consumed.
            self._batch_ack.add_done_callback(lambda f: f.cancelled() or f.exception())
        return fut, self._batch_ack

    async def _answer(self, fut: asyncio.Future[Any], ack: asyncio.Future[int] | None) -> Any:
        reply = await fut
        if ack is not None:
            await ack
        return self._result(reply)

    async def evalsha(self, script: str, keys: list[str], args: list[Any]) -> Any:
        conn, sha = await self._ready(script)
        try:
            return await self._answer(*self._script(conn, sha, keys, args))
        except _Reload:
            return await self.evalsha(script, keys, args)

    def ready_now(self, script: str) -> bool:
        """Whether send_now can write `script` at once."""
        conn = self._conn
        return (conn is not None and _sha1(script) in self._loaded and not self.replica_acks
                and conn.transport is not None and not conn.transport.is_closing())

    def send_now(self, script: str, keys: list[str], args: list[Any]) -> asyncio.Future[Any] | None:
        """One script call written to the connection now, before the caller does anything else (its bytes
        are in the kernel's socket buffer when this returns, unless the store has fallen behind reading
        and the transport is buffering), its reply left to come: the future of its result. None when it
        cannot be written at once (no connection yet, the script not loaded, a WAIT for replicas holding
        the connection): the caller awaits evalsha instead."""
        conn = self._conn
        if conn is None or not self.ready_now(script):
            return None
        raw = self._queue(conn, ("EVALSHA", _sha1(script), len(keys), *keys, *args))
        self._flush(conn)
        result: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

        def done(f: asyncio.Future[Any]) -> None:
            try:
                if f.cancelled():
                    raise StoreUnavailable("store call cancelled")
                result.set_result(self._result(f.result()))
            except _Reload:
                result.set_exception(StoreUnavailable("the store forgot the script (a restart)"))
            except StoreUnavailable as e:
                result.set_exception(e)
        raw.add_done_callback(done)
        return result

    async def evalsha_many(self, script: str, calls: list[tuple[list[str], list[Any]]]) -> list[Any]:
        """Many calls of one script, written together; each is still its own atomic script. A failed
        call is returned as its exception (StoreUnavailable), the others as their results."""
        conn, sha = await self._ready(script)
        futs = [self._script(conn, sha, k, a) for k, a in calls]
        out: list[Any] = []
        for (keys, args), (fut, ack) in zip(calls, futs, strict=True):
            try:
                out.append(await self._answer(fut, ack))
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
            if str(reply).startswith(("MOVED ", "ASK ")):  # Redis Cluster: the slot is served elsewhere
                raise Redirected(str(reply).split()[-1])
            raise StoreUnavailable(f"store script failed: {reply}")
        return _decode(reply)

    async def close(self) -> None:
        if self._conn is not None:
            self._reset(self._conn)
        if self._watchdog is not None:
            self._watchdog.cancel()


class Redirected(StoreUnavailable):
    """MOVED/ASK: the key's slot lives on another node (its address). A standalone store never says it;
    the cluster pipe refreshes its slot map and calls again."""

    def __init__(self, address: str):
        super().__init__(f"store redirected to {address}")
        self.address = address


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
