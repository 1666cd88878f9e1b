"""``attnlab.heads``: the head experiments under the name the README uses.

The code lives in :mod:`attnlab.experiments.heads` (which heads matter: knock-outs) and
:mod:`attnlab.experiments.head_kinds` (what each head does: ``classify``); this module
keeps the public paths ``attnlab.heads.knocked_out``, ``attnlab.heads.classify`` and
friends working.
"""

from .experiments.head_kinds import (
    ABOUT,
    KINDS,
    OTHER,
    classify,
    format_kinds,
    head_labels,
    probe_ids,
    probe_scores,
    save_kinds,
)
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
           "knocked_out", "knockout", "measure", "pooled",
           "ABOUT", "KINDS", "OTHER", "classify", "format_kinds", "head_labels", "probe_ids",
           "probe_scores", "save_kinds"]
