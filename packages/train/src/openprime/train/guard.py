"""Inner steps whose gradient is NaN or inf: skipped, kept out of the outer step and the checkpoints, and,
when they go on, a stop that keeps the run.

A loss that overflows (a bad batch, a learning rate too high, a faulty device) makes the gradient NaN; one
AdamW step on it writes NaN into the weights and both moments. Before this guard, a debug run at lr 30
went NaN at step 25, its outer steps carried the NaN to every replica (with int8 the quantizer stopped
every node instead), and its checkpoints at steps 100 and 120 replaced the good ones: the run ended
"done" with loss nan and nothing to go back to. Now:

- an inner step whose clipped gradient norm is not finite is skipped: the weights and the AdamW state
  stay as they were, and the schedule moves on (the step counters stay aligned), as torch.amp's
  GradScaler skips the steps that overflow. The norm is global (all local ranks' shards; under data
  parallel, the averaged gradient), so every process that shares weights skips alike;
- a node whose latest inner step was skipped withholds its pseudo-gradient from the outer step (its weights
  are suspect even where they are finite) and writes no checkpoint there, so the newest checkpoint on disk is
  from before the trouble, and a replica that diverged alone comes back to the others' average;
- after `optim.num_nonfinite_steps_to_stop` skipped steps since the node last contributed to the global
  weights, it stops with `Diverged`, whose message says where the trouble began and how to continue from the
  newest checkpoint.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from openprime.core.errors import OpenPrimeError


class Diverged(OpenPrimeError):
    """Too many inner steps had a NaN or inf gradient since the node last contributed: training has diverged."""


class NonFiniteSteps:
    """Counts the inner steps skipped for a NaN/inf gradient norm, says when a streak of them starts and ends, and
    raises `Diverged` once `num_to_stop` were skipped since this node last contributed to the global weights.

    Counting since the last contribution, not in a row: when every replica diverges, each outer step takes them
    all back to the last good global weights, and a learning rate that is too high then blows them up again
    after one or two finite steps; in a row, such a run would never stop, and it would make no progress.
    """

    def __init__(self, *, num_to_stop: int, lr: float, say: Callable[[str], None], node: int) -> None:
        self.num_to_stop, self.lr, self.say, self.node = num_to_stop, lr, say, node
        self.streak = 0  # skipped steps in a row, up to the latest one
        self.first_skipped = 0  # the step where the current streak began
        self.num_since_contributed = 0  # skipped since this node's weights last went into the global weights
        self.first_since_contributed = 0  # the first of those

    @property
    def healthy(self) -> bool:
        """The latest inner step had a finite gradient: this node's weights may go into the mean and to disk."""
        return self.streak == 0

    def contributed(self) -> None:
        """This node's weights went into the global weights (a committed outer step it contributed to; under data
        parallel, a step that was not skipped), or it took the run's state from a peer: a fresh start."""
        self.num_since_contributed = 0

    def update(self, step: int, grad_norm: float, loss: float) -> bool:
        """Record inner step `step` (already taken or skipped by `train_step`); returns whether it was skipped."""
        if math.isfinite(grad_norm):
            if self.streak:
                self.say(f"[node {self.node}] step {step}: the gradient is finite again after {self.streak} skipped "
                         f"step(s) ({self.first_skipped}-{step - 1})")
            self.streak = 0
            return False
        self.streak += 1
        self.num_since_contributed += 1
        if self.streak == 1:
            self.first_skipped = step
            self.say(f"[node {self.node}] step {step}: the gradient norm is {grad_norm} (loss {loss:.4g}); this update "
                     f"is skipped (weights and AdamW state untouched), and until a step has a finite gradient again "
                     f"this node neither contributes to an outer step nor writes a checkpoint")
        if self.num_since_contributed == 1:
            self.first_since_contributed = step
        return True

    def stop_if_diverged(self, step: int) -> None:
        """Raise `Diverged` once `num_to_stop` steps were skipped since the node last contributed (after the
        caller recorded step `step`)."""
        if self.num_since_contributed >= self.num_to_stop:
            raise Diverged(
                f"training diverged: {self.num_since_contributed} inner steps had a NaN or inf gradient norm since "
                f"this node last contributed to the global weights (steps {self.first_since_contributed}-{step}; "
                f"optim.num_nonfinite_steps_to_stop={self.num_to_stop}). It wrote no checkpoint since step "
                f"{self.first_since_contributed}: continue from the newest checkpoint (or start again if there is "
                f"none) with a lower learning rate, e.g. `--resume latest --set optim.lr={self.lr / 2:.3g}` (it is "
                f"{self.lr:.3g})")


__all__ = ["Diverged", "NonFiniteSteps"]
