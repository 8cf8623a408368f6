"""The sparse exchange, apart from the optimizers and DeepSpeed (docs/design.md sections 1-2).

- ``core``: what both optimizers share: the refresh/dense schedule, the pending mask all-gather,
  lazy weight decay, the ``comm_stats`` dict, the same-layout check on load;
- ``masks``, ``layout``: mask selection and the flat sharded layout of path A (pure functions);
- ``pieces``: the ZeRO-3 piece, packing and replica-position arithmetic (pure functions);
- ``stage3``: SCAPE's state and collectives under ZeRO-3 (``ScapeStage3.scape``);
- ``refused``: the DeepSpeed settings each path refuses.
"""
