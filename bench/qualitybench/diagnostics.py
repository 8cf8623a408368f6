"""The diagnostics of a quality run: which coordinates move, and how far (:class:`Diagnostics`)."""
from __future__ import annotations


class Diagnostics:
    """``on_step`` hook of the training loop: per window of ``window`` steps, the fraction of parameter
    coordinates that changed at least once in the window (``frac_updated``), the mean over its steps of
    the fraction that changed at that step (``mean_step_frac``), and the mean |p_t - p_0| per coordinate
    at the window's end (``mean_abs_displacement``).

    Rank 0 computes them from the full parameters (every rank holds a replica outside ZeRO-3; under
    ZeRO-3 the hook records nothing). Costs two fp32 copies of the parameters (p_0 and the previous
    step's) and one comparison per step. ``state_dict`` / ``load_state_dict`` carry the open window
    across a resume; the wall time of the finished segments travels with them.
    """

    def __init__(self, p0, window: int, rank: int):
        self.p0 = p0  # (N,) float32, rebuilt by initial_params, never saved
        self.window = window
        self.rank = rank
        self.prev = p0.clone()  # (N,) the parameters after the previous step
        self.changed = None  # (N,) bool: changed at least once in the open window
        self.step_frac_sum, self.window_steps = 0.0, 0
        self.windows: list[dict] = []
        self.max_abs_displacement_step1 = None  # 0.0 when p_0 is right: lr is 0 at step 1 (warm-up from 0)
        self.wall_before = 0.0  # seconds of the finished segments of a resumed run
        self.disabled = False

    def _flat(self, engine):
        import torch

        params = list(engine.module.parameters())
        if any(hasattr(p, "ds_tensor") for p in params):
            return None  # ZeRO-3: partitioned parameters, no replica to read
        return torch.cat([p.detach().reshape(-1).float().cpu() for p in params])

    def __call__(self, step: int, engine) -> None:
        if self.rank != 0 or self.disabled:
            return
        p = self._flat(engine)
        if p is None:
            self.disabled = True
            return
        if p.numel() != self.p0.numel():
            raise RuntimeError(f"diagnostics: the model has {p.numel()} parameters, "
                               f"the rebuilt start {self.p0.numel()}")
        moved = p != self.prev  # (N,) bool
        self.changed = moved if self.changed is None else self.changed | moved
        self.step_frac_sum += float(moved.float().mean())
        self.window_steps += 1
        self.prev = p
        if step == 1:
            self.max_abs_displacement_step1 = float((p - self.p0).abs().max())
        if step % self.window == 0:
            self.close_window(step)

    def close_window(self, step: int) -> None:
        """Record the open window (if it has steps) as ending at ``step``."""
        if self.rank != 0 or self.disabled or not self.window_steps:
            return
        self.windows.append(dict(step=step, steps=self.window_steps, frac_updated=float(self.changed.float().mean()),
                                 mean_step_frac=self.step_frac_sum / self.window_steps,
                                 mean_abs_displacement=float((self.prev - self.p0).abs().mean())))
        self.changed, self.step_frac_sum, self.window_steps = None, 0.0, 0

    def state_dict(self, wall_s: float) -> dict:
        return dict(prev=self.prev, changed=self.changed, step_frac_sum=self.step_frac_sum,
                    window_steps=self.window_steps, windows=self.windows, wall_s=wall_s, disabled=self.disabled,
                    max_abs_displacement_step1=self.max_abs_displacement_step1)

    def load_state_dict(self, state: dict) -> None:
        self.prev, self.changed = state["prev"], state["changed"]
        self.step_frac_sum, self.window_steps = state["step_frac_sum"], state["window_steps"]
        self.windows, self.wall_before = state["windows"], state["wall_s"]
        self.disabled, self.max_abs_displacement_step1 = state["disabled"], state["max_abs_displacement_step1"]

    def summary(self) -> dict:
        last = self.windows[-1] if self.windows else {}
        return dict(frac_updated_last_window=last.get("frac_updated"),
                    mean_step_frac_last_window=last.get("mean_step_frac"),
                    mean_abs_displacement=last.get("mean_abs_displacement"),
                    max_abs_displacement_step1=self.max_abs_displacement_step1, diag_windows=self.windows)

