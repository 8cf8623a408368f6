"""The node stage of hierarchical SCAPE: dense inside a node, around the sparse exchange across nodes.

docs/design.md, Hierarchical SCAPE. With ``scape.hierarchy = "node"`` the data-parallel group of
D = G M ranks (G per node, M nodes) is split in two: the *node* group (the G ranks of one node, fast
links) and the *cross-node* group of local rank l (rank l of every node, the slow network). The flat
buffer of N_pad = G M S elements is cut into G slices of M S; local rank l is responsible for
slice l. :class:`~scape_ds.optim.ScapeAdamS` runs its flat exchange unchanged over the cross-node
group on slice l, with this stage around it:

  1. before: a dense reduce-scatter of the local gradient over the node group; rank l receives the
     node sum of slice l, (M S,) (:meth:`NodeStage.reduce_grads`);
  2. SCAPE on slice l across nodes (error feedback of M S elements, masks, packed collectives);
  3. after: a packed all-gather over the node group of the new values at every slice's mask
     (:meth:`NodeStage.gather_values`; dense on dense steps, :meth:`NodeStage.gather_params`), so
     every rank of the node holds the same parameters. The slices' masks travel inside the node
     once per refresh (:meth:`NodeStage.node_index`).

:class:`FlatStage` is the same interface doing nothing: a flat run is a one-rank node whose slice is
the whole buffer, without copies. The optimizer chooses one of the two once, at construction.
"""
from __future__ import annotations

import torch

from ..comm import Communicator, collective_bytes
from .masks import offsets_to_index

__all__ = ["FlatStage", "NodeStage"]


class FlatStage:
    """No node stage (``hierarchy="flat"``): the slice is the whole buffer and nothing moves."""

    size = 1
    rank = 0
    meter = None

    def slice_of(self, flat: torch.Tensor) -> torch.Tensor:
        return flat

    def grad_buffer(self, flat_grad: torch.Tensor) -> torch.Tensor:
        return flat_grad  # the slice's gradient is the local gradient itself

    def reduce_grads(self, flat_grad: torch.Tensor, grad_slice: torch.Tensor) -> None:
        return None

    def all_reduce(self, tensor: torch.Tensor, tag: str) -> None:
        return None

    def broadcast(self, tensor: torch.Tensor, tag: str) -> None:
        return None

    def gather_params(self, flat_param: torch.Tensor, param_slice: torch.Tensor) -> None:
        return None

    def gather_values(self, values: torch.Tensor) -> torch.Tensor:
        return values

    def node_index(self, offsets, index, chunk_size, k_per_chunk, kernels) -> torch.Tensor:
        return index

    def dense_bytes(self, padded_numel: int, elem_bytes: int, dense_numel: int) -> int:
        return 0


class NodeStage:
    """Collectives over the node group around the cross-node exchange of slice ``intra.rank``.

    Args:
        intra: the communicator over this node's G data-parallel ranks (its meter counts the
            intra-node bytes; the cross-node communicator's meter the inter-node ones).
    """

    def __init__(self, intra: Communicator):
        self.intra = intra
        self.size, self.rank, self.meter = intra.world_size, intra.rank, intra.meter

    def slice_of(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a (G M S,) buffer: a (M S,) view."""
        n = flat.numel() // self.size
        return flat[self.rank * n : (self.rank + 1) * n]

    def grad_buffer(self, flat_grad: torch.Tensor) -> torch.Tensor:
        """The node sum of this rank's slice lands here: (M S,) in the compute dtype, N/G per rank."""
        return torch.zeros(flat_grad.numel() // self.size, dtype=flat_grad.dtype, device=flat_grad.device)

    def reduce_grads(self, flat_grad: torch.Tensor, grad_slice: torch.Tensor) -> None:
        """Step 1: ``grad_slice`` (M S,) = sum over the node of slice ``rank`` of ``flat_grad`` (G M S,)."""
        self.intra.reduce_scatter(grad_slice, flat_grad, "grad_rs")

    def all_reduce(self, tensor: torch.Tensor, tag: str) -> None:
        """Sum over the node (dense tensors and norms: the cross-node sum follows or came first)."""
        self.intra.all_reduce(tensor, tag)

    def broadcast(self, tensor: torch.Tensor, tag: str) -> None:
        """Local rank 0's ``tensor`` to the node."""
        self.intra.broadcast(tensor, 0, tag)

    def gather_params(self, flat_param: torch.Tensor, param_slice: torch.Tensor) -> None:
        """Dense step 3: every slice, updated by its rank, gathered in place into ``flat_param``."""
        self.intra.all_gather(flat_param, param_slice, "param_ag")

    def gather_values(self, values: torch.Tensor) -> torch.Tensor:
        """Sparse step 3: (K,) new values of this slice's mask -> (G K,), every slice's, in slice order."""
        out = torch.empty(values.numel() * self.size, dtype=values.dtype, device=values.device)  # (G K,)
        self.intra.all_gather(out, values, "param_ag")
        return out

    def node_index(self, offsets, index, chunk_size, k_per_chunk, kernels) -> torch.Tensor:
        """The (G K,) int64 indices into the whole buffer of every slice's mask, from this slice's
        (K,) int16 ``offsets``: one all-gather of the encoded masks over the node (per refresh)."""
        encoded = kernels.encode_mask(offsets, chunk_size, k_per_chunk)  # (L,) uint8
        out = torch.empty(encoded.numel() * self.size, dtype=encoded.dtype, device=encoded.device)  # (G L,)
        self.intra.all_gather(out, encoded, "mask_ag")
        return offsets_to_index(kernels.decode_mask(out, chunk_size, k_per_chunk), chunk_size, k_per_chunk)

    def dense_bytes(self, padded_numel: int, elem_bytes: int, dense_numel: int) -> int:
        """Intra-node bytes of a dense hierarchical step: reduce-scatter of (N_pad,), all-gather of
        the slice (N_pad / G,), all-reduce of the dense tensors (fp32)."""
        G = self.size
        return (collective_bytes("reduce_scatter", padded_numel * elem_bytes, G)
                + collective_bytes("all_gather", padded_numel // G * elem_bytes, G)
                + collective_bytes("all_reduce", dense_numel * 4, G))
