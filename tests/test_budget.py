import pytest

from tailorfx import Budget
from tailorfx.budget import PRESETS, format_bytes


@pytest.mark.parametrize("text,nbytes", [
    ("24GB", 24 * 10**9), ("512MiB", 512 * 2**20), ("123456B", 123456), ("1.5GiB", 3 * 2**29),
    ("2 gb", 2 * 10**9), (4096, 4096),
])
def test_parse(text, nbytes):
    assert Budget.parse(text).bytes == nbytes


def test_presets_are_below_marketed_size():
    b = Budget.parse("A100-80GB")
    assert b.bytes == PRESETS["A100-80GB"] and 75 * 2**30 < b.bytes < 80 * 2**30
    assert Budget.parse("h100-80gb").bytes == PRESETS["H100-80GB"]


@pytest.mark.parametrize("bad", ["24 parsecs", "GB", "-5GB", 0, "lots"])
def test_bad_budget_names_the_fix(bad):
    with pytest.raises(ValueError, match="budget"):
        Budget.parse(bad)


def test_format_bytes():
    assert format_bytes(3 * 2**29) == "1.50 GiB"
    assert format_bytes(512) == "512 B"
