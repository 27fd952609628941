from __future__ import annotations

import random

import pytest

from llmserve.router.stop_strings import StopStringMatcher


def run(stops, deltas):
    """(emitted text incl. flush when no match, matched stop) for a delta stream."""
    matcher = StopStringMatcher(stops)
    out = []
    for delta in deltas:
        emit, matched = matcher.feed(delta)
        out.append(emit)
        if matched is not None:
            return "".join(out), matched
    out.append(matcher.flush())
    return "".join(out), None


def reference(stops, text):
    """The stop that ends first in the whole text (ties: the longer one)."""
    best = None
    for stop in stops:
        if stop and (i := text.find(stop)) >= 0:
            key = (i + len(stop), -len(stop))
            if best is None or key < best[0]:
                best = (key, i, stop)
    if best is None:
        return text, None
    return text[: best[1]], best[2]


def test_no_stops_pass_through():
    matcher = StopStringMatcher([])
    assert matcher.feed("Hello") == ("Hello", None)
    assert matcher.feed(" wor") == (" wor", None)
    assert matcher.flush() == ""
    assert StopStringMatcher([""]).feed("abc") == ("abc", None)


def test_single_token_stop():
    matcher = StopStringMatcher(["\n"])
    assert matcher.feed("Hello") == ("Hello", None)
    assert matcher.feed(" world") == (" world", None)
    assert matcher.feed("\n") == ("", "\n")
    # Everything after a match is dropped.
    assert matcher.feed("more") == ("", None)
    assert matcher.flush() == ""
    assert matcher.matched == "\n"


def test_stop_split_across_deltas():
    matcher = StopStringMatcher(["lo w"])
    assert matcher.feed("Hel") == ("He", None)  # "l" could start "lo w".
    assert matcher.held == "l"
    assert matcher.feed("lo wor") == ("l", "lo w")
    assert matcher.feed("ld") == ("", None)
    assert matcher.flush() == ""


def test_stop_split_over_three_deltas_holds_back_prefix():
    matcher = StopStringMatcher(["lo world"])
    assert matcher.feed("Hel") == ("He", None)  # "l" could start the stop.
    assert matcher.held == "l"
    assert matcher.feed("lo wor") == ("l", None)
    assert matcher.held == "lo wor"
    assert matcher.feed("ld!") == ("", "lo world")


def test_text_after_stop_in_same_delta_is_dropped():
    assert run(["STOP"], ["abc STOP def", "ghi"]) == ("abc ", "STOP")


def test_earliest_match_wins():
    assert run(["world", "Hello", "ell"], ["Say Hello world"]) == ("Say H", "ell")
    assert run(["world", "Hello", "ell"], ["Say He", "llo w", "orld"]) == ("Say H", "ell")
    assert run(["world", "Hello"], ["Say Hello world"]) == ("Say ", "Hello")
    # The one that ends first wins, whatever the order of the stops.
    assert run(["bc", "abcd"], ["abcd"]) == ("a", "bc")
    assert run(["abcd", "bc"], ["a", "b", "c", "d"]) == ("a", "bc")
    # Same end: the longer one.
    assert run(["cd", "bcd"], ["abcd"]) == ("a", "bcd")


def test_stop_at_the_very_start():
    matcher = StopStringMatcher(["###"])
    assert matcher.feed("##") == ("", None)
    assert matcher.feed("# tail") == ("", "###")
    assert run(["Hi"], ["Hi there"]) == ("", "Hi")


def test_partial_prefix_at_end_is_not_a_match():
    matcher = StopStringMatcher(["</answer>"])
    assert matcher.feed("42 </ans") == ("42 ", None)
    assert matcher.held == "</ans"
    assert matcher.flush() == "</ans"
    assert matcher.matched is None


def test_false_start_is_released():
    matcher = StopStringMatcher(["abc"])
    assert matcher.feed("xab") == ("x", None)
    assert matcher.feed("d") == ("abd", None)
    assert matcher.feed("aab") == ("a", None)  # "a" cannot start "abc" any more; "ab" can.
    assert matcher.feed("c") == ("", "abc")


def test_hold_back_is_at_most_longest_stop_minus_one():
    matcher = StopStringMatcher(["aaab", "b"])
    emit, matched = matcher.feed("a" * 10)
    assert (emit, matched) == ("a" * 7, None)
    assert matcher.held == "aaa"


def test_multibyte_stop_strings():
    assert run(["。"], ["你好", "。再见"]) == ("你好", "。")
    assert run(["👩‍👩‍👧"], ["family ", "👩‍", "👩‍", "👧 ok"]) == ("family ", "👩‍👩‍👧")
    # A family of two adults only: the held-back prefix comes out at the end.
    assert run(["👩‍👩‍👧"], ["family ", "👩‍", "👩"]) == ("family 👩‍👩", None)
    assert run(["café"], ["un caf", "é noir"]) == ("un ", "café")


@pytest.mark.parametrize("seed", range(5))
def test_independent_of_delta_boundaries(seed):
    rng = random.Random(seed)
    alphabet = "ab c\né你"
    for _ in range(300):
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4)))
                 for _ in range(rng.randint(1, 3))]
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 6))))
        deltas = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        assert run(stops, deltas) == reference(stops, text), (stops, deltas)
        assert run(stops, list(text)) == reference(stops, text), (stops, text)


def test_text_fed_before_min_tokens_ends_no_match():
    # A stop string ending in protected text (can_stop=False) is emitted as text...
    assert StopStringMatcher(["END"]).feed("aEND", can_stop=False) == ("aEND", None)
    # ...one that begins there and ends later stops...
    m = StopStringMatcher(["END"])
    assert (m.feed("xEN", can_stop=False), m.held) == (("x", None), "EN")
    assert m.feed("D tail") == ("", "END")
    # ...and a shorter one wholly inside held protected text never does.
    m = StopStringMatcher(["a", "abc"])
    assert m.feed("xab", can_stop=False) == ("x", None)
    assert m.feed("d") == ("abd", None)
