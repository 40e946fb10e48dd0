"""TRL's ``enable_jit_checkpoint`` (transformers' just-in-time checkpoint for preemptible jobs): a SIGTERM during
training asks for a checkpoint where the next optimizer step ends; every rank takes it at the same step, and the
run then stops as an interrupted one does, its line naming the checkpoint to resume from."""

from __future__ import annotations

import signal
import threading
from typing import TYPE_CHECKING, Any

import torch

from posttrain.placement.ranks import sum_over_ranks

if TYPE_CHECKING:
    from posttrain.placement.session import Session


class JitCheckpoint:
    """While entered (in the main thread), SIGTERM only marks this process; :meth:`requested` asks every rank."""

    def __init__(self) -> None:
        self.signalled = False
        self._previous: Any = None

    def __enter__(self) -> JitCheckpoint:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        self.signalled = True  # a launcher's repeat changes nothing; its SIGKILL comes after the grace period

    def requested(self, session: Session) -> bool:
        """Whether any training rank got SIGTERM. Collective (one all-reduce of a flag), so every rank decides
        alike even where the signal reached only some."""
        flag = torch.tensor([1.0 if self.signalled else 0.0], device=session.device)
        return bool(sum_over_ranks(session, flag).item() > 0)
