"""Specification of zero_core.units: the paper's decimal units in, readable units out."""

import pytest

from zero_core.units import (
    format_bytes,
    format_count,
    format_seconds,
    parse_bandwidth,
    parse_bytes,
    parse_count,
)


@pytest.mark.parametrize(
    ("text", "count"),
    [
        ("7.5B", 7_500_000_000),
        ("128B", 128_000_000_000),
        ("1T", 10**12),
        ("1.5e9", 1_500_000_000),
        ("340M", 340_000_000),
        ("12K", 12_000),
        ("1300", 1300),
        (" 7.5b ", 7_500_000_000),
        (1300, 1300),
    ],
)
def test_parse_count_reads_suffixes_scientific_notation_and_plain_integers(text, count):
    assert parse_count(text) == count


def test_parse_count_names_the_bad_text_and_shows_a_good_one():
    with pytest.raises(ValueError) as error:
        parse_count("7.5Q")
    assert str(error.value) == "could not read '7.5Q' as a parameter count; write it like 7.5B or 1.3e9"


@pytest.mark.parametrize("text", ["-3B", "0", "0B", "1.5", "abc", "", "7.5 B params"])
def test_parse_count_refuses_negative_zero_fractional_and_malformed_counts(text):
    with pytest.raises(ValueError, match="7.5B"):
        parse_count(text)


@pytest.mark.parametrize(
    ("text", "n_bytes"),
    [
        ("32GB", 32 * 10**9),
        ("32 GB", 32 * 10**9),
        ("1.5KB", 1500),
        ("2TB", 2 * 10**12),
        ("16GiB", 16 * 2**30),
        ("1.5KiB", 1536),
        ("80MiB", 80 * 2**20),
        ("512B", 512),
        ("0", 0),
    ],
)
def test_parse_bytes_reads_decimal_units_like_the_paper_and_binary_units_by_name(text, n_bytes):
    assert parse_bytes(text) == n_bytes


@pytest.mark.parametrize("text", ["32XB", "-1GB", "0.5B", "32Gb", "GB"])
def test_parse_bytes_refuses_unknown_units_negative_sizes_fractions_of_a_byte_and_bits(text):
    with pytest.raises(ValueError, match=f"{text!r}.*32GB"):
        parse_bytes(text)


@pytest.mark.parametrize("text", ["40", "512", "1e9", " 80 "])
def test_a_memory_size_or_bandwidth_without_a_unit_is_refused_not_read_as_bytes(text):
    with pytest.raises(ValueError, match="no unit.*32GB or 16GiB"):
        parse_bytes(text)
    with pytest.raises(ValueError, match="no unit.*50GB/s"):
        parse_bandwidth(text)


def test_a_python_int_is_bytes_and_must_be_whole_and_not_negative():
    assert parse_bytes(512) == 512
    with pytest.raises(ValueError, match="negative"):
        parse_bytes(-1)


@pytest.mark.parametrize(
    ("text", "bytes_per_s"),
    [
        ("50GB/s", 50e9),
        ("50 GB/s", 50e9),
        ("900GiB/s", 900 * 2**30),
        ("100Gbit/s", 1.25e10),
        ("100Gb/s", 1.25e10),
        ("1Gbit/s", 1.25e8),
        ("400Mbit/s", 5e7),
    ],
)
def test_parse_bandwidth_returns_bytes_per_second_telling_bits_from_bytes(text, bytes_per_s):
    assert parse_bandwidth(text) == pytest.approx(bytes_per_s)


@pytest.mark.parametrize("text", ["50GB", "0GB/s", "-5GB/s", "50XB/s", "fast"])
def test_parse_bandwidth_refuses_missing_per_second_zero_negative_and_unknown_units(text):
    with pytest.raises(ValueError, match="50GB/s"):
        parse_bandwidth(text)


def test_format_bytes_uses_decimal_gigabytes_by_default():
    assert format_bytes(120e9) == "120.00 GB"
    assert format_bytes(1.875e9) == "1.88 GB"


def test_format_bytes_labels_binary_units_as_such():
    assert format_bytes(2**30, "GiB") == "1.00 GiB"
    assert format_bytes(120e9, "GiB") == "111.76 GiB"
    assert format_bytes(1536, "KiB", digits=1) == "1.5 KiB"


def test_format_bytes_refuses_an_unknown_unit():
    with pytest.raises(ValueError, match="unknown byte unit 'GBs'"):
        format_bytes(1, "GBs")


@pytest.mark.parametrize(
    ("count", "text"),
    [(7.5e9, "7.5B"), (128e9, "128B"), (1e12, "1T"), (1_558_000_000, "1.558B"), (340e6, "340M"), (999, "999")],
)
def test_format_count_names_models_the_way_the_paper_does(count, text):
    assert format_count(count) == text


def test_format_count_and_parse_count_round_trip():
    assert parse_count(format_count(7_500_000_000)) == 7_500_000_000


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0.6, "600.0 ms"), (2.5, "2.50 s"), (2.5e-5, "25.0 µs"), (3e-8, "30.0 ns"), (90, "1.50 min"), (0, "0 s")],
)
def test_format_seconds_picks_the_largest_unit_that_keeps_a_leading_digit(seconds, text):
    assert format_seconds(seconds) == text


def test_format_seconds_refuses_negative_durations():
    with pytest.raises(ValueError, match="negative"):
        format_seconds(-1.0)
