"""GRUs over right-padded sequences of varying lengths, packed or at a static shape.

Every GRU of the caption encoders and of GPO's weight generator reads sequences of different
lengths padded on the right. Two ways give the same states:

- **packed** (:func:`torch.nn.utils.rnn.pack_padded_sequence`): the GRU runs over each sequence's
  real steps only. The lengths are read on the host, and the packed shapes change with them, so
  a step can neither be captured as a CUDA graph nor traced by ``torch.compile`` without a break.
- **static**: the GRU runs over all ``T`` positions of a batch whose lengths stay on the device.
  The forward direction reads the real tokens first, so its states at positions ``< length`` are
  those of the packed run whatever the padding holds. The backward direction must read the real
  tokens first too: each sequence is shifted to end at ``T`` (the padding moved in front), the
  backward direction of that copy then starts at the last real token, and its states are shifted
  back. One bidirectional call runs both copies side by side, ``(2B, T)``: the first half gives
  the forward states, the second half the backward ones (each half's other direction is
  discarded). The summary state of a direction is its output at its last real position (the
  forward output at ``length - 1``, the backward output at 0), as the packed run's ``h_n``.

The static path costs the padded positions and a second copy of the batch, but its shapes
depend on ``T`` alone and nothing in it reads the device from the host. Modules with both paths
derive from :class:`StaticShapes`; :func:`use_static_shapes` switches a model's modules (the
training task switches them on for CUDA graphs, :mod:`icr.train.graphs`). A bidirectional GRU of
several layers has no static path: each layer's input mixes both directions of the layer below.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

__all__ = ["StaticShapes", "run_gru", "use_static_shapes"]


class StaticShapes:
    """A module with a packed and a static-shape path (module docstring); packed by default."""

    static_shapes: bool = False


def use_static_shapes(net: nn.Module, flag: bool = True) -> None:
    """Switch every :class:`StaticShapes` module of ``net`` to its static (``True``) or packed
    (``False``) path."""
    for module in net.modules():
        if isinstance(module, StaticShapes):
            module.static_shapes = flag


def run_gru(gru: nn.GRU, inputs: Tensor, lengths: Tensor, *, static: bool) -> tuple[Tensor, Tensor]:
    """Run a batch-first ``gru`` over right-padded ``inputs`` of ``lengths``.

    Returns the per-position outputs, 0 beyond each length, and the last layer's summary state
    of each direction (``h_n`` of a packed run: the forward direction after the last real token,
    the backward one after the first).

    Shapes:
        inputs ``(B, T, E)``, lengths ``(B,)`` with ``1 <= length <= T`` (on the host for the
        packed path; on ``inputs.device`` for the static one, where a host tensor is moved)
        -> outputs ``(B, T, dirs * H)``, summary ``(dirs, B, H)``.
    """
    if static:
        return _static(gru, inputs, lengths.to(inputs.device))
    return _packed(gru, inputs, lengths)


def _packed(gru: nn.GRU, inputs: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
    batch, length = inputs.shape[:2]
    packed = pack_padded_sequence(inputs, lengths.cpu(), batch_first=True, enforce_sorted=False)
    out, h_n = gru(packed)  # h_n (L * dirs, B, H), in input order
    outputs = _unpack(out, length)  # (B, T, dirs * H)
    dirs = 2 if gru.bidirectional else 1
    return outputs, h_n.view(gru.num_layers, dirs, batch, gru.hidden_size)[-1]


def _unpack(packed: PackedSequence, total_length: int) -> Tensor:
    """``pad_packed_sequence(packed, batch_first=True)``, padded to ``total_length``, without its
    host read of the batch order (torch moves the order to the CPU to reorder the lengths it
    returns, a wait for the GPU): the order is applied on the device."""
    sorted_out, _ = pad_packed_sequence(PackedSequence(packed.data, packed.batch_sizes),
                                        batch_first=True, total_length=total_length)
    if packed.unsorted_indices is None:
        return sorted_out
    return sorted_out.index_select(0, packed.unsorted_indices)


def _static(gru: nn.GRU, inputs: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
    batch, length = inputs.shape[:2]
    hidden = gru.hidden_size
    positions = torch.arange(length, device=inputs.device)  # (T,)
    real = positions[None, :] < lengths[:, None]  # (B, T)
    last = (lengths - 1).view(batch, 1, 1).expand(batch, 1, hidden)  # (B, 1, H)
    if not gru.bidirectional:
        out, _ = gru(inputs)  # (B, T, H): the real steps come first
        outputs = out.masked_fill(~real[:, :, None], 0.0)
        return outputs, out.gather(1, last).transpose(0, 1)  # (1, B, H)
    if gru.num_layers > 1:
        raise ValueError("a bidirectional GRU of several layers has no static-shape path; "
                         "use one layer or the packed path")
    # shifted[b, t] = inputs[b, t - (T - length_b)]: the sequence ends at T, padding in front
    shift = (length - lengths)[:, None]  # (B, 1)
    source = (positions[None, :] - shift).clamp(min=0)  # (B, T)
    shifted = inputs.gather(1, source[:, :, None].expand_as(inputs))  # (B, T, E)
    out, _ = gru(torch.cat([inputs, shifted], dim=0))  # (2B, T, 2H)
    forward = out[:batch, :, :hidden]  # (B, T, H)
    # back to the original positions: backward state of token t sits at t + shift
    back = (positions[None, :] + shift).clamp(max=length - 1)  # (B, T)
    backward = out[batch:, :, hidden:].gather(1, back[:, :, None].expand(batch, length, hidden))
    outputs = torch.cat([forward, backward], dim=-1).masked_fill(~real[:, :, None], 0.0)
    summary = torch.stack([forward.gather(1, last)[:, 0], backward[:, 0]])  # (2, B, H)
    return outputs, summary
