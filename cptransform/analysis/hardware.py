"""The hardware table the planner prices schedules with: one :class:`Hardware` row per chip.

Each row gives the dense peak matrix throughput by element size, the fraction of it an
attention kernel reaches, the memory per device and its link classes, fastest first: a
collective whose devices all lie within one ``domain`` (consecutive device ids: an NVLink
node, a TPU slice) runs at that class's bandwidth, otherwise at the next class's. Bandwidths
are what one device sends per second in one direction (half the bidirectional per-chip
figure of the spec sheets); latencies are the fixed cost of one collective step (order of
magnitude of NCCL-tests / ICI small-message latency, not spec-sheet numbers).

Sources (vendor spec sheets):

* TPU: Cloud TPU system architecture pages, cloud.google.com/tpu/docs/{v4,v5e,v5p,v6e}
  (peak bf16 per chip, HBM capacity, inter-chip interconnect bandwidth, pod size); the data
  center network (DCN) between slices is the per-host NIC bandwidth shared by its chips
  (v5e: 2 × 100 Gbps for 8 chips).
* GPU: NVIDIA A100 datasheet (SXM4 80GB: BF16 312 TFLOPS dense, TF32 156, NVLink 3 600 GB/s
  bidirectional), H100 datasheet (SXM5: BF16 989 TFLOPS dense, TF32 495, 80 GB, NVLink 4
  900 GB/s), H200 datasheet (SXM: same compute and NVLink as H100, 141 GB HBM3e);
  InfiniBand one HDR 200 Gb/s (A100) or NDR 400 Gb/s (H100, H200) NIC per GPU (DGX
  A100 / DGX H100 / DGX H200 reference designs); NVLink domain 8 GPUs (HGX baseboard).
  float32 matmuls run as TF32 on the tensor cores (JAX's default precision on GPU).
* Kernel efficiency: FlashAttention-2 reaches 50–73% of A100 peak (Dao 2023, §4.1) and
  FlashAttention-3 about 75% of H100 peak (Shah et al. 2024); 0.5 is used throughout.
  Measured rates of the local-step kernels, where we have them, are in ``kernel_tflops``
  (:meth:`Hardware.kernel_flops_per_s`): the H200's from ``bench/kernels.py`` at S=8K,
  B=1, H=16, D=128, bf16 (TFLOP/s of visible work: cuDNN 328 causal forward, 387 causal
  forward+backward, 567 and 540 unmasked; the Pallas kernel on Triton 67, 51, 137, 61).
  The planner chooses each attention's kernel first and prices every candidate schedule's
  local steps at that kernel's rates where the row has them (the row's own otherwise).
* ``cpu-sim``: 8 XLA host devices simulated on the 2 cores of this machine, fit by
  ``python bench/planner.py --calibrate`` to the forward and backward times of
  ``bench/results/peers*.json``
  (every simulated device shares the cores, so its FLOP/s is the machine's divided by 8,
  and the time follows the mean device's work, except in ring steps that leave some of
  the ``host_cores`` idle: ``shared_compute``).
"""
from __future__ import annotations

from dataclasses import dataclass, field

GB = 10 ** 9
GiB = 2 ** 30
TERA = 10 ** 12


@dataclass(frozen=True)
class LinkClass:
    """One kind of link: its name, what one device sends per second over it, the fixed cost
    of one collective step, and how many consecutive devices it connects (``None``: all)."""

    name: str
    bytes_per_s: float
    latency_s: float
    domain: int | None = None


