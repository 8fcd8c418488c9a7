"""Summaries, ratios and the PASS/MISS lines for the targets of the design."""

from __future__ import annotations

import functools
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

MIB = 2**20
MEM_SLACK = 256 * MIB  # the design's allowance above the state for a save or load


@dataclass
class Record:
    """One measured operation: a method (or one fio shape) in one repeat of one phase."""

    phase: str  # save | load
    method: str  # a method name, or "fio" for a fio shape
    label: str
    repeat: int
    nbytes: int
    seconds: float | None = None
    peak_increase: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    error: str | None = None

    @property
    def gbps(self) -> float | None:
        return self.nbytes / self.seconds / 1e9 if self.seconds else None

    def as_json(self) -> dict[str, Any]:
        return {**asdict(self), "gbps": self.gbps}


@dataclass(frozen=True)
class Summary:
    label: str
    median: float
    low: float
    high: float
    runs: int
    peak_increase: int | None  # worst (max) over repeats: memory limits are about the worst case


def summarize(records: list[Record]) -> Summary | None:
    speeds = [r.gbps for r in records if r.gbps is not None and r.error is None]
    if not speeds:
        return None
    peaks = [r.peak_increase for r in records if r.peak_increase is not None]
    return Summary(
        records[0].label,
        statistics.median(speeds),
        min(speeds),
        max(speeds),
        len(speeds),
        max(peaks) if peaks else None,
    )


def ceiling(records: list[Record]) -> Summary | None:
    """Best fio shape by median: the disk's ceiling for this phase."""
    by_shape: dict[str, list[Record]] = {}
    for record in records:
        by_shape.setdefault(record.label, []).append(record)
    summaries = [s for s in (summarize(rs) for rs in by_shape.values()) if s is not None]
    return max(summaries, key=lambda s: s.median, default=None)


def _fmt_peak(peak: int | None, state_bytes: int) -> str:
    if peak is None:
        return "-"
    return f"{peak / MIB:8.0f} ({peak / state_bytes:4.2f}x)"


def table(title: str, rows: list[Summary], ceil: Summary | None, state_bytes: int) -> list[str]:
    lines = [
        title,
        f"  {'method':<44} {'median GB/s':>11} {'min':>6} {'max':>6} {'n':>2} {'x ceiling':>9}"
        f" {'median s':>9} {'s range':>13}  peak RSS +MiB (x state)",
    ]
    for row in ([ceil] if ceil else []) + rows:
        ratio = f"{row.median / ceil.median:9.2f}" if ceil else f"{'-':>9}"
        name = f"ceiling: {row.label}" if row is ceil else row.label
        # Seconds for the state's bytes (a fio shape's own size may differ slightly).
        secs = f"{state_bytes / row.median / 1e9:9.3f}"
        span = f"{state_bytes / row.high / 1e9:.3f}-{state_bytes / row.low / 1e9:.3f}"
        lines.append(
            f"  {name:<44} {row.median:11.2f} {row.low:6.2f} {row.high:6.2f} {row.runs:2d}"
            f" {ratio} {secs} {span:>13}  {_fmt_peak(row.peak_increase, state_bytes)}"
        )
    return lines


@dataclass(frozen=True)
class Target:
    phase: str
    what: str
    value: float | None
    goal: str
    passed: bool | None  # None: not measurable in this run

    def line(self) -> str:
        verdict = {True: "PASS", False: "MISS", None: "n/a "}[self.passed]
        shown = "n/a" if self.value is None else f"{self.value:.2f}"
        return f"  {verdict}  {self.what:<40} {shown:>8}   target {self.goal}"


def _ratio(subject: Summary | None, other: Summary | None) -> float | None:
    return subject.median / other.median if subject and other else None


def _meets(ratio: float, goal: float) -> bool:
    # A goal of 1x means "faster than": a tie is not a win.
    return ratio > goal if goal == 1.0 else ratio >= goal


def _target(
    phase: str, what: str, value: float | None, goal: str, ok: Callable[[float], bool]
) -> Target:
    return Target(phase, what, value, goal, None if value is None else bool(ok(value)))


def ratio_lines(
    phase: str, subject: Summary | None, peers: dict[str, Summary | None], goals: dict[str, float]
) -> tuple[list[str], list[Target]]:
    """fastpersist / peer for each peer; a goal makes it a target, else it is shown for context."""
    lines: list[str] = []
    targets: list[Target] = []
    for peer, summary in peers.items():
        value = _ratio(subject, summary)
        if peer in goals:
            goal = goals[peer]
            relation = f">= {goal:g}x" if goal != 1.0 else "> 1x (faster)"
            target = _target(
                phase,
                f"fastpersist / {peer}",
                value,
                relation,
                functools.partial(_meets, goal=goal),
            )
            targets.append(target)
            lines.append(target.line())
        else:
            shown = "n/a" if value is None else f"{value:.2f}"
            lines.append(f"  info  {'fastpersist / ' + peer:<40} {shown:>8}")
    return lines, targets


def memory_target(phase: str, subject: Summary | None, state_bytes: int) -> Target:
    peak = subject.peak_increase if subject else None
    # A save starts with the state in memory, so only the slack is allowed on top; a load
    # must create the state, so it may use the state plus the slack.
    limit = MEM_SLACK if phase == "save" else state_bytes + MEM_SLACK
    goal = f"<= {limit / MIB:.0f} MiB" + ("" if phase == "save" else " (state + 256)")
    value = None if peak is None else peak / MIB
    return _target(
        phase,
        f"fastpersist {phase} peak RSS increase (MiB)",
        value,
        goal,
        lambda v: v * MIB <= limit,
    )
