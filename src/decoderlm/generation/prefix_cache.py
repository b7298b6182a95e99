"""Prefix caching: the keys and values of recently finished sequences, kept so that a new
prompt starting with the same tokens (a chat's template and system message, the earlier turns
of a conversation, a few-shot preamble) is prefilled from where they end.

The server's `Scheduler` keeps each sequence that leaves its batch holding the keys and
values of its own tokens (not one that slid past the context) and looks up each joining
prompt; `decoderlm chat` (`generate.stream_generate`'s prefixes) keeps its last prompt and
reply. The tokens after the longest common prefix are then the only ones prefilled, as with
vLLM's automatic prefix caching and llama.cpp's server, which reuse the longest prefix of
their cache's tokens the same way. The keys and values of the shared prefix are those
computed when it was first seen (a reply's one token at a time), so a greedy answer equals
the one of a prefill from scratch up to float rounding.
"""

from __future__ import annotations

from ..model.kv_cache import KVCache

__all__ = ["PrefixCache"]


def _common(a: list[int], b: tuple[int, ...]) -> int:
    """The number of leading ids a and b share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class PrefixCache:
    """The keys and values of up to max_entries sequences, the least recently kept or used
    dropped first.

    Memory: each entry holds its own tokens' keys and values, n_layers x 2 x n_kv_heads x
    head_dim values a token (bytes: times the cache dtype's size), at most max_positions
    tokens an entry.

    Args:
        max_entries: the most sequences kept (0: none).
    """

    def __init__(self, max_entries: int):
        self.max_entries = max_entries
        self._entries: list[tuple[tuple[int, ...], KVCache]] = []  # least recent first

    def __len__(self) -> int:
        return len(self._entries)

    def keep(self, ids: list[int], cache: KVCache) -> None:
        """Keep cache (one sequence, holding exactly `ids`: cache.length == len(ids)).
        Entries whose ids are a prefix of ids (the same conversation, earlier) are dropped."""
        if self.max_entries == 0 or not ids:
            return
        ids = tuple(ids)
        self._entries = [(e, c) for e, c in self._entries if ids[: len(e)] != e]
        self._entries.append((ids, cache))
        del self._entries[: -self.max_entries]

    def longest(self, ids: list[int]) -> tuple[KVCache | None, int]:
        """The entry sharing the longest prefix with ids, and that prefix's length p, at most
        len(ids) - 1 (the last id is always computed, for its logits); (None, 0) when no
        entry shares a first id. The entry becomes the most recently used."""
        best, p = None, 0
        for i, (entry, _) in enumerate(self._entries):
            n = min(_common(ids, entry), len(ids) - 1)
            if n > p:
                best, p = i, n
        if best is None:
            return None, 0
        self._entries.append(self._entries.pop(best))
        return self._entries[-1][1], p
