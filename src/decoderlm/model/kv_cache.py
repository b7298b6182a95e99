"""The key-value cache of cached decoding: per-layer buffers, their length, updates and the
attention mask over cached keys."""

from __future__ import annotations

import torch

from ..config import ModelConfig
from ..errors import UserError

__all__ = ["KVCache", "SlotKVCache"]


class KVCache:
    """Keys and values of every layer for decoding.

    k[l], v[l]: [B, n_kv_heads, capacity, head_dim] in `dtype` (grouped-query attention's
    n_kv_heads key/value heads only, never repeated), of which the first `length` positions
    are filled. The default capacity, max_positions + 1, has a spare position that keeps even
    a full cache a strict slice of the buffers, so one compiled step with dynamic shapes
    serves every length (a slice that is the whole buffer would be compiled again).

    Fixed-shape steps (`fix`): from then on a one-token update writes its keys and values at
    the position held in the tensor `slot` and returns the buffers' first `window` positions,
    the filled ones rounded up to a multiple of `WINDOW` (at most `capacity`), and the
    attention mask covers the same positions (those past the new token masked out). The
    window's length is the size of the tensor `keys` (its positions, 0 .. window - 1), never
    a Python number, so a step compiled with dynamic shapes runs at every window unchanged:
    the form of a compiled decoding step (`generation.steps.decode_step`), whose attention
    reads at most WINDOW - 1 more positions than the filled ones. A window as long as the
    buffers gets a graph of its own (the slice is then contiguous, a shorter one is not):
    `generation.steps.fixed_capacity` leaves a spare position so that none is.

    Args:
        config: the model's ModelConfig.
        batch_size: B.
        device, dtype: those of the model's weights.
        capacity: the positions the buffers hold, >= the tokens they will be given; None:
            max_positions + 1.
    """

    WINDOW = 64  # a fixed step's window grows by this many positions (whole vectors)

    @classmethod
    def whole_windows(cls, positions: int) -> int:
        """positions rounded up to a multiple of WINDOW."""
        return -(-positions // cls.WINDOW) * cls.WINDOW

    def __init__(self, config: ModelConfig, batch_size: int, device, dtype, capacity=None):
        capacity = config.max_positions + 1 if capacity is None else capacity
        shape = (batch_size, config.n_kv_heads, capacity, config.head_dim)
        self.k = [torch.empty(shape, device=device, dtype=dtype) for _ in range(config.n_layers)]
        self.v = [torch.empty(shape, device=device, dtype=dtype) for _ in range(config.n_layers)]
        self.length = 0
        self.slot: torch.Tensor | None = None  # [1] int64 once fixed: the next position
        self.keys: torch.Tensor | None = None  # [window] int64 once fixed: 0 .. window - 1
        self._positions: torch.Tensor | None = None  # [capacity] int64 once fixed, keys' base

    @classmethod
    def holding(
        cls, config: ModelConfig, k, v, index: int, n: int, capacity: int, batch_size: int = 1
    ) -> KVCache:
        """A new cache whose batch_size rows each hold positions 0 .. n - 1 of sequence `index`
        of another cache's buffers.

        Args:
            config: the model's ModelConfig.
            k, v: per-layer buffers [B', n_kv_heads, >= n, head_dim] (a `KVCache`'s or a
                `SlotKVCache`'s k and v); the new cache takes their device and dtype.
            index: the sequence (row) of k and v copied.
            n: the positions copied, the new cache's length.
            capacity: the new cache's positions, >= n.
            batch_size: the rows of the new cache, each a copy.
        """
        cache = cls(config, batch_size, k[0].device, k[0].dtype, capacity)
        for mine, theirs in zip(cache.k + cache.v, k + v, strict=True):
            mine[:, :, :n] = theirs[index : index + 1, :, :n]
        cache.length = n
        return cache

    @property
    def capacity(self) -> int:
        """The positions the buffers hold."""
        return self.k[0].size(2)

    def fix(self) -> None:
        """Switch to fixed-shape one-token steps (see the class docstring); idempotent. The
        positions past `length` are zeroed: a masked position gets weight 0 in attention,
        and 0 times an uninitialised NaN would be NaN."""
        if self.slot is not None:
            return
        for buffers in (self.k, self.v):
            for buffer in buffers:
                buffer[:, :, self.length :].zero_()
        device = self.k[0].device
        self.slot = torch.tensor([self.length], device=device)
        self._positions = torch.arange(self.capacity, device=device)
        self.keys = self._positions[: self.window]

    @property
    def window(self) -> int:
        """The positions a fixed one-token step attends over: length + 1 (the cached tokens
        and the new one) rounded up to a multiple of WINDOW, at most capacity."""
        return min(self.capacity, self.whole_windows(self.length + 1))

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new keys and values k, v [B, n_kv_heads, T, head_dim] of `layer` at positions
        length..length + T - 1 and return all of them, [B, n_kv_heads, length + T, head_dim]
        each. `length` itself moves on in `advance`, once every layer has been updated.
        After `fix`, one new token (T = 1) is written at `slot` and the window's positions,
        [B, n_kv_heads, window, head_dim], are returned."""
        if self.slot is not None and k.size(-2) == 1:  # fixed shapes: the window
            self.k[layer].index_copy_(2, self.slot, k)
            self.v[layer].index_copy_(2, self.slot, v)
            window = self.keys.size(0)
            return self.k[layer][:, :, :window], self.v[layer][:, :, :window]
        start, T = self.length, k.size(-2)
        self.k[layer][:, :, start : start + T] = k
        self.v[layer][:, :, start : start + T] = v
        return self.k[layer][:, :, : start + T], self.v[layer][:, :, : start + T]

    def advance(self, T: int) -> None:
        """Count T more filled positions (after a forward pass over T new tokens)."""
        self.length += T
        if self.slot is not None:
            self.slot.fill_(self.length)
            if self.keys.size(0) != self.window:
                self.keys = self._positions[: self.window]

    def attention_mask(self, T: int, key_mask: torch.Tensor | None) -> torch.Tensor | None:
        """The mask of T new queries over the length + T keys, bool [B, 1, T, length + T],
        True where a query may attend: causal, and never to padding.

        Args:
            T: the number of new tokens.
            key_mask: [B, length + T] bool, False for padding; None means no padding.

        Returns:
            None when no mask is needed (no padding, and one new token or an empty cache, so
            the plain causal rule of scaled_dot_product_attention applies). After `fix`, for
            one new token: bool [B or 1, 1, 1, window], True at positions 0 .. slot
            (key_mask, if given, [B, window] and False past the new token, anded in).
        """
        if self.slot is not None and T == 1:
            seen = (self.keys <= self.slot)[None]
            return (seen if key_mask is None else seen & key_mask)[:, None, None]
        start = self.length
        if key_mask is None and (T == 1 or start == 0):
            return None
        S, device = start + T, self.k[0].device
        if key_mask is None:
            key_mask = torch.ones(self.k[0].size(0), S, dtype=torch.bool, device=device)
        causal = torch.ones(T, S, dtype=torch.bool, device=device).tril(start)
        # a padding query may see no key at all; letting every query see itself keeps every
        # softmax row finite (no NaN); the outputs at padding are never used
        itself = torch.arange(S, device=device) == (torch.arange(T, device=device) + start)[:, None]
        return ((causal[None] & key_mask[:, None, :]) | itself[None])[:, None]


class SlotKVCache:
    """Keys and values of a changing batch of sequences, each at its own length (continuous
    batching): row i of the buffers holds the i-th active sequence, `lengths[i]` positions of
    it filled; sequences join (`put`) and leave (`remove`) between forward passes.

    k[l], v[l]: [capacity, n_kv_heads, P, head_dim] in `dtype`, P = max_positions rounded up
    to a multiple of `KVCache.WINDOW`, plus 1; capacity starts at `rows` rows (at most
    max_rows) and grows (doubling, up to max_rows) as sequences join. A forward pass over one new
    token of each of the B = `rows` active sequences (DecoderLM.forward_cached with this
    cache) writes row i's keys and values at position lengths[i] and attends over positions
    0 .. lengths[i] of that row only (the others are masked out).

    The step has fixed shapes, as a fixed `KVCache`'s: every row attends over a window of the
    buffers, max(lengths) + 1 rounded up to a multiple of `KVCache.WINDOW` (always less than
    P: a window as long as the buffers would get a graph of its own), whose length is the
    size of the tensor `keys` (its positions, 0 .. window - 1), never a Python number read
    inside the step. A step compiled with dynamic shapes (`generation.steps.decode_step`) so
    runs unchanged as rows join and leave and as they grow, with a new window once every
    WINDOW positions.

    Args:
        config: the model's ModelConfig.
        max_rows: the most sequences at once.
        device, dtype: those of the model's weights.
        rows: the rows the buffers hold at first. A compiled step wants 2: torch traces a
            dimension of size 1 as the number 1, and would compile again once the buffers
            grow to a second row.
    """

    def __init__(self, config: ModelConfig, max_rows: int, device, dtype, rows: int = 1):
        self.config, self.max_rows, self.device, self.dtype = config, max_rows, device, dtype
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.lengths = torch.zeros(0, dtype=torch.long, device=device)
        # max_positions rounded up to whole windows, and a spare position that keeps every
        # window a strict slice of the buffers (as `generation.steps.fixed_capacity`'s)
        windows = KVCache.whole_windows(config.max_positions)
        self._positions = torch.arange(windows + 1, device=device)
        self.keys = self._positions[:0]  # [window] int64: 0 .. window - 1 (`_refresh`)
        self._grow(min(rows, max_rows))

    @property
    def rows(self) -> int:
        """The number of active sequences, B."""
        return len(self.lengths)

    def _grow(self, capacity: int) -> None:
        c = self.config
        shape = (capacity, c.n_kv_heads, self._positions.size(0), c.head_dim)
        for buffers in (self.k, self.v):
            for layer in range(c.n_layers):
                # zeros, not empty: a masked position gets weight 0, and 0 * NaN is NaN
                new = torch.zeros(shape, device=self.device, dtype=self.dtype)
                if len(buffers) > layer:
                    new[: self.rows] = buffers[layer][: self.rows]
                    buffers[layer] = new
                else:
                    buffers.append(new)

    def put(self, cache: KVCache, index: int = 0) -> int:
        """Add sequence `index` of `cache` (a KVCache) as the last row; returns its row.

        Raises:
            UserError: max_rows sequences are active already.
        """
        row = self.rows
        if row >= self.max_rows:
            raise UserError(f"the batch is full ({self.max_rows} sequences)")
        if row >= self.k[0].size(0):
            self._grow(min(self.max_rows, 2 * self.k[0].size(0)))
        self.replace(row, cache, index)
        return row

    def replace(self, row: int, cache: KVCache, index: int = 0) -> None:
        """Row `row` (an active row, or the next free one) takes the keys and values of
        sequence `index` of `cache` (a KVCache)."""
        n = cache.length
        for layer in range(self.config.n_layers):
            self.k[layer][row, :, :n] = cache.k[layer][index, :, :n]
            self.v[layer][row, :, :n] = cache.v[layer][index, :, :n]
        if row == self.rows:
            self.lengths = torch.cat([self.lengths, self.lengths.new_tensor([n])])
        else:
            self.lengths[row] = n
        self._refresh()

    def row(self, row: int) -> KVCache:
        """A copy of row `row`'s filled positions: a KVCache of one sequence, its length and
        capacity lengths[row]."""
        n = int(self.lengths[row])
        return KVCache.holding(self.config, self.k, self.v, row, n, n)

    def remove(self, row: int) -> None:
        """Drop row `row`; the last row moves into its place (the rows after it keep theirs
        unless it is the last)."""
        last = self.rows - 1
        if row != last:
            n = int(self.lengths[last])
            for layer in range(self.config.n_layers):
                self.k[layer][row, :, :n] = self.k[layer][last, :, :n]
                self.v[layer][row, :, :n] = self.v[layer][last, :, :n]
            self.lengths[row] = self.lengths[last]
        self.lengths = self.lengths[:last].clone()
        self._refresh()

    def _refresh(self) -> None:
        """`keys` for the current lengths: max(lengths) + 1 rounded up to a multiple of
        KVCache.WINDOW (the one place a step's window is read)."""
        filled = int(self.lengths.max()) + 1 if self.rows else 0
        window = KVCache.whole_windows(filled)
        if self.keys.size(0) != window:
            self.keys = self._positions[:window]

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new keys and values k, v [B, n_kv_heads, 1, head_dim] of `layer` at each
        row's length and return the rows' windows, [B, n_kv_heads, window, head_dim] each
        (positions past a row's own length are masked out: `attention_mask`)."""
        B, window = self.lengths.size(0), self.keys.size(0)
        rows = torch.arange(B, device=self.device)
        self.k[layer][rows, :, self.lengths] = k[:, :, 0]
        self.v[layer][rows, :, self.lengths] = v[:, :, 0]
        return self.k[layer][:B, :, :window], self.v[layer][:B, :, :window]

    def advance(self, T: int) -> None:
        """Count T more filled positions in every row (after a forward pass)."""
        self.lengths = self.lengths + T
        self._refresh()

    def attention_mask(self, T: int, key_mask: torch.Tensor | None) -> torch.Tensor:
        """bool [B, 1, 1, window]: row i's new token may attend to positions 0 .. lengths[i].

        Raises:
            UserError: T is not 1 or key_mask is given (a slot cache takes one new token per
                sequence, and has no padding).
        """
        if T != 1 or key_mask is not None:
            raise UserError("a SlotKVCache takes one new token per row and no key_mask")
        return (self.keys <= self.lengths[:, None])[:, None, None]
