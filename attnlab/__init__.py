"""attnlab: attention mechanisms, exact, fast and visible.

The public API is listed in DESIGN.md; the attention math lives in
:mod:`attnlab.functional` and nowhere else.
"""

from . import masks, reference
from .functional import BACKENDS, attention

__version__ = "0.1.0"

__all__ = ["attention", "BACKENDS", "masks", "reference", "__version__"]
