"""Scorers pinned against hand-computed values (rouge-score ROUGE-1, InfiniteBench first_int_match, OmniKV match)."""

from __future__ import annotations

import pytest

from kvbench.metrics import METRICS, first_int, first_int_match, rouge1_f_x10, substring_any

NEEDLE = "The best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day."  # 21 tokens


class TestRouge1FX10:
    def test_identical_is_ten(self):
        assert rouge1_f_x10(NEEDLE, NEEDLE) == pytest.approx(10.0)

    def test_surrounding_newlines_and_case_do_not_matter(self):
        # rouge-score lowercases and tokenizes on non-alphanumerics; the official needle has "\n" on both sides.
        assert rouge1_f_x10("\n" + NEEDLE + "\n", NEEDLE.upper()) == pytest.approx(10.0)

    def test_partial_overlap(self):
        # 3 predicted tokens, all in the 21-token reference: P = 1, R = 3/21, F = 2PR/(P+R) = 0.25.
        assert rouge1_f_x10(NEEDLE, "eat a sandwich") == pytest.approx(2.5)

    def test_extra_token(self):
        # "... is to eat ...": 22 tokens, 21 overlap (one "to" in the reference): F = 42/43.
        prediction = NEEDLE.replace(" is eat ", " is to eat ")
        assert rouge1_f_x10(NEEDLE, prediction) == pytest.approx(420 / 43)

    def test_stemmer_is_on(self):
        # "sitting" stems to "sit": 4/4 tokens match, R = 4/21, F = 0.32 (without stemming it would be 0.24).
        assert rouge1_f_x10(NEEDLE, "Sitting in the park") == pytest.approx(3.2)
        # "sandwiches" -> "sandwich": P = 1, R = 1/21, F = 1/11.
        assert rouge1_f_x10(NEEDLE, "sandwiches") == pytest.approx(10 / 11)

    def test_empty_and_disjoint(self):
        assert rouge1_f_x10(NEEDLE, "") == 0.0
        assert rouge1_f_x10(NEEDLE, "   ") == 0.0
        assert rouge1_f_x10(NEEDLE, "xyzzy plugh") == 0.0


class TestFirstIntMatch:
    @pytest.mark.parametrize(
        ("prediction", "expected"),
        [
            ("The pass key is 71432.", "71432"),
            (" 71432", "71432"),
            ("71432. Remember it. 71432 is the pass key.", "71432"),
            ("-71432", "71432"),  # the sign is not a digit
            ("3.14", "3"),  # a decimal stops at the point
            ("1,234", "1"),  # a thousands separator splits
            ("key: 12 then 71432", "12"),  # the first run wins
            ("71432abc99", "71432"),
            ("no digits here", ""),
            ("", ""),
            ("٣٤٥", ""),  # only ASCII digits count ([^0-9])
        ],
    )
    def test_first_int(self, prediction, expected):
        assert first_int(prediction) == expected

    def test_match(self):
        assert first_int_match("The pass key is 71432.", "71432") == 1.0
        assert first_int_match(" 71432", "71432") == 1.0
        assert first_int_match("The pass key is 7143", "71432") == 0.0
        assert first_int_match("The pass key is 714321", "71432") == 0.0
        assert first_int_match("The pass key is the pass key.", "71432") == 0.0

    def test_string_comparison_edge_cases(self):
        # InfiniteBench compares strings: leading zeros count, and an int label never matches.
        assert first_int_match("The pass key is 01234.", "01234") == 1.0
        assert first_int_match("The pass key is 1234.", "01234") == 0.0
        assert first_int_match("The pass key is 71432.", 71432) == 0.0  # type: ignore[arg-type]

    def test_returns_float(self):
        assert isinstance(first_int_match("1", "1"), float)


class TestSubstringAny:
    def test_case_insensitive(self):
        assert substring_any("The corresponding color is Magenta.", ["magenta"]) == 1.0
        assert substring_any("so the answer is RED", ["red"]) == 1.0

    def test_any_of_several_answers(self):
        assert substring_any("blue", ["red", "blue"]) == 1.0
        assert substring_any("green", ["red", "blue"]) == 0.0

    def test_substring_quirks(self):
        # OmniKV's rule is a plain substring: a listing of colors scores, and "red" is inside "hundred".
        assert substring_any("red, green or blue", ["blue"]) == 1.0
        assert substring_any("one hundred", ["red"]) == 1.0
        assert substring_any("", ["red"]) == 0.0


def test_metric_registry_names():
    assert METRICS == {
        "rouge1_f_x10": rouge1_f_x10,
        "first_int_match": first_int_match,
        "substring_any": substring_any,
    }
