"""SIGINT/SIGTERM in a script: one resume line on rank 0, no traceback or checkpoint, exit status 130."""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

# torchrun forwards the terminal's SIGINT too: repeats within this many seconds are the same interrupt.
SAME_INTERRUPT_S = 2.0
EXIT_STATUS = 130

_state: dict[str, Any] = {"signal": None, "at": 0.0, "describe": None, "unraisablehook": sys.unraisablehook}


def install() -> None:
    """First SIGINT/SIGTERM becomes KeyboardInterrupt; a launcher repeat is ignored, a later one kills."""
    _state.update(signal=None, at=0.0, reported=False)
    if not _is_main_thread():
        return
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _on_signal)
    if sys.unraisablehook is not _drop_after_signal:
        _state["unraisablehook"] = sys.unraisablehook
        sys.unraisablehook = _drop_after_signal


def _drop_after_signal(unraisable: Any) -> None:
    destructor = getattr(unraisable.object, "__name__", None) == "__del__"
    if _state["signal"] is None or not destructor:
        _state["unraisablehook"](unraisable)


def track(describe: Callable[[], str] | None) -> None:
    """Where the run stands, for the interrupt line (set by the trainer's run log)."""
    _state["describe"] = describe


def stopped_by(signum: int) -> None:
    """A signal that another handler took (a just-in-time checkpoint's SIGTERM) names the interrupt's line."""
    _state.update(signal=signum, at=time.monotonic())


def _on_signal(signum: int, frame: Any) -> None:
    now = time.monotonic()
    if _state["signal"] is None:
        _state.update(signal=signum, at=now)
        raise KeyboardInterrupt
    if now - _state["at"] > SAME_INTERRUPT_S:  # pressed again: stop waiting for a clean exit
        os._exit(128 + signum)


def exit_status(err: BaseException) -> int | None:
    """After an interrupt: rank-0 line, drop group, return 130 (else None); on KeyboardInterrupt, recall."""
    if not isinstance(err, KeyboardInterrupt) and _state["signal"] is None:
        return None
    _state["at"] = time.monotonic()  # a repeat that arrives while the line is written is the same interrupt
    if _state.get("reported"):
        return EXIT_STATUS
    describe = _state["describe"]
    line = describe() if describe is not None else "interrupted before training started"
    if _state["signal"] == signal.SIGTERM:  # a launcher or scheduler stopped it (torchrun: another rank failed)
        line = line.replace("interrupted", "stopped by SIGTERM", 1)
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"\n[posttrain] {line}", file=sys.stderr, flush=True)
    _state["reported"] = True
    _leave_process_group()
    return EXIT_STATUS


def _leave_process_group() -> None:
    # The ranks are not in step: the Session's barrier at exit could wait forever.
    torch = sys.modules.get("torch")
    if torch is not None and torch.distributed.is_available() and torch.distributed.is_initialized():
        try:
            torch.distributed.destroy_process_group()
        except Exception:  # noqa: BLE001 - a torn-down peer; the process is leaving anyway
            pass


def _is_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()
