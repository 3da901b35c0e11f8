"""Registration, leases and quotas: which pools live, for whom, how large.

A worker registers one pool and gets a pool id, an epoch, a credential and
a lease; a live pool of the same worker id is replaced only with its
credential. A pool is dropped when its worker deregisters, its lease runs
out, or its state cannot be kept (the snapshot writer's `drop_pools`).
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import secrets
from dataclasses import replace
from typing import NamedTuple

from allocator_service.config import ServiceConfig
from allocator_service.core import PoolConfig
from allocator_service.core.limits import MAX_ADVERTISE_URL_LEN, MAX_SERVED_MODEL_NAME_LEN
from allocator_service.service.changes import Changes, PoolRef, Reloaded
from allocator_service.store.registry import PoolEntry, Registry, new_pool
from allocator_service.wire.attest import credential_digest
from allocator_service.wire.codec import shape_to_proto
from allocator_service.wire.errors import (
    BadRequest,
    CapacityExceeded,
    PermissionDenied,
    PoolInUse,
    QuotaExceeded,
    StoreUnavailable,
)
from allocator_service.wire.v1 import journal_pb2 as jpb
from pagedkv_base.store_url import is_peer

log = logging.getLogger(__name__)


class Registration(NamedTuple):
    pool_id: str
    epoch: int
    credential: str
    lease_ttl_s: float
    shared_store: str = ""  # the store's URL, for a pool that uses it
    store_namespace: str = ""  # where its blocks live in that store (`core.tiers.store_namespace`)
    peer_key: str = ""  # a peer store: its group's key to the workers' peer route
    peer_store_bytes: int = 0  # a peer store: its capacity (what one worker may hold of it)


class Advertised(NamedTuple):
    """What a worker tells routers about itself when it registers its pool."""

    advertise_url: str = ""
    served_model_name: str = ""

    def check(self) -> None:
        """BadRequest unless both are within their bounds (empty = not given)."""
        url, name = self.advertise_url, self.served_model_name
        if url and (
            len(url) > MAX_ADVERTISE_URL_LEN
            or not url.isprintable()
            or " " in url
            or not url.startswith(("http://", "https://"))
            or len(url.split("://", 1)[1]) == 0
        ):
            raise BadRequest(
                f"advertise_url must be an http:// or https:// URL of at most "
                f"{MAX_ADVERTISE_URL_LEN} printable characters without spaces"
            )
        if len(name) > MAX_SERVED_MODEL_NAME_LEN or not name.isprintable():
            raise BadRequest(
                f"served_model_name must be at most {MAX_SERVED_MODEL_NAME_LEN} "
                "printable characters"
            )


NOT_ADVERTISED = Advertised()


class Pools:
    """Registers, renews and drops pools, within the server's capacity and
    each worker's quota."""

    def __init__(self, changes: Changes, config: ServiceConfig) -> None:
        self.changes = changes
        self.config = config
        self.limits = config.limits

    def register(
        self,
        worker_id: str,
        config: PoolConfig,
        replace_credential: str = "",
        advertised: Advertised = NOT_ADVERTISED,
        protocol_version: int = 0,
    ) -> Registration:
        """A new pool of shape `config` for `worker_id`. A live pool of the
        same worker id is replaced only with its credential; else PoolInUse
        until its lease expires (so nobody can drop another worker's pool by
        naming it). `advertised`: its HTTP URL and served model name, for
        routers; `protocol_version`: the client's (from
        `PREV_STEP_ID_REQUIRED` on, each Step of the pool must carry
        prev_step_id)."""
        limit = self.limits.max_worker_id_len
        if (
            not worker_id
            or len(worker_id) > limit
            or "/" in worker_id
            or not worker_id.isprintable()
        ):
            raise BadRequest(f"worker_id must be 1 to {limit} printable characters without '/'")
        advertised.check()
        if config.store_group:
            raise BadRequest(
                "store_group is the allocator's to set, from the worker's credential "
                "(its group= in --worker-tokens-file)"
            )
        changes = self.changes
        if config.use_shared_store and changes.registry.store is None:
            # no store here: the pool is registered (and journaled) without it
            config = replace(config, use_shared_store=False)
        elif config.use_shared_store:
            # its trust domain in the store, journaled with the pool (replays never ask the
            # policy again)
            config = replace(config, store_group=self.config.store_groups.get(worker_id, ""))
            if changes.registry.store.peer and not advertised.advertise_url:
                raise BadRequest(
                    "the allocator's shared store is peer://: a pool that uses it must advertise "
                    "its worker's URL (--advertise-url), where the others pull its entries from"
                )
        # before the pool is built: a refused one costs nothing
        self._check_quota(worker_id, config.num_blocks)
        credential = secrets.token_urlsafe(32)
        digest = credential_digest(credential)
        fresh = new_pool(config, changes.registry.store)  # O(blocks): before any lock

        def attempt() -> PoolEntry:
            reg = changes.registry
            old = reg.pools.get(reg.current.get(worker_id, ""))
            with old.lock if old is not None else contextlib.nullcontext():
                with changes.lock:
                    reg = changes.durable.fresh()
                    if reg.pools.get(reg.current.get(worker_id, "")) is not old:
                        raise Reloaded  # replaced or reloaded while we waited
                    return self._register(
                        reg,
                        worker_id,
                        config,
                        digest,
                        old,
                        replace_credential,
                        fresh,
                        advertised,
                        protocol_version,
                    )

        entry = changes.retrying(attempt)
        changes.durable.after_change()
        log.info(
            "registered pool %s (%d blocks of %d)",
            entry.pool_id,
            config.num_blocks,
            config.block_size,
        )
        return Registration(
            entry.pool_id,
            entry.epoch,
            credential,
            self.config.lease_ttl_s,
            changes.registry.store_url if config.use_shared_store else "",
            config.store_namespace,
            changes.registry.peer_key(config.store_group) if config.use_shared_store else "",
            changes.registry.store.capacity_bytes
            if config.use_shared_store and changes.registry.store.peer
            else 0,
        )

    def _register(
        self,
        reg: Registry,
        worker_id: str,
        config: PoolConfig,
        digest: bytes,
        old: PoolEntry | None,
        replace_credential: str,
        fresh,
        advertised: Advertised = NOT_ADVERTISED,
        protocol_version: int = 0,
    ) -> PoolEntry:
        changes = self.changes
        if old is not None:
            self._check_replace(old, replace_credential)
        if config.use_shared_store and fresh[0].tiers.store is not reg.store:
            fresh = new_pool(config, reg.store)  # the registry was reloaded meanwhile: its store
        pools = len(reg.pools) - (old is not None)
        if pools >= self.limits.max_pools:
            raise CapacityExceeded(f"the server holds its maximum of {self.limits.max_pools} pools")
        blocks = sum(e.pool.num_blocks for e in reg.pools.values()) - (
            old.pool.num_blocks if old else 0
        )
        held = {e.worker_id: e.pool.num_blocks for e in reg.pools.values()}
        # What the other workers' quotas keep for them beyond what they hold now (a restart
        # included).
        kept = sum(
            max(q - held.get(w, 0), 0)
            for w, q in self.config.reserved_blocks.items()
            if w != worker_id
        )
        if blocks + kept + config.num_blocks > self.limits.max_total_blocks:
            raise CapacityExceeded(
                f"{config.num_blocks} more blocks would exceed the server's "
                f"{self.limits.max_total_blocks} (in use: {blocks}"
                + (f"; kept for other workers' quotas: {kept}" if kept else "")
                + ")"
            )
        epoch = reg.next_epoch(worker_id)
        changes.durable.append(
            registered=jpb.PoolRegistered(
                pool_id=f"{worker_id}/{epoch}",
                worker_id=worker_id,
                epoch=epoch,
                shape=shape_to_proto(config),
                credential_digest=digest,
                advertise_url=advertised.advertise_url,
                served_model_name=advertised.served_model_name,
                protocol_version=protocol_version,
            )
        )
        if old is not None and reg.uses_store(old):
            changes.durable.settle_store()  # dropping it drops its pending store saves
        batch = reg.advance()
        try:
            entry = reg.register(
                worker_id,
                epoch,
                config,
                digest,
                batch,
                fresh,
                **advertised._asdict(),
                protocol_version=protocol_version,
            )
        finally:
            changes.events.finish(batch)
        if old is not None:
            changes.leases.forget(old.pool_id)
        changes.leases.arm(entry.pool_id)
        changes.durable.changed()
        return entry

    def _check_quota(self, worker_id: str, num_blocks: int) -> None:
        """QuotaExceeded past the worker's quota, or for a worker without
        one past `max_pool_blocks`."""
        quota = self.config.reserved_blocks.get(worker_id)
        if quota is not None and num_blocks > quota:
            raise QuotaExceeded(
                f"worker {worker_id!r} may register at most {quota} blocks "
                f"(its quota in --worker-tokens-file), not {num_blocks}"
            )
        most = self.config.max_pool_blocks
        if quota is None and most is not None and num_blocks > most:
            raise QuotaExceeded(
                f"a pool may have at most {most} blocks (--max-pool-blocks), not {num_blocks}"
            )

    def _check_replace(self, old: PoolEntry, credential: str) -> None:
        if not credential:
            raise PoolInUse(
                f"worker id {old.worker_id!r} has a live pool {old.pool_id} (its lease expires in "
                f"{self.changes.leases.remaining(old.pool_id):.1f} s unless renewed): present its "
                "credential as replace_credential to replace it, or wait for the lease to expire"
            )
        if not hmac.compare_digest(credential_digest(credential), old.credential_digest):
            raise PermissionDenied(
                f"replace_credential is not the credential of pool {old.pool_id!r}"
            )

    def heartbeat(self, ref: PoolRef) -> float:
        """Renews the pool's lease (no pool's lock, no mutation lock); its TTL."""
        self.changes.authorize(ref)
        return self.config.lease_ttl_s

    def deregister(self, ref: PoolRef) -> None:
        changes = self.changes

        def attempt() -> None:
            entry = changes.authorize(ref)
            with entry.lock, changes.lock:
                changes.live(entry)
                changes.drop(entry.pool_id, "deregistered")

        changes.retrying(attempt)
        changes.durable.after_change()

    def configure_store(self) -> None:
        """At start (mutation lock held): the shared store of the config,
        journaled when it differs from the one recorded (`StoreConfigured`);
        the pools that used that one are dropped first (`store_changed`:
        their workers re-register and learn the new store)."""
        changes = self.changes
        url, size = self.config.shared_store, self.config.shared_store_bytes
        reg = changes.registry
        capacity = reg.store.capacity_bytes if reg.store is not None else 0
        if reg.store_url == url and capacity == size:
            return
        for e in [e for e in reg.pools.values() if reg.uses_store(e)]:
            changes.drop(e.pool_id, "store_changed")
        # a peer store: the secret its groups' peer keys derive from, journaled with it
        secret = secrets.token_bytes(32) if is_peer(url) else b""
        changes.durable.append(
            store=jpb.StoreConfigured(url=url, capacity_bytes=size, peer_secret=secret)
        )
        batch = reg.advance()
        try:
            reg.configure_store(url, size, secret)
        finally:
            changes.events.finish(batch)
        changes.durable.changed()
        if url:
            log.info("shared KV store %s, %d bytes", url, size)

    def expire_leases(self) -> list[str]:
        """Drop every pool whose lease ran out (the reaper calls this). Each
        drop takes the locks as a change does (the pool's, then the mutation
        lock), so waiting for a busy pool holds up no other pool."""
        changes = self.changes
        dropped: list[str] = []
        for pool_id in changes.leases.expired():
            entry = changes.registry.pools.get(pool_id)
            if entry is None:
                changes.leases.forget(pool_id)
                continue
            try:
                with entry.lock, changes.lock:
                    reg = changes.durable.fresh()
                    if reg.pools.get(pool_id) is not entry:
                        continue  # dropped or reloaded meanwhile: the next round looks again
                    if not changes.leases.is_expired(pool_id):
                        continue  # renewed while we waited for the pool
                    changes.drop(pool_id, "lease_expired")
            except StoreUnavailable as exc:
                log.warning(
                    "lease of %s expired but the drop cannot be journaled: %s", pool_id, exc
                )
                break
            dropped.append(pool_id)
        if dropped:
            changes.durable.after_change()
        return dropped

    def drop_pools(self, pool_ids: list[str], reason: str) -> list[str]:
        """Drop these pools loudly (their workers get NOT_FOUND and register
        again), each taking the locks as a change does: the snapshot
        writer's way to keep one pool from holding up every snapshot.
        Returns the pools dropped."""
        changes = self.changes
        dropped: list[str] = []
        for pool_id in pool_ids:
            entry = changes.registry.pools.get(pool_id)
            if entry is None:
                continue
            try:
                with entry.lock, changes.lock:
                    if changes.durable.fresh().pools.get(pool_id) is not entry:
                        continue
                    changes.drop(pool_id, reason)
            except StoreUnavailable as exc:
                log.warning(
                    "pool %s is to be dropped (%s) but the drop cannot be journaled: %s",
                    pool_id,
                    reason,
                    exc,
                )
                break
            dropped.append(pool_id)
        return dropped
