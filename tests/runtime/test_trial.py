"""runtime/trial.py: two ways of a call in alternating turns, a turn's first call untimed."""

from lnn.runtime.trial import AlternatingTrial


def test_the_ways_take_turns_and_a_turns_first_call_is_not_timed():
    trial = AlternatingTrial(("split", "one"), turn=3, turns=2)
    order = []
    for call in range(12):
        assert not trial.done
        way = trial.next_way()
        order.append(way)
        trial.took(way, float(call))
    assert trial.done
    assert order == ["split"] * 3 + ["one"] * 3 + ["split"] * 3 + ["one"] * 3
    assert trial.timed == {"split": [1.0, 2.0, 7.0, 8.0], "one": [4.0, 5.0, 10.0, 11.0]}


def test_calls_that_all_started_on_the_first_way_go_on_until_both_ways_are_timed():
    """Calls of several threads at once each take the way of the count when they start and are counted when they
    end: a whole trial's calls started before the first ended all took the first way. The trial was done then with
    nothing timed for the other (CpuBackend._choose's fastest of it raised ValueError); it goes on, turn by turn,
    until each way has been timed."""
    trial = AlternatingTrial(("split", "one"), turn=3, turns=2)
    ways = [trial.next_way() for _ in range(trial.length)]       # every call started before any ended
    for call, way in enumerate(ways):
        trial.took(way, float(call))
    assert set(ways) == {"split"} and not trial.done
    order = []
    while not trial.done:
        order.append(trial.next_way())
        trial.took(order[-1], 1.0)
    assert order == ["split"] * 3 + ["one"] * 2 and trial.timed["one"] == [1.0]     # the next turns, to a timed call
