"""The progress bar each target's driver shows on stderr while a trace runs."""
from __future__ import annotations

import sys

from tqdm import tqdm


def _progress(total: int, name: str, enabled: bool) -> tqdm:
    return tqdm(total=total, desc=f"{name:>12}", unit="req", disable=not enabled, file=sys.stderr,
                dynamic_ncols=True, leave=False)
