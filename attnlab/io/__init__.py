"""Checkpoint file primitives: atomic writes, safetensors, JSON, atomic directories.

Everything here is model-agnostic and never uses pickle. Tensors go through
safetensors, configuration through JSON.

Atomic files
    :func:`atomic_write_bytes` (and the text/JSON variants) write to a temp file
    in the same directory, flush, ``fsync``, ``os.replace`` it over the target and
    ``fsync`` the directory. A reader therefore sees either the old file or the
    new one, never a mix, even if the writer is killed or the machine loses power.
    If the write fails the temp file is removed and the old file is untouched. A
    writer killed by SIGKILL cannot clean up: a stale ``.<name>.*.tmp`` file may
    then remain next to the target (the target itself is intact).

Atomic directories
    :func:`atomic_dir` writes a whole checkpoint directory at once. POSIX has no
    atomic "replace a non-empty directory", so the swap takes two renames:

    1. contents are written to ``.<name>.tmp-<pid>-<rand>`` and fsynced;
    2. that folder is renamed ``.<name>.ready-<pid>-<rand>`` (complete, not live);
    3. an existing ``<name>`` is marked and renamed ``<name>.old-<pid>-<rand>``;
    4. the ready folder is renamed ``<name>`` (and its marker removed);
    5. ``<name>.old-*`` is renamed to a temp name and removed (so a crash
       while deleting never leaves a half-deleted copy that looks complete).

    Every folder of these steps holds a marker file (``.attnlab-atomic``: the
    final name and the folder's suffix), and recovery touches only folders whose
    marker matches: a user's ``<name>.old-1/`` merely looks like a leftover.

    A crash before 3 leaves the old ``<name>`` in place. A crash between 3 and 4
    leaves no ``<name>`` at all, but both the old copy and the complete new copy
    still exist; :func:`recover_dir` then puts the new (ready) copy in place, or
    the old one if there is no ready copy. A crash after 4 leaves only
    leftovers, which :func:`recover_dir` deletes. Loaders should call
    :func:`recover_dir` before reading a checkpoint directory. Writers and
    recovery take an exclusive ``flock`` on the parent directory (POSIX), so a
    recovery never touches the folders of a writer that is still running, and
    two writers to the same parent are serialised.
"""

from __future__ import annotations

from .dirs import atomic_dir, recover_dir
from .files import (
    ATOMIC_MARKER,
    BEST_DIR,
    CONFIG_FILE,
    EXPLORER_FILE,
    HEADS_JSON,
    HEADS_PNG,
    HEADS_SVG,
    HEATMAP_FILE,
    HEATMAP_SVG,
    MODEL_FILE,
    OWN_FILES,
    STATE_JSON,
    STATE_TENSORS,
    SUMMARY_FILE,
    TOKENIZER_FILE,
    CheckpointError,
    atomic_write_bytes,
    atomic_write_json,
    atomic_write_text,
)
from .reading import read_json
from .tensors import load_metadata, load_tensors, save_tensors

__all__ = [
    "CheckpointError",
    "atomic_write_bytes",
    "atomic_write_text",
    "atomic_write_json",
    "save_tensors",
    "load_tensors",
    "load_metadata",
    "read_json",
    "atomic_dir",
    "recover_dir",
    "MODEL_FILE", "CONFIG_FILE", "TOKENIZER_FILE", "STATE_TENSORS", "STATE_JSON",
    "ATOMIC_MARKER", "SUMMARY_FILE", "HEATMAP_FILE", "HEATMAP_SVG", "EXPLORER_FILE",
    "HEADS_JSON", "HEADS_PNG", "HEADS_SVG", "OWN_FILES", "BEST_DIR",
]
