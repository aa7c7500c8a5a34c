"""Two ways of making the same call, timed against each other as the calls go on.

Used by the CPU backend (a one-image call's layers split over the cores, or on one thread: CpuBackend._choose) and
by lnn-serve (a lone photo while others wait, as the session chose or on one thread: serve_app.LoneCalls). The two
ways take turns of `turn` calls in a row, `turns` turns each, the first way first. A turn's first call is not timed:
it finds the caches holding the other way's buffers and, after one thread, the crew's helpers asleep, as calls of
one way back to back do not. Once every turn has run and each way has a timed call (`done`), `timed` holds each way's
timed seconds and the caller judges them by its own statistic (the backend the fastest call, the server the median
under its load).

Calls of several threads at once (a Session shared by threads) each take the way of the count when they start and are
counted when they end, so a turn may get more calls than `turn` and the other way none: a fresh Session hit by
TRIAL_LENGTH threads at once ran every call the first way, and the backend's choice, taking the fastest of an empty
list, raised ValueError on every later call of that batch size. The trial then goes on, turn by turn, until each
way has been timed."""

from __future__ import annotations


def trial_length(turn: int, turns: int) -> int:
    """Calls before a trial of two ways, `turns` turns of `turn` calls each, is done."""
    return 2 * turn * turns


class AlternatingTrial:
    def __init__(self, ways: tuple, turn: int, turns: int):
        self.ways = ways                             # (the first way, the second), each a value the caller runs by
        self.turn = turn
        self.length = trial_length(turn, turns)
        self.calls = 0
        self.timed = {way: [] for way in ways}       # way -> seconds of its timed calls

    @property
    def done(self) -> bool:
        return self.calls >= self.length and all(self.timed.values())

    def next_way(self):
        """The way the trial's next call takes."""
        return self.ways[self.calls // self.turn % 2]

    def took(self, way, seconds: float) -> None:
        """The trial's next call, made `way`, took `seconds` (timed unless it began a turn)."""
        if self.calls % self.turn:
            self.timed[way].append(seconds)
        self.calls += 1
