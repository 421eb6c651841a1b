"""The trainer's end of a weight-update group (``--weight-sync-path distributed``): rank 0
of a :class:`~miles_core.engine.weight_group.WeightGroup` whose other members are the
engine servers, which it asks to join (``POST /init_weights_update_group``), feeds bucket
by bucket (``POST /update_weights_from_distributed`` with each bucket's names, dtypes and
shapes, then one broadcast of its flat buffer) and lets go (``POST
/destroy_weights_update_group``). The endpoints have the shape of sglang's distributed
update API; docs/design.md, "Weight sync", has the protocol."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import aiohttp
import torch

from miles_core.engine.auth import auth_headers
from miles_core.engine.weight_group import (
    DEFAULT_JOIN_TIMEOUT_S,
    WeightGroup,
    bucket_layout,
    bucket_metadata,
    in_daemon_thread,
    master_address_for,
    master_store,
    pack_bucket,
)
from miles_core.errors import EngineRequestError, WeightGroupError
from miles_core.weights import iter_buckets

DESTROY = "/destroy_weights_update_group"

_GRACE_S = 5.0
"""How long this end waits for the servers' answers after its own side of a collective failed."""


class GroupSender:
    """Rank 0 of a weight-update group with the servers ``urls`` (server *i* is rank
    ``1 + i``): :meth:`open` it once, :meth:`send` each module's weights, :meth:`close` it."""

    def __init__(
        self,
        urls: Sequence[str],
        *,
        backend: str = "gloo",
        master_address: str | None = None,
        join_timeout: float = DEFAULT_JOIN_TIMEOUT_S,
        timeout: float = 600.0,
        api_key: str | None = None,
    ) -> None:
        self.urls = [url.rstrip("/") for url in urls]
        self.api_key = api_key
        """What every request to the servers carries (``Authorization: Bearer``); None: nothing."""
        self.backend = backend
        self.master_address = master_address or master_address_for(self.urls)
        self.join_timeout = join_timeout
        self.timeout = timeout
        self.name = f"miles-weights-{uuid.uuid4().hex[:12]}"
        self.group: WeightGroup | None = None
        self.port: int | None = None
        self.broken: str | None = None
        """Why the group cannot be used any more (a member refused or went away mid-bucket)."""
        self.broadcast_seconds = 0.0
        """Time spent packing and broadcasting buckets (the transfer, without the HTTP answers)."""

    def _session(self) -> aiohttp.ClientSession:
        return aiohttp.ClientSession(headers=auth_headers(self.api_key))

    async def _post(self, session: aiohttp.ClientSession, url: str, path: str, body: Any, timeout: float | None) -> Any:
        try:
            async with session.post(url + path, json=body, timeout=aiohttp.ClientTimeout(total=timeout)) as response:
                raw = await response.read()
                status = response.status
        except asyncio.TimeoutError:
            raise EngineRequestError(url + path, None, f"TimeoutError: no answer within {timeout:g} s") from None
        except aiohttp.ClientError as exc:
            raise EngineRequestError(url + path, None, f"{type(exc).__name__}: {exc}") from None
        try:
            answer = json_loads(raw)
        except ValueError:
            answer = None
        if status != 200:
            message = answer.get("error") if isinstance(answer, dict) else None
            raise EngineRequestError(url + path, status, str(message or raw[:500].decode("utf-8", "replace")))
        return answer

    async def _exchange(self, session: aiohttp.ClientSession, path: str, bodies: Sequence[Any], mine: Any, timeout: float | None) -> None:
        """Post ``bodies[i]`` to server *i* while this end does ``mine`` (a future: its side
        of the collective); the first failure is raised at once (a collective a member left
        never ends). A server's own answer names it, so it wins over this end's error."""
        posts = [asyncio.ensure_future(self._post(session, url, path, body, timeout)) for url, body in zip(self.urls, bodies)]
        try:
            await asyncio.wait([*posts, mine], return_when=asyncio.FIRST_EXCEPTION)
            if mine.done() and mine.exception() is not None:
                # This end gave up (a member never came): give the servers a moment to say why.
                await asyncio.wait(posts, timeout=_GRACE_S)
            for task in posts:
                if task.done() and task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]
            if mine.done() and mine.exception() is not None:
                silent = [url for url, task in zip(self.urls, posts) if not task.done()]
                if silent:
                    raise EngineRequestError(silent[0] + path, None, f"no answer, and this end failed: {mine.exception()}")
                raise mine.exception()  # type: ignore[misc]
            await asyncio.gather(*posts, mine)
        finally:
            for task in posts:
                if not task.done():
                    task.cancel()
            await asyncio.gather(*posts, return_exceptions=True)

    async def open(self, *, startup: bool = False) -> None:
        """Create the group: this end on a free port of :attr:`master_address`, every
        server asked to join. A server that cannot join raises :class:`WeightGroupError`
        naming its URL and the address (``startup``: exit status 2)."""
        world = len(self.urls) + 1
        try:
            store = master_store(world, self.join_timeout)
        except Exception as exc:
            raise WeightGroupError(
                f"weight-update group: cannot listen on {self.master_address} ({type(exc).__name__}: {exc})", startup=startup
            ) from None
        self.port = store.port
        where = f"{self.master_address}:{self.port}"
        bodies = [
            {
                "master_address": self.master_address,
                "master_port": self.port,
                "rank_offset": 1 + index,
                "world_size": world,
                "group_name": self.name,
                "backend": self.backend,
                "timeout_s": self.join_timeout,
            }
            for index in range(len(self.urls))
        ]
        mine = in_daemon_thread(
            lambda: WeightGroup.join(
                name=self.name,
                master_address=self.master_address,
                master_port=self.port,
                rank=0,
                world_size=world,
                backend=self.backend,
                join_timeout=self.join_timeout,
                timeout=self.timeout,
                store=store,
            )
        )
        async with self._session() as session:
            try:
                await self._exchange(session, "/init_weights_update_group", bodies, mine, self.join_timeout + 30)
            except EngineRequestError as exc:
                await self._disband(session)
                url = exc.url.removesuffix("/init_weights_update_group")
                raise WeightGroupError(
                    f"{url}: could not join the weight-update group at {where}: {' '.join(exc.message.split())}", startup=startup
                ) from None
            except WeightGroupError as exc:
                await self._disband(session)
                raise WeightGroupError(str(exc), startup=startup) from None
        self.group = mine.result()

    async def _disband(self, session: aiohttp.ClientSession) -> None:
        """The group could not be made: the servers that joined it leave it (they would
        otherwise hold it, and its sockets, as long as they run)."""
        await asyncio.gather(
            *(self._post(session, url, DESTROY, {"group_name": self.name}, 10.0) for url in self.urls), return_exceptions=True
        )

    async def send(
        self,
        module_name: str,
        named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        *,
        buffer_size: int,
        lora_only: bool = False,
        lora_config: Mapping[str, Any] | None = None,
    ) -> int:
        """Send a module's tensors to every server, buckets of at most ``buffer_size``
        bytes; returns the number of tensors. A server that refuses a bucket raises its
        :class:`EngineRequestError` (the group is then :attr:`broken`)."""
        group = self.group
        if group is None:
            raise WeightGroupError(f"weight-update group {self.name}: {self.broken or 'not open'}")
        items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
        count = 0
        async with self._session() as session:
            for bucket in iter_buckets(items, buffer_size):
                body: dict[str, Any] = {
                    **bucket_metadata(bucket),
                    "group_name": self.name,
                    "target_module": module_name,
                    "lora_only": lora_only,
                }
                if lora_config is not None:
                    body["lora_config"] = dict(lora_config)
                tensors = list(bucket.values())

                def transfer(tensors: list[torch.Tensor] = tensors) -> float:
                    with group.bucket_lock:
                        began = time.perf_counter()
                        _, size = bucket_layout([t.dtype for t in tensors], [tuple(t.shape) for t in tensors])
                        group.broadcast(pack_bucket(tensors, group.device, out=group.staging(size)), src=0)
                        return time.perf_counter() - began

                mine = in_daemon_thread(transfer)
                try:
                    await self._exchange(session, "/update_weights_from_distributed", [body] * len(self.urls), mine, self.timeout)
                except BaseException as exc:
                    await self._abandon(session, mine, f"a bucket of {module_name} did not go through ({type(exc).__name__}: {exc})")
                    raise
                self.broadcast_seconds += mine.result()
                count += len(bucket)
        return count

    async def _abandon(self, session: aiohttp.ClientSession, mine: Any, reason: str) -> None:
        """A bucket failed: every server is asked to leave the group, which ends this end's
        broadcast if it still waits for one of them; the next sync makes a new group."""
        self.broken = reason
        group, self.group = self.group, None
        await asyncio.gather(
            *(self._post(session, url, DESTROY, {"group_name": self.name}, 10.0) for url in self.urls), return_exceptions=True
        )
        await asyncio.wait([mine], timeout=_GRACE_S)
        if mine.done() and not mine.cancelled():
            mine.exception()  # retrieved: its failure is the servers' leaving
        if group is not None:
            await asyncio.wait([in_daemon_thread(group.close)], timeout=_GRACE_S)

    async def close(self) -> None:
        """Ask every server to leave the group (one that is gone is not waited for) while
        this end leaves it too: a member's side closes once the others close theirs, so
        both go at once."""
        group, self.group = self.group, None
        leaving = in_daemon_thread(group.close) if group is not None else None
        try:
            async with self._session() as session:
                await asyncio.gather(
                    *(self._post(session, url, DESTROY, {"group_name": self.name}, 10.0) for url in self.urls), return_exceptions=True
                )
        finally:
            if leaving is not None:
                await asyncio.wait([leaving], timeout=_GRACE_S)


def json_loads(raw: bytes) -> Any:
    return json.loads(raw) if raw else None


__all__ = ["GroupSender"]
