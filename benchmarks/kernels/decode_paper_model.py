"""How fast a decode kernel's KV loop can go on an H200, from its compiled loop alone.

Issue 41's question for the fp8 KV cache: does reading half the bytes make decode >= 1.5x
the bf16 kernel, or does the loop's work per byte cap it first? This answers it on paper from
:class:`~jaxpaged.benchmarks.kernels.schedule_check.ScheduleFacts` (the loop compiled for
sm_90 with upstream Triton, read off its SASS): an SM streams a program's tiles no faster than
the slowest of three resources allows, each taken at its peak:

- **HBM**: the tile's K and V bytes at the SM's share of the bandwidth (4.8 TB/s over 132
  SMs at 1.98 GHz: 18.4 bytes a cycle);
- **issue**: the loop's warp instructions (instructions x warps) at 4 a cycle (four
  schedulers, one instruction each a cycle);
- **shared memory**: the loop's 128-byte wavefronts (x warps) at one a cycle.

Peaks are upper bounds: real kernels reach a fraction of each (the bf16 decode goal is 80% of
HBM; a loop mixing MMA, MUFU and shared-memory instructions sustains well under 4 issues a
cycle). :func:`speed_ratio` takes an issue efficiency to show how sensitive a verdict is.
Residency (programs per SM) only has to be enough to overlap the three; it is reported by
the schedule check, not modelled here.
"""

from __future__ import annotations

import dataclasses

#: H200 SXM: HBM3e bandwidth (bytes/s), SMs, boost clock (Hz), warp instructions issued per
#: SM per cycle, shared-memory wavefronts per SM per cycle.
H200 = dict(hbm_bytes_per_s=4.8e12, sms=132, clock_hz=1.98e9, issue_per_cycle=4,
            wavefronts_per_cycle=1)


@dataclasses.dataclass(frozen=True)
class TileCycles:
    """SM cycles one loop iteration (one KV tile of one program) needs of each resource."""

    hbm: float
    issue: float
    shared: float

    def bound(self, issue_efficiency: float = 1.0) -> tuple[float, str]:
        """(cycles, the limiting resource) with issue at ``issue_efficiency`` of its peak."""
        options = {"HBM": self.hbm, "issue": self.issue / issue_efficiency,
                   "shared": self.shared}
        name = max(options, key=options.get)
        return options[name], name


def tile_cycles(facts, device=H200) -> TileCycles:
    """:class:`TileCycles` of a kernel's loop from its ``ScheduleFacts``."""
    bytes_per_cycle = device["hbm_bytes_per_s"] / (device["sms"] * device["clock_hz"])
    return TileCycles(hbm=facts.tile_kv_bytes / bytes_per_cycle,
                      issue=facts.loop_instructions * facts.num_warps
                      / device["issue_per_cycle"],
                      shared=facts.shared_wavefronts * facts.num_warps
                      / device["wavefronts_per_cycle"])


def speed_ratio(fast, base, *, fast_keys: int, base_keys: int,
                issue_efficiency: float = 1.0, device=H200) -> float:
    """Keys a second of ``fast`` over ``base`` (e.g. fp8 over bf16 decode), each at its
    bound; ``*_keys``: keys a tile."""
    fast_cycles, _ = tile_cycles(fast, device).bound(issue_efficiency)
    base_cycles, _ = tile_cycles(base, device).bound(issue_efficiency)
    return (base_cycles / base_keys) / (fast_cycles / fast_keys)


def report(fp8, bf16, *, keys: int, efficiencies=(1.0, 0.5)) -> list[str]:
    """Lines comparing fp8 and bf16 decode loops (same ``keys`` a tile)."""
    lines = []
    for name, facts in (("bf16", bf16), ("fp8", fp8)):
        c = tile_cycles(facts)
        lines.append(f"{name}: per tile HBM {c.hbm:.0f}, issue {c.issue:.0f}, shared "
                     f"{c.shared:.0f} SM cycles ({facts.num_warps} warps); warp instructions "
                     f"a KiB of K/V {facts.warp_instructions_per_kv_kib:.0f}")
    for eff in efficiencies:
        limits = [tile_cycles(f).bound(eff)[1] for f in (bf16, fp8)]
        ratio = speed_ratio(fp8, bf16, fast_keys=keys, base_keys=keys, issue_efficiency=eff)
        lines.append(f"issue at {eff:.0%} of peak: bf16 {limits[0]}-bound, fp8 {limits[1]}-bound,"
                     f" fp8/bf16 = {ratio:.2f}x")
    return lines
