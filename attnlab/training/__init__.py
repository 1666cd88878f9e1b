"""Training: AdamW, warmup + cosine, clipping, eval, checkpoints that resume bit-exactly.

A run is a function of (model init, data, TrainConfig); the loop is :mod:`.loop`, its
settings :mod:`.settings`, its data :mod:`.data` (documents packed into rows:
:mod:`.packing`), ``torchrun`` :mod:`.distributed`.
"""

from ..checkpoint import has_checkpoint
from .data import HELD_OUT_KEPT, evaluate, held_out_record, lm_loss, sample, split
from .distributed import train_device
from .loop import TrainingDiverged, train
from .packing import Packed, pack, packed_loss, split_documents
from .settings import (
    MAX_STEPS,
    TrainConfig,
    activation_bytes,
    check_seed,
    check_steps,
    check_training_fits,
    default_checkpoint_every,
    lr_at,
)

__all__ = ["train", "TrainConfig", "TrainingDiverged", "MAX_STEPS", "check_steps",
           "check_seed", "check_training_fits", "activation_bytes", "default_checkpoint_every",
           "lr_at", "split", "sample", "evaluate", "lm_loss", "held_out_record", "HELD_OUT_KEPT",
           "train_device", "has_checkpoint", "split_documents", "pack", "Packed", "packed_loss"]
