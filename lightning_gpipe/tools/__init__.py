"""Measurement: the per-step timeline and its traces, and the cost model of a schedule."""

from lightning_gpipe.tools.memory import peak_activation_memory
from lightning_gpipe.tools.simulate import Event, Simulation, simulate
from lightning_gpipe.tools.timeline import Timeline, step_stats
from lightning_gpipe.tools.trace import plot_gantt, write_chrome_trace

__all__ = [
    "Event",
    "Simulation",
    "Timeline",
    "peak_activation_memory",
    "plot_gantt",
    "simulate",
    "step_stats",
    "write_chrome_trace",
]
