"""Pictures of attention: PNG heatmaps (matplotlib, Agg) and the offline HTML explorer.

- :func:`heatmap` draws one ``(q_len, k_len)`` matrix and returns the Figure;
- :func:`heatmap_grid` / :func:`save_heatmaps` draw every layer x head as one PNG;
- :func:`write_html` writes the interactive explorer, one self-contained HTML file;
- :func:`explorer` returns the explorer as an object a notebook shows inline;
- :func:`show_attention` runs a model on a text and writes both (``rollout=True`` adds
  the attention rollout as an extra layer);
- :func:`compare` runs a model on two texts: one head on both and their difference
  (:func:`compare_figure`), and the explorer with a diff mode;
- a long text's page and picture hold each row's strongest keys (:class:`TopKeys`,
  :mod:`.long`): no ``seq x seq`` matrix per head;
- :func:`rollout` follows attention through the layers (Abnar and Zuidema 2020);
- :func:`save_head_importance` draws the layers x heads table of ``ablate --heads``;
- :func:`save_head_kinds` draws what each head does (``attnlab heads``).

Labels in any script are drawn with the installed fonts (:mod:`.fonts`).

``attentions`` everywhere is a sequence (one per layer) of ``(heads, q_len, k_len)``
torch tensors or NumPy arrays; neither torch nor matplotlib is imported until used.
"""

from .compare import align_tokens, compare, compare_figure
from .explorer import Explorer, explorer, render_html, write_html
from .fonts import font_context, label_fonts
from .heads import head_importance_figure, head_kinds_figure, save_head_importance, save_head_kinds
from .heatmap import heatmap, heatmap_grid, save_heatmaps
from .long import TopKeys
from .rollout import rollout
from .show import capture, show_attention

__all__ = ["heatmap", "heatmap_grid", "save_heatmaps", "write_html", "render_html", "capture",
           "show_attention", "rollout", "head_importance_figure", "save_head_importance",
           "head_kinds_figure", "save_head_kinds",
           "explorer", "Explorer", "font_context", "label_fonts", "compare", "compare_figure",
           "align_tokens", "TopKeys"]
