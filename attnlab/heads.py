"""``attnlab.heads``: the head experiments under the name the README uses.

The code lives in :mod:`attnlab.experiments.heads` (with the other experiments); this
module keeps the public path ``attnlab.heads.knocked_out`` and friends working.
"""

from .experiments.heads import (
    KNOCKOUTS,
    MEANING,
    attention_layers,
    batch_from_ids,
    batch_from_text,
    format_head_table,
    format_knockout,
    head_importance,
    is_decoder,
    knocked_out,
    knockout,
    measure,
    pooled,
)

__all__ = ["KNOCKOUTS", "MEANING", "attention_layers", "batch_from_ids", "batch_from_text",
           "format_head_table", "format_knockout", "head_importance", "is_decoder",
           "knocked_out", "knockout", "measure", "pooled"]