@dataclass(frozen=True)
class Hardware:
    """One row of the hardware table (see the module doc for the sources)."""

    name: str
    flops: dict          # element bytes (2: bf16, 4: float32) -> dense peak FLOP/s
    memory_bytes: int
    links: tuple[LinkClass, ...]
    efficiency: float = 0.5
    # Fixed seconds of one local-step kernel call (dispatch, loop set-up, the merge of its
    # result): a ring pays it once per step, Ulysses and the all-gather once. Fitted where
    # measurements exist (cpu-sim); 0 for the rows without.
    call_s: float = 0.0
    # Simulated devices sharing one host's cores, which also do the transfers: compute
    # follows the mean device (unless a step leaves host_cores idle) and no transfer
    # overlaps compute.
    shared_compute: bool = False
    # FLOP/s of tiles whose rows fold a query-head group (GQA/MQA: G·chunk rows per KV
    # head) relative to one-head tiles. Fitted where measurements exist (cpu-sim: the
    # folded tiles outgrow the cache); 1 for the rows without.
    grouped_efficiency: float = 1.0
    # The same for the backward's tiles (dQ, dK, dV of folded rows), which fare otherwise:
    # fitted where measurements exist (cpu-sim: 0.952, where the forward's are 1.36).
    grouped_backward_efficiency: float = 1.0
    # The cores the simulated devices of a shared_compute row share: a device computing
    # while the others wait for a collective gets a whole core (Work.paced). None: every
    # device always gets its share (no step waits on another).
    host_cores: int | None = None
    # Seconds per FLOP for each MiB of the local kernel's score tile (Work.tile_bytes: the
    # float32 scores and probabilities of one chunk pair over the call's heads, written
    # and read back by every executed pair): the larger the tile, the less of it stays in
    # cache. Fitted where measurements exist (cpu-sim: an 8-head tile of 128 x 128, 1 MiB,
    # costs 25% more per FLOP than none); 0 for the rows without, and never added to a
    # kernel's measured rate (its own tiles are in it).
    tile_s: float = 0.0
    # Measured TFLOP/s of visible work per (kernel, mask, pass): mask "causal" or "full",
    # pass "forward" or "forward+backward" (bench/kernels.py); empty for the rows without.
    kernel_tflops: dict = field(default_factory=dict)
    # Seconds of one iteration of a sequential loop (a recurrence's step: a scan's
    # dispatch, its carry's round trip), the least a step costs however small its body;
    # not fitted: a launch-bound step's order of magnitude.
    loop_step_s: float = 5e-6

    def kernel_flops_per_s(self, kernel: str, mask: str, backward: bool = False
                           ) -> float | None:
        """The measured FLOP/s of visible work of ``kernel`` ("cudnn", "pallas") on a
        ``mask`` ("causal", "full") attention in its forward pass, or its backward pass
        alone (``backward``); ``None`` where this row has no measurement.

        The table holds forward and forward+backward rates (``bench/kernels.py`` counts the
        backward as 2.5 forwards, as :func:`~cptransform.analysis.block_work.backward_flops`
        does at ``D = Dv``): the backward's own rate is ``2.5 / (3.5 / r_fb - 1 / r_f)``."""
        forward = self.kernel_tflops.get((kernel, mask, "forward"))
        if not backward or forward is None:
            return None if forward is None else forward * TERA
        both = self.kernel_tflops.get((kernel, mask, "forward+backward"))
        alone = None if both is None else 3.5 / both - 1.0 / forward
        return None if alone is None or alone <= 0 else 2.5 / alone * TERA

    def alone_speedup(self, devices: int) -> float:
        """How much faster one of ``devices`` devices computes while the others wait than
        while all compute (:meth:`~cptransform.analysis.block_work.Work.paced`): 1 for
        devices with their own chips; with ``shared_compute`` the devices split the host's
        :attr:`host_cores`, so one alone gets a whole core, ``devices / host_cores`` times
        its share (unbounded without ``host_cores``: the mean device's work)."""
        if not self.shared_compute:
            return 1.0
        return float("inf") if self.host_cores is None else max(1.0, devices / self.host_cores)

    def compute_s(self, flops: float, dtype_bytes: int, calls: int = 1,
                  grouped: bool = False, backward: bool = False, rate: float | None = None,
                  tile_bytes: int = 0) -> float:
        """Seconds of compute of ``flops`` (a device's, as its steps pace it:
        :meth:`~cptransform.analysis.block_work.Work.paced`), plus ``calls`` kernel calls'
        fixed cost; ``grouped``: the tiles fold a query-head group
        (:attr:`grouped_efficiency`, or :attr:`grouped_backward_efficiency` for the
        ``backward`` pass); ``tile_bytes``: the kernel's score tile (:attr:`tile_s`);
        ``rate``: the kernel's measured FLOP/s (:meth:`kernel_flops_per_s`) instead of the
        row's."""
        if rate is None:
            folded = self.grouped_backward_efficiency if backward else self.grouped_efficiency
            rate = self.flops_per_s(dtype_bytes) * (folded if grouped else 1.0)
            return flops / rate + calls * self.call_s + flops * tile_bytes / 2 ** 20 * self.tile_s
        return flops / rate + calls * self.call_s

    def flops_per_s(self, dtype_bytes: int) -> float:
        """Matrix FLOP/s an attention kernel reaches on one-head tiles of ``dtype_bytes``
        elements."""
        peak = self.flops.get(dtype_bytes, min(self.flops.values()))
        return peak * self.efficiency

    def link(self, span: int) -> LinkClass:
        """The link class a collective over ``span`` consecutive devices runs at."""
        for link in self.links:
            if link.domain is None or span <= link.domain:
                return link
        return self.links[-1]


def _tpu(name, bf16_tflops, hbm_gb, ici_gbps_bidirectional, pod, dcn_gbps_per_chip):
    # TPU float32 matmuls at default precision run as one bf16 pass: the bf16 rate.
    return Hardware(name, {2: bf16_tflops * TERA, 4: bf16_tflops * TERA}, int(hbm_gb * GB),
                    (LinkClass("ici", ici_gbps_bidirectional / 2 / 8 * GB, 5e-6, pod),
                     LinkClass("dcn", dcn_gbps_per_chip / 8 * GB, 50e-6)))


