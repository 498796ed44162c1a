"""`tailorfx plan` on the paper table's 7-9B configs gives the figures recorded before the sizing
was made faster (issue 67): every plan's predicted peak and added FLOPs, the chosen plan, the
longest sequence and the bound with host offload, to the printed digit. The configs are the
transformers configs benchmarks/paper_table.py builds (tests/goldens/sizing/*.json); the figures
were printed by the code at 57687a5 (tests/goldens/sizing/figures.json; Gemma-2-9B's config is
here, its figures not yet recorded: the old code's run took over 40 minutes). Slow: about 8 minutes
each on 2 cores."""
import json
import os
import re

import pytest

from tailorfx.cli import main

HERE = os.path.join(os.path.dirname(__file__), "goldens", "sizing")
ARGS = ["--budget", "H100-80GB", "--seq", "32768", "--setup", "pure-bf16"]


def figures(out: str) -> dict:
    """The figures of `tailorfx plan`'s output, as text: each plan row, the chosen one, the longest
    sequence and the host-offload bound (before its kind was named, the only bound printed)."""
    rows = [line.rstrip() for line in out.splitlines()
            if re.match(r"^[* ] \S.*\s(yes|no)$", line)]
    longest = re.search(r"longest sequence under .*?: ([\d,]+) tokens", out).group(1)
    bound = re.search(r"(?:the limit|the host-offload limit): no (?:host-offload )?plan of these rewrites fits more "
                      r"than ([\d,]+) tokens", out).group(1)
    floor = re.search(r"tokens no (?:host-offload )?plan peaks below ([\d.]+ \w+)", out.split("host-offload limit")[-1]
                      if "host-offload limit" in out else out).group(1)
    return {"rows": rows, "longest": longest, "bound": bound, "bound_floor": floor}


@pytest.mark.slow
@pytest.mark.parametrize("model", sorted(json.load(open(os.path.join(HERE, "figures.json")))))
def test_plan_figures_are_those_recorded_before(model, capsys):
    expected = json.load(open(os.path.join(HERE, "figures.json")))[model]
    main(["plan", os.path.join(HERE, f"{model}.json"), *ARGS])
    got = figures(capsys.readouterr().out)
    assert got == expected
