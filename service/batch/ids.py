"""A table of custom_ids that stays small however many a job has (`IdTable`): each id is kept as a
128-bit BLAKE2b hash of its UTF-8 bytes with one int beside it (an input's first line for an id, a
resume's verdict on a row), 24 bytes an id, not the ~100 a Python set of strings costs.

Two ids are taken as the same when their hashes are: among n distinct ids the chance that any two
share a hash is below n^2 / 2^129 (1.5e-27 for a million ids, 1.5e-21 for a billion), which is
negligible next to a disk corrupting a row.

The hashes live in numpy arrays sorted by their high 64 bits, found by binary search; new ones go
to a small dict first and are merged in when it holds 1/64 of the sorted part (at least 4096), so
the dict adds under 2 bytes an id and a merge's cost stays in proportion to what it adds.
"""

from __future__ import annotations

import hashlib

import numpy as np

_MASK = (1 << 64) - 1
_MIN_RECENT = 4096  # ids the dict holds before its first merge
_RECENT_SHARE = 64  # later: merged when the dict holds 1/64 of the sorted part


def _key(custom_id: str) -> int:
    # surrogatepass: an id from JSON may hold a lone surrogate ("\ud800"); its bytes stay distinct.
    digest = hashlib.blake2b(custom_id.encode("utf-8", "surrogatepass"), digest_size=16).digest()
    return int.from_bytes(digest, "little")


class IdTable:
    """custom_id -> int; an id's value, once inserted, stays."""

    def __init__(self) -> None:
        self._hi = np.empty(0, np.uint64)  # sorted
        self._lo = np.empty(0, np.uint64)
        self._values = np.empty(0, np.int64)
        self._recent: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._hi) + len(self._recent)

    def get(self, custom_id: str) -> int | None:
        return self._find(_key(custom_id))

    def insert(self, custom_id: str, value: int) -> int | None:
        """The value `custom_id` has already (the table unchanged), or None once it has `value`."""
        key = _key(custom_id)
        earlier = self._find(key)
        if earlier is None:
            self._recent[key] = value
            if len(self._recent) >= max(_MIN_RECENT, len(self._hi) // _RECENT_SHARE):
                self._merge()
        return earlier

    def _find(self, key: int) -> int | None:
        value = self._recent.get(key)
        if value is not None:
            return value
        hi, lo = np.uint64(key >> 64), np.uint64(key & _MASK)
        i = int(self._hi.searchsorted(hi))
        while i < len(self._hi) and self._hi[i] == hi:  # more than one only if two ids share 64 bits
            if self._lo[i] == lo:
                return int(self._values[i])
            i += 1
        return None

    def _merge(self) -> None:
        count = len(self._recent)
        hi = np.fromiter((k >> 64 for k in self._recent), np.uint64, count)
        lo = np.fromiter((k & _MASK for k in self._recent), np.uint64, count)
        values = np.fromiter(self._recent.values(), np.int64, count)
        self._recent = {}
        order = np.argsort(hi, kind="stable")
        hi, lo, values = hi[order], lo[order], values[order]
        at = self._hi.searchsorted(hi)
        # One array at a time, so a merge holds one old array beside its new one, not three.
        self._hi = np.insert(self._hi, at, hi)
        self._lo = np.insert(self._lo, at, lo)
        self._values = np.insert(self._values, at, values)
