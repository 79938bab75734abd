"""Prompt lookup (specdec/ngram.py): the longest recent n-gram, and what followed it."""

from specdec.ngram import lookup


def test_the_tokens_after_the_last_ngrams_earlier_occurrence():
    assert lookup([1, 2, 3, 4, 5, 1, 2, 3], 3) == [4, 5, 1]


def test_the_longest_ngram_wins_over_a_more_recent_shorter_one():
    # "2 3" last occurred at 6..7 (followed by 8), but "1 2 3" only at 0..2 (followed by 4)
    assert lookup([1, 2, 3, 4, 9, 2, 3, 8, 1, 2, 3], 2) == [4, 9]


def test_of_equally_long_matches_the_latest_wins():
    assert lookup([5, 6, 7, 5, 6, 9, 5, 6], 1, max_ngram=2) == [9]


def test_no_match_no_guess():
    assert lookup([1, 2, 3, 4], 3) == []
    assert lookup([7, 7], 3) == []  # too short for a 2-gram to occur twice
    assert lookup([1, 2, 3, 1, 2], 0) == []


def test_a_single_repeated_token_is_not_enough():
    assert lookup([1, 5, 9, 2, 5], 3) == []  # only the 1-gram "5" repeats


def test_guesses_stop_at_the_end_of_the_sequence():
    assert lookup([3, 4, 5, 3, 4], 8) == [5, 3, 4]


def test_only_the_window_is_searched():
    tokens = [1, 2, 3] + [9] * 50 + [1, 2]
    assert lookup(tokens, 1) == [3]
    assert lookup(tokens, 1, window=20) == []
