"""Rotary position embedding (RoPE), in the half-split convention of Llama checkpoints.

A vector ``x`` of even size ``D`` at position ``p`` is split into halves
``x1 = x[:D/2]`` and ``x2 = x[D/2:]``; pair ``i`` (``x1[i]``, ``x2[i]``) is rotated by the
angle ``p * inv_freq[i]`` with ``inv_freq[i] = base ** (-2i / D)``::

    rope(x, p) = x * cos + rotate_half(x) * sin,   rotate_half(x) = cat(-x2, x1)
    cos = cat(cos(p * inv_freq), cos(p * inv_freq))   (likewise sin)

``scaling`` stretches the frequencies for contexts longer than the model was trained on,
as transformers' ``rope_parameters`` say: ``{"rope_type": "linear", "factor": f}`` divides
every ``inv_freq`` by ``f``; ``"llama3"`` (Llama 3.1-3.3) divides the low frequencies
(wavelengths above ``original_max_position_embeddings / low_freq_factor``) by ``factor``,
keeps the high ones (below ``... / high_freq_factor``) and blends those between;
``{"rope_type": "factors", "factors": [...]}`` divides each by its own (``head_dim / 2``
of them: llama.cpp's ``rope_freqs`` tensor, in which a Llama 3.1 GGUF file writes it).

This is ``transformers``' ``apply_rotary_pos_emb`` (Llama, Mistral, Qwen, ...), not
the interleaved-pairs convention of the original RoFormer/GPT-J code. The angle
table is computed in float64 and stored in float32, so positions in the hundreds of
thousands keep their accuracy (float32 angles lose ~1e-2 rad there).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .checks import finite_float, is_int

__all__ = ["RotaryEmbedding", "rotate_half", "check_scaling", "SCALINGS"]

# rope_type -> the keys of its scaling (transformers' names)
SCALINGS = {"linear": ("factor",),
            "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                       "original_max_position_embeddings"),
            "factors": ("factors",)}

# Positions below this are served from the cached table ((TABLE_MAX, head_dim) x 2 in
# float32 at most); beyond it the factors are computed for the asked positions only.
TABLE_MAX = 1 << 15


def check_scaling(name: str, scaling: object, head_dim: int | None = None) -> dict | None:
    """``scaling`` (None, or a mapping with a ``rope_type`` of :data:`SCALINGS` and its
    keys, positive numbers; ``factors``: ``head_dim / 2`` of them where ``head_dim`` is
    given) as a plain dict; a ValueError naming ``name`` otherwise."""
    if scaling is None:
        return None
    kind = scaling.get("rope_type") if isinstance(scaling, dict) else None
    if kind not in SCALINGS:
        raise ValueError(f"{name}={scaling!r} is not supported (expected None or a rope_type "
                         f"of {sorted(SCALINGS)} with its keys)")
    unknown = sorted(set(scaling) - {"rope_type", *SCALINGS[kind]})
    if unknown:
        hint = " (RoPE's base is rope_base, not a key of the scaling)" \
            if "rope_theta" in unknown else ""
        raise ValueError(f"{name}: {unknown[0]!r} is not a key of rope_type {kind!r} "
                         f"(expected {list(SCALINGS[kind])}){hint}")
    out = {"rope_type": kind}
    if kind == "factors":
        factors = scaling.get("factors")
        if not isinstance(factors, list | tuple) or not factors or not all(
                isinstance(f, int | float) and not isinstance(f, bool) and 0 < f < float("inf")
                for f in factors):
            raise ValueError(f"{name}: factors={factors!r} is not valid (expected a list of "
                             "positive numbers, one per frequency)")
        if head_dim is not None and len(factors) != head_dim // 2:
            raise ValueError(f"{name} has {len(factors)} factors, expected one per "
                             f"frequency: head_dim / 2 = {head_dim // 2}")
        return {"rope_type": kind, "factors": [float(f) for f in factors]}
    for key in SCALINGS[kind]:
        value = scaling.get(key)
        if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0 \
                or value == float("inf"):
            raise ValueError(f"{name}: {key}={value!r} is not valid (expected a positive "
                             f"number for rope_type {kind!r})")
        out[key] = float(value)  # (one table for 2 and 2.0: GPT shares rotaries by value)
    if kind == "llama3" and out["high_freq_factor"] <= out["low_freq_factor"]:
        raise ValueError(f"{name}: high_freq_factor={out['high_freq_factor']} must exceed "
                         f"low_freq_factor={out['low_freq_factor']}")
    return out


def _scaled(inv_freq: torch.Tensor, scaling: dict | None) -> torch.Tensor:
    """``inv_freq`` as ``scaling`` (:func:`check_scaling`'s) stretches it."""
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "factors":
        return inv_freq / torch.tensor(scaling["factors"], dtype=inv_freq.dtype,
                                       device=inv_freq.device)
    factor = scaling["factor"]
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    context = scaling["original_max_position_embeddings"]
    wavelength = 2 * math.pi / inv_freq
    # Between the bands: a blend, weight 0 at the low band's edge and 1 at the high one's.
    smooth = ((context / wavelength - low) / (high - low)).clamp(0.0, 1.0)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelength > context / low, inv_freq / factor, blended)
    return torch.where(wavelength < context / high, inv_freq, out)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``cat(-x2, x1)`` over the last dimension, where ``x1, x2`` are its two halves."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    """Rotate queries or keys by their position (RoPE, half-split convention).

    Args:
        head_dim (int): size ``D`` of each head's vectors; must be even.
        base (float): the frequency base; ``inv_freq[i] = base ** (-2i / D)``.
            10000.0 for Llama 1/2 and most models.
        scaling (dict | None): the frequencies stretched for longer contexts (module
            docstring): ``{"rope_type": "linear" | "llama3", ...}``; None for none.

    The cos/sin table grows on demand to the largest position asked for and is
    rebuilt on the device of the input. It is a plain tensor attribute, not a
    buffer: never in a checkpoint, never cast by ``model.half()``, and never
    broadcast by DistributedDataParallel (whose buffer sync would fail when ranks
    have grown tables of different lengths).

    Example:
        >>> rope = RotaryEmbedding(64)
        >>> q = torch.randn(2, 8, 5, 64)       # (batch, heads, seq, head_dim)
        >>> rope(q).shape                        # positions 0..4
        torch.Size([2, 8, 5, 64])
        >>> rope(q[:, :, :1], 5).shape           # one new token at position 5 (decoding)
        torch.Size([2, 8, 1, 64])
    """

    def __init__(self, head_dim: int, base: float = 10000.0,
                 scaling: dict | None = None) -> None:
        super().__init__()
        if not is_int(head_dim) or head_dim < 2 or head_dim % 2:
            raise ValueError(f"head_dim must be an even int >= 2 for RoPE, got {head_dim!r}")
        if finite_float("base", base) <= 1.0:
            raise ValueError(f"base must be a number > 1, got {base!r}")
        self.head_dim = head_dim
        self.base = float(base)
        self.scaling = check_scaling("scaling", scaling, head_dim)
        # (max_len, head_dim) float32 tables of cos and signed sin, filled on first use.
        # On the CPU even when the model is built on the meta device (loading weights
        # without a random initialisation): _ensure moves them where the input is.
        self._cos = torch.empty(0, head_dim, device="cpu")
        self._sin = torch.empty(0, head_dim, device="cpu")

    def extra_repr(self) -> str:
        scaled = "" if self.scaling is None else f", scaling={self.scaling}"
        return f"head_dim={self.head_dim}, base={self.base}{scaled}"

    def inv_freq(self, device=None, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """``(head_dim // 2,)`` inverse frequencies ``base ** (-2i / head_dim)``, scaled."""
        exponent = torch.arange(0, self.head_dim, 2, dtype=torch.float64, device=device)
        return _scaled(1.0 / (self.base ** (exponent / self.head_dim)), self.scaling).to(dtype)

    def _angles(self, positions: torch.Tensor) -> torch.Tensor:
        """``(..., head_dim)`` float64 angles ``cat(p * inv_freq, p * inv_freq)``."""
        freqs = positions.to(torch.float64).unsqueeze(-1) * self.inv_freq(positions.device)
        return torch.cat((freqs, freqs), dim=-1)

    def _cos_signed_sin(self, angles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos`` and the *signed* sine ``cat(-sin1, sin2)`` (see :meth:`rotate`)."""
        half = self.head_dim // 2
        sin = angles.sin()
        sin[..., :half].neg_()
        return angles.cos(), sin

    def _ensure(self, length: int, device: torch.device) -> None:
        """Grow the float32 tables to at least ``length`` positions on ``device``."""
        cos = self._cos
        if cos.shape[0] >= length and cos.device == device:
            return
        # Grow geometrically so a decoding loop rebuilds the table O(log n) times.
        size = min(max(length, 2 * cos.shape[0] if cos.device == device else 0, 64), TABLE_MAX)
        # The table outlives this call: build it as a normal tensor even when called
        # under inference_mode, or a later training forward could not use it.
        with torch.inference_mode(False), torch.no_grad():
            cos, sin = self._cos_signed_sin(self._angles(torch.arange(size, device=device)))
            self._cos, self._sin = cos.float(), sin.float()

    def tables(self, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The float32 tables ``(P, head_dim)`` of cos and signed sin for positions
        ``0 .. P-1``, ``P >= length``, on ``device`` (what :meth:`factors` slices); None
        beyond the cached range (``TABLE_MAX``)."""
        if length > TABLE_MAX:
            return None
        self._ensure(length, device)
        return self._cos, self._sin

    def factors(
        self,
        seq_len: int,
        positions: int | torch.Tensor | None = None,
        *,
        device=None,
        dtype: torch.dtype = torch.float32,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, signed_sin)`` for :meth:`rotate`: compute once, rotate q and k with them.

        Args:
            seq_len (int): number of tokens ``T``.
            positions: None for positions ``0..T-1``; an int offset for
                ``offset..offset+T-1`` (decoding after ``offset`` cached tokens); or an
                integer tensor ``(T,)`` or ``(batch, T)`` of explicit positions.
            device: where to build them (default: the buffers' device).
            dtype: float32, or float64 to compute in float64 throughout.

        Returns:
            two tensors ``(T, head_dim)``, or ``(batch, 1, T, head_dim)`` for
            ``(batch, T)`` positions so that they broadcast over heads. ``signed_sin``
            is ``cat(-sin1, sin2)`` where transformers' ``sin`` is ``cat(sin1, sin2)``.
        """
        if device is None:
            device = self._cos.device
        elif not isinstance(device, torch.device):
            device = torch.device(device)
        if positions is None or type(positions) is int:
            offset = 0 if positions is None else positions
            if offset < 0:
                raise ValueError(f"positions offset must be an int >= 0, got {positions!r}")
            end = offset + seq_len
            if dtype == torch.float64 or end > TABLE_MAX:
                cos, sin = self._cos_signed_sin(
                    self._angles(torch.arange(offset, end, device=device)))
                return cos.to(dtype), sin.to(dtype)
            self._ensure(end, device)
            return self._cos.narrow(0, offset, seq_len), self._sin.narrow(0, offset, seq_len)
        if not isinstance(positions, torch.Tensor):
            raise TypeError(
                f"positions must be None, an int offset or an integer tensor, got "
                f"{type(positions).__name__}"
            )
        if positions.dtype.is_floating_point or positions.dtype == torch.bool or (
            positions.ndim not in (1, 2) or positions.shape[-1] != seq_len
        ):
            raise ValueError(
                f"positions must be an integer tensor of shape (seq={seq_len},) or "
                f"(batch, seq={seq_len}), got shape {tuple(positions.shape)} dtype "
                f"{positions.dtype}"
            )
        positions = positions.to(device)
        if positions.numel() and int(positions.min()) < 0:
            raise ValueError(f"positions must be >= 0, got min {int(positions.min())}")
        end = int(positions.max()) + 1 if positions.numel() else 0
        if dtype == torch.float64 or end > TABLE_MAX:
            cos, sin = self._cos_signed_sin(self._angles(positions))
            cos, sin = cos.to(dtype), sin.to(dtype)
        else:
            self._ensure(end, device)
            cos, sin = self._cos[positions], self._sin[positions]
        if positions.ndim == 2:  # (B, T, D) -> (B, 1, T, D): broadcast over heads
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return cos, sin

    def cos_sin(
        self,
        seq_len: int,
        positions: int | torch.Tensor | None = None,
        *,
        device=None,
        dtype: torch.dtype = torch.float32,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` in transformers' convention (for ``apply_rotary_pos_emb``).

        Arguments as :meth:`factors`; shapes ``(T, head_dim)`` or ``(batch, 1, T, head_dim)``.
        """
        cos, signed = self.factors(seq_len, positions, device=device, dtype=dtype)
        half = self.head_dim // 2
        return cos, torch.cat((-signed[..., :half], signed[..., half:]), dim=-1)

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        """``x * cos + rotate_half(x) * sin`` with the factors of :meth:`factors`.

        ``rotate_half(x) * sin = cat(-x2, x1) * cat(sin1, sin2) = roll(x, D/2) * signed_sin``:
        one roll and one fused multiply-add. ``x`` is ``(..., T, D)``; computed in the
        factors' dtype and returned in ``x``'s.
        """
        dtype = x.dtype
        if dtype != cos.dtype:  # low precision: rotate in float32
            x = x.to(cos.dtype)
        out = torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), signed_sin)
        return out if out.dtype == dtype else out.to(dtype)

    def forward(
        self, x: torch.Tensor, positions: int | torch.Tensor | None = None
    ) -> torch.Tensor:
        """Rotate ``x`` by its positions.

        Args:
            x: ``(batch, heads, seq, head_dim)`` queries or keys (any leading dims work
                with None / int / ``(seq,)`` positions).
            positions: None for ``0..seq-1``; an int offset for ``offset..offset+seq-1``
                (with a KV cache: the number of tokens already cached); or an integer
                tensor ``(seq,)`` or ``(batch, seq)`` of explicit positions (e.g. left
                padding).

        Returns:
            ``(batch, heads, seq, head_dim)`` rotated tensor of the dtype of ``x``.
        """
        if not isinstance(x, torch.Tensor) or x.ndim < 2 or x.shape[-1] != self.head_dim:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(
                f"x must be (batch, heads, seq, head_dim={self.head_dim}), got {shape}"
            )
        dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
        cos, sin = self.factors(x.shape[-2], positions, device=x.device, dtype=dtype)
        return self.rotate(x, cos, sin)
