"""One sender of a load run (``lab_utils.serving.load``): its share of the clients or of the schedule, sent from a
thread or a spawned client process, each finished window's requests handed to the run as rows.

Internal to the load engine; the rows are ``(due, sent, end, ok, message)``, times in s from the run's start.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from lab_utils.procs import die_with_parent

ERROR_BACKOFF_S = 0.01  # a closed-loop client pauses this long after a failure: a dead server is not spun against
_UP_S = 120.0  # s for the senders to start (a spawned process imports the clients anew)

Row = tuple  # (due, sent, end, ok, message): one request


def short_error(msg: str) -> str:
    """An error message on one line, at most 300 characters (a window's messages are counted by it)."""
    return " ".join(str(msg).split())[:300]


@dataclass
class Plan:
    """What one sender does: ``concurrency`` clients (closed loop) or the intended send times ``dues`` (open)."""

    mode: str
    warmup_s: float
    window_s: float
    n_windows: int
    timeout_s: float
    concurrency: int = 0
    dues: Any = None
    cap: int = 10_000  # requests in flight at most (open loop)
    first: int = 0  # the payload this sender starts at
    index: int = 0  # which sender of the run


class Sender:
    """Sends its share of a run and hands each finished window's rows to the parent through ``out``:
    ``("ready", i)`` once the target is open, then ``("rows", i, w, rows)`` for w = -1 .. n_windows - 1 in order,
    then ``("done", i, max_in_flight)`` or ``("crash", i, message)``; ``i``: the sender's index."""

    def __init__(self, target: Any, plan: Plan, out: Any, stop: Any, start: Any, t0: Any):
        self.target, self.plan, self.out, self.stop, self.start, self.t0_box = target, plan, out, stop, start, t0
        self.rows: dict[int, list[Row]] = {}
        self.pending: Counter[int] = Counter()
        self.in_flight = self.max_in_flight = 0
        self.horizon = -math.inf  # no request is begun with an intended send time before this (s from t0)
        self.next_w = -1
        self.t0 = 0.0

    def window_of(self, due: float) -> int:
        """The window of a request sent (intended) at ``due`` s: -1 in the warm-up, at most the last window."""
        return max(-1, min(math.floor((due - self.plan.warmup_s) / self.plan.window_s), self.plan.n_windows - 1))

    def now(self) -> float:
        return time.monotonic() - self.t0

    def _begin(self, due: float) -> int:
        """Count a request as pending in its window from the moment it is scheduled: a window is handed over only
        when nothing of it is pending, and an open loop's task may start after the ticker's next flush."""
        w = self.window_of(due)
        self.pending[w] += 1
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        return w

    async def _one(self, due: float, w: int | None = None) -> bool:
        w = self._begin(due) if w is None else w
        sent, ok, msg = self.now(), False, ""
        try:
            await asyncio.wait_for(self.target.send(), self.plan.timeout_s)
            ok = True
        except asyncio.TimeoutError:  # (TimeoutError itself from Python 3.11)
            msg = f"TimeoutError: no answer within {self.plan.timeout_s:g} s"
        except Exception as err:  # counted, never raised: the load goes on (a failure drill needs it)
            msg = short_error(f"{type(err).__name__}: {err}")
        self.rows.setdefault(w, []).append((due, sent, self.now(), ok, msg))
        self.pending[w] -= 1
        self.in_flight -= 1
        return ok

    async def _closed(self) -> None:
        end_s = self.plan.warmup_s + self.plan.n_windows * self.plan.window_s

        async def client() -> None:
            await asyncio.sleep(max(0.0, -self.now()))
            while not self.stop.is_set() and (due := self.now()) < end_s:
                if not await self._one(due):
                    await asyncio.sleep(ERROR_BACKOFF_S)

        self.horizon = math.inf  # a closed loop's request is due when it is sent: never in a past window
        await asyncio.gather(*(client() for _ in range(self.plan.concurrency)))

    async def _open(self) -> None:
        tasks = set()
        for due in self.plan.dues:
            due = float(due)
            self.horizon = due
            if self.stop.is_set():
                break
            delay = due - self.now()
            if delay > 0:
                await asyncio.sleep(delay)
            if self.in_flight >= self.plan.cap:
                now = self.now()
                self.rows.setdefault(self.window_of(due), []).append(
                    (due, now, now, False, f"client limit: {self.plan.cap} requests in flight (raise max_in_flight)"))
                continue
            task = asyncio.ensure_future(self._one(due, self._begin(due)))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        self.horizon = math.inf
        if tasks:
            await asyncio.gather(*tasks)

    def _flush(self, final: bool = False) -> None:
        while self.next_w < self.plan.n_windows:
            w = self.next_w
            end_w = self.plan.warmup_s + (w + 1) * self.plan.window_s
            if not final and (min(self.now(), self.horizon) < end_w or self.pending[w] > 0):
                return
            self.out.put(("rows", self.plan.index, w, self.rows.pop(w, [])))
            self.next_w += 1

    async def _ticker(self) -> None:
        while True:
            self._flush()
            await asyncio.sleep(min(0.05, self.plan.window_s / 5))

    async def _main(self) -> None:
        await self.target.open()  # imports and connections before the clock starts
        try:
            if hasattr(self.target, "start_at"):
                self.target.start_at(self.plan.first)
            probe = None
            if self.plan.mode == "closed":  # a slow first request (a new connection) must not fall in a window
                try:
                    await asyncio.wait_for(self.target.send(), self.plan.timeout_s)
                except Exception as err:  # counted in errors_total, not measured
                    probe = short_error(f"{type(err).__name__}: {err}".split("\n")[0])
            self.out.put(("ready", self.plan.index))
            if not self.start.wait(timeout=_UP_S) or self.stop.is_set():
                return
            self.t0 = self.t0_box.value
            if probe is not None:
                self.rows.setdefault(-1, []).append((-1.0, -1.0, -1.0, False, probe))
            ticker = asyncio.ensure_future(self._ticker())
            try:
                await (self._closed() if self.plan.mode == "closed" else self._open())
            finally:
                ticker.cancel()
            self._flush(final=True)
        finally:
            await self.target.close()

    def run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as err:  # handed to the parent, which raises it in the caller's thread
            self.out.put(("crash", self.plan.index, f"{type(err).__name__}: {err}"))
        else:
            self.out.put(("done", self.plan.index, self.max_in_flight))


def process_main(*args: Any) -> None:
    die_with_parent()
    Sender(*args).run()
