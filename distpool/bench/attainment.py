"""The highest request rate at which a deployment meets its SLOs for a target share of requests
(DistServe's figure: 90%), read off the rates measured."""

from __future__ import annotations

import math
from dataclasses import dataclass

TARGET_ATTAINMENT = 0.9


@dataclass(frozen=True)
class RateAtAttainment:
    """`rate`: the highest rate at `target` attainment; `kind` says how it was found: "interpolated"
    between the two measured rates around the crossing, "measured" (a measured rate sits exactly at
    the target, or meets it at the highest rate measured: the true rate is at least this), or "none"
    (not even the lowest rate met it; `rate` None). `measured`: (rate, attainment) as measured."""

    rate: float | None
    kind: str
    target: float
    measured: tuple[tuple[float, float], ...]

    def describe(self) -> str:
        points = "measured " + ", ".join(f"{r:g} req/s: {a:.2f}" for r, a in self.measured)
        if self.kind == "none":
            return f"below the lowest rate measured ({points})"
        if self.kind == "measured" and self.rate == self.measured[-1][0]:
            return f"at least {self.rate:.3g} req/s, the highest rate measured ({points})"
        return f"{self.rate:.3g} req/s ({self.kind}; {points})"


def rate_at_attainment(
    points: list[tuple[float, float]], target: float = TARGET_ATTAINMENT
) -> RateAtAttainment:
    """The highest rate whose attainment is >= `target`, linearly interpolated between the highest
    measured rate that meets it and the next one up. Infinite rates (everything at once) are left
    out: there is no line to draw to them."""
    finite = tuple(sorted((r, a) for r, a in points if math.isfinite(r)))
    if not finite:
        raise ValueError("the rate at an attainment needs a finite --request-rate; give one or more")
    meeting = [i for i, (_, a) in enumerate(finite) if a >= target]
    if not meeting:
        return RateAtAttainment(rate=None, kind="none", target=target, measured=finite)
    i = meeting[-1]
    rate, attained = finite[i]
    if i == len(finite) - 1 or attained == target:
        return RateAtAttainment(rate=rate, kind="measured", target=target, measured=finite)
    next_rate, next_attained = finite[i + 1]  # attainment below target there
    crossing = rate + (attained - target) / (attained - next_attained) * (next_rate - rate)
    return RateAtAttainment(rate=crossing, kind="interpolated", target=target, measured=finite)
