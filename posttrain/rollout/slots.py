"""The engine's slots: the KV cache and each slot's decode state (written in place only)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from posttrain.rollout import step


class Slots:
    """``count`` slots of ``length`` cache columns and ``max_new`` outputs each."""

    def __init__(self, count: int, layers: int, kv_heads: int, head_dim: int, length: int, max_new: int,
                 dtype: torch.dtype, device: torch.device, vocab: int | None = None) -> None:
        shape = (count, kv_heads, length, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        long = dict(dtype=torch.long, device=device)
        self.last = torch.zeros(count, **long)  # the token fed to the step
        self.pos = torch.zeros(count, **long)  # its position id
        self.col = torch.zeros(count, **long)  # the cache column it is written to
        self.step = torch.zeros(count, **long)  # index of the token chosen next
        self.seq = torch.zeros(count, **long)  # the sequence's index in its batch
        self.sample_key = torch.zeros(count, **long)  # its batch's sampling key
        self.done = torch.ones(count, dtype=torch.bool, device=device)
        self.key_valid = torch.zeros(count, length, dtype=torch.bool, device=device)  # prompt mask, then ones
        self.out_tokens = torch.zeros(count, max_new, **long)
        self.out_logprobs = torch.zeros(count, max_new, dtype=torch.float32, device=device)
        self.cols = torch.arange(length, device=device)
        # The tokens each slot's sequence holds, for the repetition penalty (``vocab`` given: the penalty is on).
        self.seen = torch.zeros(count, vocab, dtype=torch.bool, device=device) if vocab else None
        self.count, self.length, self.device = count, length, device

    def __len__(self) -> int:
        return self.count

    def sleep(self) -> None:
        """Free the cache's memory; :meth:`wake` allocates it again (the tensors keep their shapes)."""
        release(self.keys + self.values)

    def wake(self) -> None:
        restore(self.keys + self.values)

    @property
    def nbytes(self) -> int:
        """The cache's bytes."""
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    def written_by_step(self) -> list[torch.Tensor]:
        """The tensors a decode step writes (a warm-up or capture restores them after)."""
        seen = [self.seen] if self.seen is not None else []
        return [self.last, self.pos, self.col, self.step, self.done, self.out_tokens, self.out_logprobs, *seen]

    def reset(self) -> None:
        """A new rollout: every slot free."""
        self.done.fill_(True)

    def done_flags(self, rows: int) -> list[bool]:
        return self.done[:rows].tolist()  # one host sync

    def store(self, layer: int, dst: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Prompts' keys and values [k, kv_heads, width, d] of ``layer`` into slots ``dst``."""
        width = keys.shape[2]
        self.keys[layer][:, :, :width].index_copy_(0, dst, keys)
        self.values[layer][:, :, :width].index_copy_(0, dst, values)

    @torch.no_grad()
    def admit(self, slots: torch.Tensor, seq: torch.Tensor, key: torch.Tensor, tokens: torch.Tensor,
              logprobs: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor, col: int, done: torch.Tensor,
              pad: int, seen: torch.Tensor | None = None) -> None:
        """Sequences ``seq`` (sampled with ``key``, one per row) into ``slots`` with their first tokens and state;
        ``seen``: their prompts' tokens (the repetition penalty's), the first tokens are added."""
        k = len(slots)
        out_t = torch.full((k, self.out_tokens.shape[1]), pad, dtype=torch.long, device=self.device)
        out_l = torch.zeros(k, self.out_logprobs.shape[1], dtype=torch.float32, device=self.device)
        out_t[:, 0], out_l[:, 0] = tokens, logprobs
        for buf, value in ((self.out_tokens, out_t), (self.out_logprobs, out_l), (self.key_valid, valid),
                           (self.last, tokens), (self.pos, positions), (self.col, torch.full_like(tokens, col)),
                           (self.step, torch.ones_like(tokens)), (self.seq, seq), (self.sample_key, key),
                           (self.done, done.expand(k).clone())):
            buf.index_copy_(0, slots, value)
        if self.seen is not None:
            self.seen.index_copy_(0, slots, seen.scatter(1, tokens.unsqueeze(1), True))

    @torch.no_grad()
    def move(self, src: list[int], dst: list[int], length: int) -> None:
        """Sequences from slots ``src`` to free slots ``dst``; ``src`` left done."""
        s = torch.tensor(src, dtype=torch.long, device=self.device)
        d = torch.tensor(dst, dtype=torch.long, device=self.device)
        for cache in self.keys + self.values:
            view = cache[:, :, :length]
            view.index_copy_(0, d, view.index_select(0, s))
        seen = [self.seen] if self.seen is not None else []
        for buf in (self.last, self.pos, self.col, self.step, self.seq, self.sample_key, self.done, self.key_valid,
                    self.out_tokens, self.out_logprobs, *seen):
            buf.index_copy_(0, d, buf.index_select(0, s))
        self.done.index_fill_(0, s, True)

    def free(self, slots: list[int]) -> None:
        """Slots whose sequences are dropped unfinished: free for new ones."""
        self.done.index_fill_(0, torch.tensor(slots, dtype=torch.long, device=self.device), True)

    def harvest(self, slots: list[int], seq_ids: list[int], tokens: torch.Tensor, logprobs: torch.Tensor) -> None:
        """Copy finished slots' outputs into a rollout's results at their sequences' rows."""
        s = torch.tensor(slots, dtype=torch.long, device=self.device)
        q = torch.tensor(seq_ids, dtype=torch.long, device=self.device)
        n = tokens.shape[1]
        tokens.index_copy_(0, q, self.out_tokens.index_select(0, s)[:, :n])
        logprobs.index_copy_(0, q, self.out_logprobs.index_select(0, s)[:, :n])

    def record(self, tokens: torch.Tensor, logprobs: torch.Tensor, limit: torch.Tensor, stop_mask: torch.Tensor | None,
               pad: int, epilogue: Callable[..., None] = step.record) -> None:
        """The step's epilogue (``step.record`` or its compiled form) for rows ``:len(tokens)``."""
        epilogue(self.done, self.step, self.last, self.pos, self.col, self.out_tokens, self.out_logprobs, tokens,
                 logprobs, limit, stop_mask, pad, self.seen)


def release(tensors: list[torch.Tensor]) -> None:
    """Free the tensors' storage (their shapes and dtypes stay; reading them before :func:`restore` fails)."""
    for t in tensors:
        t.untyped_storage().resize_(0)


def restore(tensors: list[torch.Tensor]) -> None:
    """Allocate released tensors again, zeroed (masked cache columns are read: they must hold finite numbers)."""
    for t in tensors:
        if t.untyped_storage().nbytes() == 0 and t.numel():
            t.untyped_storage().resize_(t.numel() * t.element_size())
            t.zero_()
