"""Background loading: fetch entry i+1 while the engine computes with entry i.

    main thread:  [compute seg 0][compute seg 1][compute seg 2] ...
    worker:       [load 1][load 2]       [load 3] ...               (depth=2 ahead)

File reads, the blobs' checksum (XXH3 or sha256), Redis socket reads and torch copies all release
the GIL, so a thread overlaps with torch compute in the main thread. On CUDA a
worker copies hits to the device on its own stream, off the compute stream; the copies are then
recorded on the stream of the thread that asked (the compute stream), so the caching allocator never
hands their memory to a later copy while kernels queued there may still read it.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch

from blend.keys import Namespace, StoreKey
from blend.store.base import KVEntry, KVStore, Lookup, LookupStatus


@dataclass(frozen=True)
class FetchRequest:
    ns: Namespace
    key: StoreKey
    provenance: str


class Prefetcher:
    """A small pool that runs ``store.get`` off the caller's thread.

    Args:
        store: any KVStore (thread-safe: every tier here is).
        max_workers: concurrent lookups.
        device: if set (e.g. ``torch.device("cuda")``), hits are moved there by the
            worker, so the future's entry is ready to use on that device.
    """

    def __init__(self, store: KVStore, max_workers: int = 2, device: torch.device | str | None = None) -> None:
        self.store = store
        self.device = torch.device(device) if device is not None else None
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="kv-prefetch")

    def _fetch(self, ns: Namespace, key: StoreKey, provenance: str,
               consumer: torch.cuda.Stream | None = None) -> Lookup:
        found = self.store.get(ns, key, provenance)
        if found.status is not LookupStatus.HIT or self.device is None or found.entry is None:
            return found
        e = found.entry
        if self.device.type == "cuda":
            stream = torch.cuda.Stream(self.device)
            with torch.cuda.stream(stream):
                k = e.k.pin_memory().to(self.device, non_blocking=True)  # (L, Hkv, T, D)
                v = e.v.pin_memory().to(self.device, non_blocking=True)  # (L, Hkv, T, D)
            stream.synchronize()
            if consumer is not None:  # allocated on the side stream, read on the consumer's: without this, once
                k.record_stream(consumer)  # freed, their blocks went to the next copy on that (pooled) side stream
                v.record_stream(consumer)  # while kernels queued on the consumer's stream still read them
        else:
            k, v = e.k.to(self.device), e.v.to(self.device)  # (L, Hkv, T, D)
        return Lookup(found.status, KVEntry(k, v, e.provenance), found.reason, found.tier)

    def submit(self, ns: Namespace, key: StoreKey, provenance: str) -> Future[Lookup]:
        """Start a lookup; ``.result()`` gives the same Lookup ``store.get`` would. On CUDA, its tensors are
        safe to use on the stream current in the calling thread now."""
        cuda = self.device is not None and self.device.type == "cuda"
        consumer = torch.cuda.current_stream(self.device) if cuda else None
        return self._pool.submit(self._fetch, ns, key, provenance, consumer)

    def stream(self, requests: Iterable[FetchRequest], depth: int = 2) -> Iterator[Lookup]:
        """Lookups in request order, keeping ``depth`` of them in flight ahead of the consumer.

        Args:
            requests: what to look up, in the order the engine consumes them.
            depth: how many lookups run ahead (1: fetch i+1 while the caller uses i).

        Returns:
            An iterator of Lookups (one per request, same order).
        """
        pending: deque[Future[Lookup]] = deque()
        it = iter(requests)
        for r in it:
            pending.append(self.submit(r.ns, r.key, r.provenance))
            if len(pending) > depth:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> "Prefetcher":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
