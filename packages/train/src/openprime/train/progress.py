"""What a node measures and reports as it trains: its step, outer-step, validation and progress records
(`Progress`, run by the training loop in trainer.py), the outer step's line, and the summary it ends with."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import attrs

from openprime.diloco import OuterStepResult
from openprime.fsdp import local_sum
from openprime.train.config import RunConfig
from openprime.train.hardware import mfu_peak_flops
from openprime.train.metrics import WallClock, human_bytes, model_flops_utilisation, progress_line, say
from openprime.train.model import num_flops_per_token

if TYPE_CHECKING:
    from openprime.train.trainer import Node


@attrs.frozen
class NodeSummary:
    """What a node reports when its run ends."""

    node: int
    first_loss: float
    last_loss: float
    num_outer_steps: int
    last_hash: str
    bytes_sent: int


class Progress:
    """What a node measures and reports as it trains: the step, outer-step, validation and progress records."""

    def __init__(self, cfg: RunConfig, node: Node) -> None:
        self.cfg, self.n = cfg, node
        self.tokens_per_step = node.tokens_per_step
        self.flops_per_token = num_flops_per_token(cfg.model, cfg.train.seq_len)
        self.peak_flops = mfu_peak_flops(cfg.metrics.peak_flops, node.device.type)
        # The progress line's window: the inner steps this node trained since the last line, and since when. Not
        # log_every steps: the last window of a run, the first after a resume or a join at a step that is not a
        # multiple of it, and one with a catch-up's jump in step are shorter (their tok/s read 1.5-3x too high).
        self.clock, self.window_start, self.window_steps = WallClock(), time.monotonic(), 0
        self.losses: list[float] = []
        self.outer: OuterStepResult | None = None
        self.sent = 0

    def step(self, step: int, loss: float, lr: float, step_s: float, result: OuterStepResult | None, *,
             grad_norm: float, skipped: bool) -> None:
        cfg, n = self.cfg, self.n
        self.losses.append(loss)
        self.window_steps += 1
        tokens_per_s = self.tokens_per_step / step_s
        n.write("step", step=step, loss=loss, lr=lr, tokens=n.tokens(step), step_s=step_s,
                tokens_per_s=tokens_per_s, mfu=self._mfu(tokens_per_s), grad_norm=grad_norm, skipped=skipped)
        # Where the node is now: `step`, unless its outer step gave it the run's state (a rejoin after an
        # eviction, a node that fell behind), which moved it on to the others' step. What comes after the inner
        # step is numbered from there, as the others number it.
        step = n.counters.num_inner_steps_done
        if result is not None:
            self.clock.outer_s += result.total_s
            self.outer_done(step, result, compute_utilisation=self.clock.compute_utilisation())
        last = step == cfg.train.num_steps
        num_nodes = len(n.mesh.view.members) if n.mesh.view else 1
        if cfg.train.eval_every and (step % cfg.train.eval_every == 0 or last):
            eval_start = time.monotonic()
            n.write("eval", step=step, val_loss=n.evaluate(), tokens=n.tokens(step), num_nodes=num_nodes)
            # The evaluation is not training: left out of the window, as out of the step records (whose tok/s said
            # 1.0k where the line of the same steps said 0.8k with train.eval_every = log_every, its MFU as low).
            self.window_start += time.monotonic() - eval_start
        if step % cfg.train.log_every == 0 or last:
            now = time.monotonic()
            window_tokens_per_s = self.tokens_per_step * self.window_steps / (now - self.window_start)
            self.window_start, self.window_steps = now, 0
            # The line's MFU is the window's, as its tok/s: the step record's is one step's, and the last step of a
            # window is often an outer step (log_every divides H), mostly network time.
            n.say(progress_line(node=n.node, step=step, num_steps=cfg.train.num_steps, loss=loss,
                                tokens_per_s=window_tokens_per_s, outer_steps=n.counters.num_outer_steps_done,
                                bytes_sent=self.sent, lr=lr, compute_utilisation=self.clock.compute_utilisation(),
                                mfu=self._mfu(window_tokens_per_s), num_nodes=num_nodes))

    def outer_done(self, step: int, result: OuterStepResult, *, compute_utilisation: float | None = None) -> None:
        """Record an outer step (or a joiner's catching up) with the node's bytes: each local rank's ring carries
        its shard, so the node's traffic is the sum over its ranks. A joiner's catching up was recorded with local
        rank 0's bytes only, half of a 2-rank node's state transfer (found 2026-12-07)."""
        node_sent, node_received = local_sum([result.bytes_sent, result.bytes_received], self.n.local_mesh)
        self.outer = attrs.evolve(result, bytes_sent=int(node_sent), bytes_received=int(node_received))
        self.sent += self.outer.bytes_sent
        self.n.report_outer(step, self.outer, compute_utilisation=compute_utilisation)

    def _mfu(self, tokens_per_s: float) -> float | None:
        return model_flops_utilisation(tokens_per_s=tokens_per_s, flops_per_token=self.flops_per_token,
                                       peak_flops=self.peak_flops, num_devices=self.cfg.fsdp.num_local_ranks)

    def summary(self) -> NodeSummary:
        return NodeSummary(node=self.n.node, first_loss=self.losses[0] if self.losses else float("nan"),
                           last_loss=self.losses[-1] if self.losses else float("nan"),
                           num_outer_steps=self.n.counters.num_outer_steps_done,
                           last_hash=self.outer.state_hash if self.outer else "", bytes_sent=self.sent)


def say_outer(node: int, r: OuterStepResult) -> None:
    """The outer step's line on the terminal."""
    if r.skipped:
        say(f"[node {node}] outer step {r.outer_step} SKIPPED after {r.num_tries - 1} failed tries (on every node)")
        return
    retried = f" after {r.num_tries} tries" if r.num_tries > 1 else ""
    say(f"[node {node}] outer step {r.outer_step}: {r.num_contributors} of {r.num_members} nodes{retried}, "
        f"all-reduce {r.all_reduce_s:.2f}s, sent {human_bytes(r.bytes_sent)}, global state hash {r.state_hash[:12]}")
