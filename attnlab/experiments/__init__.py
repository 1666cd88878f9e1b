"""Experiments on trained models, each returning plain numbers that ``attnlab ablate`` prints.

- :mod:`.ablation`: knock out Q, K or V (``qkv_ablation``), attention as average
  pooling (``uniform_attention``), where dropout goes (``dropout_placement``),
  ``saliency`` and ``explain``, and the report of all of them (``run_all``);
- :mod:`.heads`: which heads matter (knock one out, measure the damage);
- :mod:`.head_kinds`: what each head does (previous-token, induction, sink, ...: ``classify``);
- :mod:`.layers`: finding a model's attention modules, written once for all of them.

They sit above the models, training and interop and import nothing of the command
line or of :mod:`attnlab.demo`: the dropout study trains :mod:`attnlab.recipe`.
"""

from .ablation import (
    ABLATIONS,
    ablated,
    dropout_placement,
    explain,
    format_report,
    held_out_batch,
    lm_loss,
    qkv_ablation,
    run_all,
    saliency,
    uniform_attention,
)
from .layers import attention_layers

__all__ = ["ABLATIONS", "ablated", "attention_layers", "dropout_placement", "explain",
           "format_report", "held_out_batch", "lm_loss", "qkv_ablation", "run_all",
           "saliency", "uniform_attention"]
