"""Checkpoints: ``model.safetensors`` + ``config.json`` (+ ``tokenizer.json``) in one directory.

The one home of the checkpoint directory, split by job:

- :mod:`.format`: the files of a model and reading them back (``load_checkpoint``,
  ``load_checkpoint_tokenizer``);
- :mod:`.folder`: the output-folder policy (attnlab replaces only folders it wrote:
  ``check_out_dir``) and ``save_checkpoint``, which writes under it;
- :mod:`.state`: the training state a run resumes from, and ``OUT/best/``.

Written atomically through :func:`attnlab.io.atomic_dir` (a finished directory
replaces the old one in a rename), read without pickle.
"""

from ..io import CheckpointError
from .folder import check_out_dir, has_checkpoint, save_checkpoint
from .format import (
    FORMAT,
    load_checkpoint,
    load_checkpoint_tokenizer,
    read_config,
    same_weights,
    write_model_files,
)
from .state import (
    RESUMABLE_CHANGES,
    nothing_to_resume,
    planned_steps,
    read_best,
    restore_training_state,
    save_training_state,
)

__all__ = ["save_checkpoint", "load_checkpoint", "load_checkpoint_tokenizer",
           "write_model_files", "CheckpointError", "FORMAT", "read_config", "same_weights",
           "check_out_dir", "has_checkpoint", "save_training_state", "restore_training_state",
           "read_best", "nothing_to_resume", "planned_steps", "RESUMABLE_CHANGES"]