def _gpu(name, bf16_tflops, tf32_tflops, hbm_gb, nvlink_gbytes_bidirectional, ib_gbps,
         kernel_tflops=None):
    return Hardware(name, {2: bf16_tflops * TERA, 4: tf32_tflops * TERA}, int(hbm_gb * GB),
                    (LinkClass("nvlink", nvlink_gbytes_bidirectional / 2 * GB, 10e-6, 8),
                     LinkClass("infiniband", ib_gbps / 8 * GB, 20e-6)),
                    kernel_tflops=kernel_tflops or {})


def _measured(**rates):
    """``kernel_tflops`` from ``kernel=(causal forward, causal forward+backward, full
    forward, full forward+backward)`` TFLOP/s."""
    return {(kernel, mask, step): rate for kernel, four in rates.items()
            for (mask, step), rate in zip([(m, p) for m in ("causal", "full")
                                           for p in ("forward", "forward+backward")], four)}


#: The hardware table by name.
HARDWARE: dict[str, Hardware] = {h.name: h for h in (
    # name     bf16 TFLOPS, HBM GB, ICI Gbps (bidir.), pod chips, DCN Gbps per chip
    _tpu("tpu-v4", 275, 32 * GiB / GB, 2400, 4096, 50),
    _tpu("tpu-v5e", 197, 16, 1600, 256, 25),
    _tpu("tpu-v5p", 459, 95, 4800, 8960, 50),
    _tpu("tpu-v6e", 918, 32, 3584, 256, 50),
    # name     bf16 / TF32 TFLOPS dense, HBM GB, NVLink GB/s (bidir.), IB Gb/s per GPU
    _gpu("a100", 312, 156, 80, 600, 200),
    _gpu("h100", 989, 495, 80, 900, 400),
    _gpu("h200", 989, 495, 141, 900, 400,
         _measured(cudnn=(328, 387, 567, 540), pallas=(67, 51, 137, 61))),
    # Fit by bench/planner.py --calibrate to the forward and backward times of
    # bench/results/peers*.json (2K-32K tokens, MHA and GQA, causal), per simulated device,
    # on this machine's 2 cores (host_cores). The "bandwidth" absorbs the per-byte work
    # around a transfer (copies, merges), far below a memcpy; a per-step latency fitted
    # negative, so there is none. The cost per kernel call (each call is a separate chunked
    # loop with its own block classification) is what lets one-call Ulysses beat the 8-call
    # ring at short lengths; tile_s is what makes Ulysses' one-head tiles (128 KiB) and the
    # hybrid's four-head ones cheaper per FLOP than the ring's and the all-gather's 1 MiB.
    Hardware("cpu-sim", {2: 1.81e10, 4: 1.81e10}, 8 * GiB,
             (LinkClass("memcpy", 2.71e8, 0.0),), efficiency=1.0, call_s=1.96e-3,
             shared_compute=True, grouped_efficiency=1.36, grouped_backward_efficiency=0.952,
             host_cores=2, tile_s=1.39e-11),
)}

#: ``jax.Device.device_kind`` prefixes (lower case) → hardware row.
DEVICE_KINDS = (("tpu v4", "tpu-v4"), ("tpu v5 lite", "tpu-v5e"), ("tpu v5e", "tpu-v5e"),
                ("tpu v5p", "tpu-v5p"), ("tpu v5", "tpu-v5p"), ("tpu v6 lite", "tpu-v6e"),
                ("tpu v6e", "tpu-v6e"), ("nvidia a100", "a100"), ("nvidia h100", "h100"),
                ("nvidia h200", "h200"))


def hardware_for_device(platform: str, device_kind: str) -> str | None:
    """The row for a device (``jax.Device.platform`` / ``device_kind``), ``None`` if the
    table has none; every CPU is ``cpu-sim``."""
    if platform == "cpu":
        return "cpu-sim"
    kind = device_kind.lower()
    return next((row for prefix, row in DEVICE_KINDS if kind.startswith(prefix)), None)


def memory_limit_problem(limit) -> str | None:
    """Why ``limit`` is not a memory limit (``None`` when it is): bytes as a positive int,
    or a percentage of the hardware's memory such as ``"80%"``."""
    if limit is None or (isinstance(limit, int) and not isinstance(limit, bool) and limit > 0):
        return None
    if isinstance(limit, str) and limit.endswith("%"):
        try:
            percent = float(limit[:-1])
        except ValueError:
            percent = -1.0
        if 0 < percent <= 100:
            return None
    return (f"memory_limit={limit!r}: give bytes per device as a positive int (e.g. "
            "40 * 2**30) or a share of the hardware's memory as a string such as '80%'")


def memory_limit_bytes(limit, hardware: Hardware) -> int:
    """The per-device byte limit ``limit`` names on ``hardware`` (``None``: all its memory);
    ``limit`` must pass :func:`memory_limit_problem`."""
    if limit is None:
        return hardware.memory_bytes
    if isinstance(limit, str):
        return int(hardware.memory_bytes * float(limit[:-1]) / 100)
    return limit
