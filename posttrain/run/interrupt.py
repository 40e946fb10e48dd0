"""Ctrl-C (SIGINT) and SIGTERM during a script: one line on rank 0 saying where the run stopped
and how to resume it, no traceback, exit status 130 (the shell's 128 + SIGINT).

No checkpoint is saved at the interrupt. The signal lands on each rank at a different point of
its step: one may be inside a collective (an all-reduce, a ZeRO gather, an optimizer step that
updates partitions and then all-gathers them) while another is in its forward, so a save started
from there would pair mismatched collectives (a hang, or state from two different steps) or write
a half-updated model. Deferring the interrupt to a step boundary would make the save consistent,
but then Ctrl-C does not stop a long step, torchrun SIGKILLs its workers 30 s after forwarding
the signal (often mid-save), and GRPO/RLOO can only resume on generation boundaries. So the line
names the newest complete checkpoint (``save_steps`` writes them) instead.

The KeyboardInterrupt can also cut an object's ``__init__`` short, and that object's ``__del__``
then fails when it is collected (tqdm's bar has no ``pos`` yet), which Python prints as "Exception
ignored in ... Traceback". After the signal such destructor errors are the interrupt's own
debris, so they are dropped; before it, and any other unraisable error, reach the usual hook.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

# A launcher re-sends the user's Ctrl-C: torchrun's agent gets the terminal's SIGINT too and
# forwards it to every worker at once. Repeats within this many seconds are that same interrupt.
SAME_INTERRUPT_S = 2.0
EXIT_STATUS = 130

_state: dict[str, Any] = {"signal": None, "at": 0.0, "describe": None, "unraisablehook": sys.unraisablehook}


def install() -> None:
    """Turn the first SIGINT/SIGTERM into KeyboardInterrupt (once); a repeat from the launcher is
    ignored, one the user sends later ends the process at once."""
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


def _on_signal(signum: int, frame: Any) -> None:
    now = time.monotonic()
    if _state["signal"] is None:
        _state.update(signal=signum, at=now)
        raise KeyboardInterrupt
    if now - _state["at"] > SAME_INTERRUPT_S:  # pressed again: stop waiting for a clean exit
        os._exit(128 + signum)


def exit_status(err: BaseException) -> int | None:
    """After an interrupt (``err`` is it, or a failure it caused, such as a collective whose peer
    left): print the line on rank 0 (once), drop the process group without waiting for the other
    ranks, and return 130. None for any other error. A rank blocked in a collective when the
    signal came runs its handler only when Python next runs, which can be this call: the caller
    catches that KeyboardInterrupt and calls again."""
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
    # The ranks are not in step: a barrier at exit (Session's atexit) would wait for ranks that
    # left or are stuck in another collective.
    torch = sys.modules.get("torch")
    if torch is not None and torch.distributed.is_available() and torch.distributed.is_initialized():
        try:
            torch.distributed.destroy_process_group()
        except Exception:  # noqa: BLE001 - a torn-down peer; the process is leaving anyway
            pass


def _is_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()
