"""Progress of long library calls (planning, `max_seq_len`, captures of large configs) on stderr.

A tqdm bar, shown when stderr is a terminal; TAILORFX_PROGRESS=1 shows it always, =0 never.
"""
from __future__ import annotations

import os
import sys
from typing import Iterable, Optional


def progress(iterable: Optional[Iterable] = None, *, desc: str, total: Optional[int] = None, unit: str = "it"):
    """tqdm over `iterable` (or a manual bar with `total`), labelled `tailorfx: desc`, on stderr."""
    from tqdm.auto import tqdm
    flag = os.environ.get("TAILORFX_PROGRESS")
    disable = None if flag is None else flag == "0"   # None: tqdm shows it only on a terminal
    return tqdm(iterable, total=total, desc=f"tailorfx: {desc}", unit=unit, leave=False, disable=disable,
                file=sys.stderr, dynamic_ncols=True)
