"""Progress of long library calls (planning, `max_seq_len`, captures of large configs) on stderr.

A tqdm bar, shown when stderr is a terminal; TAILORFX_PROGRESS=1 shows it always, =0 never.
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
from typing import Iterable, Iterator, Optional


def progress(iterable: Optional[Iterable] = None, *, desc: str, total: Optional[int] = None, unit: str = "it"):
    """tqdm over `iterable` (or a manual bar with `total`), labelled `tailorfx: desc`, on stderr."""
    from tqdm.auto import tqdm
    flag = os.environ.get("TAILORFX_PROGRESS")
    disable = None if flag is None else flag == "0"   # None: tqdm shows it only on a terminal
    return tqdm(iterable, total=total, desc=f"tailorfx: {desc}", unit=unit, leave=False, disable=disable,
                file=sys.stderr, dynamic_ncols=True)


@contextlib.contextmanager
def stage(desc: str) -> Iterator[None]:
    """A bar for one long step whose progress cannot be counted (a capture by torch.compile, the
    lowering of a large graph): its elapsed time, refreshed each second, so a user sees what
    tailorfx is doing and for how long."""
    stop = threading.Event()
    with progress(total=1, desc=desc, unit="stage") as bar:
        def tick():
            while not stop.wait(1.0):
                bar.refresh()
        ticker = None if bar.disable else threading.Thread(target=tick, daemon=True, name="tailorfx-progress")
        if ticker is not None:
            ticker.start()
        try:
            yield
            bar.update(1)
        finally:
            stop.set()
            if ticker is not None:
                ticker.join()
