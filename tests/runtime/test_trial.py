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
