"""Predicted time of one schedule for one attention on one machine: :class:`Prediction`.

A pass (forward, or backward) of a schedule over ``n`` steps (the ring's ``cp``; 1 for a
schedule that computes once) costs

``exposed + c/n + (n-1)·max(c/n, m/(n-1)) + latency``

with ``c`` the compute of a device (executed FLOPs after block skipping, each step's of its
busiest device (``Work.paced``), over the hardware's attention FLOP/s for the dtype, plus
the fixed cost ``Hardware.call_s`` of each of its kernel calls and the cost of its score
tiles ``Hardware.tile_s``), ``m`` the bytes of the ``overlapped`` transfers
(sent one step ahead) and ``exposed`` those of the others, each over the bandwidth of the
link class its mesh axis spans (:meth:`Hardware.link`), and ``latency`` one link latency
per waited-for payload collective and per step. On simulated devices
(``Hardware.shared_compute``) the host's cores do the transfers too: nothing overlaps, and
a step's compute is the mean device's unless too few devices are busy to fill the cores.
A step's transfer hides behind its compute when ``c/n ≥ m/(n-1)``: since compute per
step grows with the square of the block length and the transfer linearly, that is a
block of at least ``overlap_tokens`` tokens (the design's ``c ≥ F/B``, scaled by
``h_kv/h``, the dtype and the fraction of the block the mask leaves to compute).
"""
from __future__ import annotations

from dataclasses import dataclass

from cptransform.analysis.block_work import Work
from cptransform.analysis.cost_model import CommVolume, Transfer
from cptransform.analysis.hardware import Hardware


@dataclass(frozen=True)
class Prediction:
    """What one schedule is predicted to cost for one attention, per device.

    ``time_s`` forward plus backward (``forward_s`` alone), of which ``compute_s`` computing
    and ``comm_s`` waiting for transfers (latency included); ``memory_bytes`` the peak of the
    local step; ``flops`` executed (forward + backward) by the slowest device; ``bytes``
    moved (forward + backward); ``balance`` slowest device / mean; ``overlap_tokens`` the
    block length from which overlapped transfers hide behind compute (``None``: nothing
    overlaps) against the actual ``block_tokens``.
    """

    schedule: str
    time_s: float
    forward_s: float
    compute_s: float
    comm_s: float
    memory_bytes: int
    flops: int
    bytes: int
    balance: float
    overlap_tokens: float | None = None
    block_tokens: int = 0

    def describe(self) -> str:
        """One line: time, its parts, memory, FLOPs, bytes and the overlap condition."""
        line = (f"{self.schedule}: {_seconds(self.time_s)} fwd+bwd (forward "
                f"{_seconds(self.forward_s)}; compute {_seconds(self.compute_s)}, "
                f"exposed communication {_seconds(self.comm_s)}), memory "
                f"{_bytes(self.memory_bytes)}, {self.flops / 1e9:.3g} GFLOP "
                f"(balance {self.balance:.2f}x), {_bytes(self.bytes)} moved")
        if self.overlap_tokens is not None:
            holds = "hidden" if self.block_tokens >= self.overlap_tokens else "not hidden"
            line += (f"; transfers {holds} (block {self.block_tokens} tokens, needs ≥ "
                     f"{self.overlap_tokens:.0f})")
        return line


def _bytes(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def _seconds(t: float) -> str:
    return f"{t * 1e3:.3g} ms" if t < 1 else f"{t:.3g} s"


def _pass_time(transfers: list[Transfer], compute: float, steps: int, hardware: Hardware,
               spans: tuple[int, ...]) -> tuple[float, float]:
    """``(time, overlapped seconds per step over compute seconds per step)`` of one pass."""
    def seconds(t: Transfer) -> float:
        return t.bytes / hardware.link(spans[t.axis]).bytes_per_s

    exposed = sum(seconds(t) for t in transfers if not t.overlapped)
    hidden = sum(seconds(t) for t in transfers if t.overlapped)
    latency = sum(hardware.link(spans[t.axis]).latency_s for t in transfers
                  if t.payload and not t.overlapped)
    if steps > 1 and not hardware.shared_compute:
        latency += (steps - 1) * max((hardware.link(spans[t.axis]).latency_s
                                      for t in transfers if t.overlapped), default=0.0)
        step = compute / steps
        pipelined = step + (steps - 1) * max(step, hidden / (steps - 1))
        ratio = hidden / (steps - 1) / step if step else float("inf")
    else:
        pipelined, ratio = compute + hidden, 0.0
    return exposed + pipelined + latency, ratio


def predict(name: str, volume: CommVolume, work: Work, memory_bytes: int, steps: int,
            seq_len: int, dtype_bytes: int, hardware: Hardware,
            spans: tuple[int, ...], kernel: tuple[str, str] | None = None,
            devices: int = 1) -> Prediction:
    """The :class:`Prediction` of schedule ``name`` from its volume, work, memory and steps
    (``spans[i]``: how many consecutive devices the groups of its mesh axis ``i`` span;
    ``devices``: how many compute it);
    ``kernel``: ``(kernel name, "causal" | "full")`` of its local step, whose measured rates
    (:meth:`Hardware.kernel_flops_per_s`) replace the row's where it has them."""
    grouped = work.group > 1
    rates = (None, None) if kernel is None else \
        (hardware.kernel_flops_per_s(*kernel), hardware.kernel_flops_per_s(*kernel, True))
    paced = work.paced(hardware.alone_speedup(devices)) / work.balance
    fwd_compute = hardware.compute_s(work.forward_flops * paced, dtype_bytes, work.calls,
                                     grouped, rate=rates[0], tile_bytes=work.tile_bytes)
    bwd_compute = hardware.compute_s(work.backward_flops * paced, dtype_bytes, work.calls,
                                     grouped, backward=True, rate=rates[1],
                                     tile_bytes=work.tile_bytes)
    forward = [t for t in volume.transfers if not t.backward]
    backward = [t for t in volume.transfers if t.backward]
    fwd_s, ratio = _pass_time(forward, fwd_compute, steps, hardware, spans)
    bwd_s, _ = _pass_time(backward, bwd_compute, steps, hardware, spans)
    block = seq_len // steps
    overlapping = steps > 1 and any(t.overlapped for t in forward) \
        and not hardware.shared_compute
    total = fwd_s + bwd_s
    return Prediction(name, total, fwd_s, fwd_compute + bwd_compute,
                      total - fwd_compute - bwd_compute, memory_bytes, work.flops,
                      volume.forward_total + volume.backward_total, work.balance,
                      block * ratio if overlapping else None, block)
