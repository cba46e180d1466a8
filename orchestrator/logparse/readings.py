"""What a log's lines give in numbers and rows: metric samples (engines', trainers', benchmarks', orch's
own protocol) and the rows plugins read from their own lines; the part of LogParser that samples them."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from . import bench, sglang, speculators, trainers, vllm
from .protocol import PROTOCOL, protocol_metrics
from .text import Line, stamp_seconds

_MAX_LOADS = 64  # processes whose target weights are remembered as loaded
_LAST_NUMBER = re.compile(r"-?[\d.]+(?:[eE][-+]?\d*)?\s*$")
_METRIC_SOURCES = (sglang.metrics, vllm.metrics)
_HEALTHY_METRICS = {"gen_throughput", "train/loss", "loss", "step"}


@dataclass
class Metric:
    name: str
    value: float
    line: int
    stamp: str | None = None  # the line's own time as printed, when it shows one (see text.stamp_time)
    repeat: int | None = None  # a benchmark result row: which result block (repeat) of the log, from 1


class RowReader(Protocol):
    """A plugin's reading of its own lines (store/runtables.LineReader is one): each line, cleaned as the parser
    reads it, that holds `marker` is handed to `read`; a row it returns goes to the table `table`, with the
    line's number."""

    @property
    def table(self) -> str: ...

    @property
    def marker(self) -> str: ...

    @property
    def read(self) -> Callable[[str], dict[str, Any] | None]: ...


class Readings:
    """LogParser's sampling of numbers and rows. What it keeps of the parser's state is named here; the
    parser makes and stores it."""

    phase: str
    lines: int
    metrics: dict[str, float]
    requests: list[float] | None
    blocks: int
    rows: list[tuple[str, dict[str, Any]]]
    _release: tuple[int, ...]
    _bench: dict[str, int]
    _load_begin: str | None
    _loaded: list[str]
    _cut_line: bool

    def _set_phase(self, phase: str) -> None:
        raise NotImplementedError  # the parser's

    def _healthy(self) -> None:
        raise NotImplementedError  # the error finder's

    def take_rows(self) -> list[tuple[str, dict[str, Any]]]:
        """The plugins' rows read since the last call, as (table, row), in the log's order."""
        taken, self.rows = self.rows, []
        return taken

    def _target_load(self, line: Line) -> bool:
        """Whether a vLLM 'Loading weights took' line is the target model's: the first of its process since
        its load began. A draft's (EAGLE-3, MTP) or the hidden-states extractor's follows it, and its bar is
        not the run's progress."""
        if line.source in self._loaded:
            return False
        self._loaded.append(line.source)
        del self._loaded[:-_MAX_LOADS]
        return True

    def _postfix(self, m: re.Match[str], line: Line) -> list[Metric]:
        """A bar's postfix metrics (Lightning's 'loss=2.61, v_num=0'); of a run of redraws taken at once,
        the last redraw's."""
        found: list[Metric] = []
        for name, value in trainers.postfix_metrics(m.group("postfix")):
            self._sample(name, value, line, found)
        return found

    def _metrics(self, line: Line, found: list[Metric]) -> None:
        text = line.text
        if self._cut_line:
            text = _LAST_NUMBER.sub("", text)  # '... acc=0.61' may have been '0.612' before the cut
        for source in _METRIC_SOURCES:
            for name, value in (sglang.metrics(text, self._release) if source is sglang.metrics else source(text)):
                if name == "load_weight_s" and vllm.LOAD_END.search(text) and not self._target_load(line):
                    continue  # a draft's load, after the target's
                self._sample(name, value, line, found)
                if name in _HEALTHY_METRICS:
                    self._healthy()
        # a line that states its metrics in orch's own words is read by those words only: its prefix
        # ('step 3 orch-metric loss=1.5') must not give the same samples a second time
        trained = [] if protocol_metrics(text) else (
            speculators.train_metrics(text) or trainers.dict_metrics(text)
            or trainers.step_metrics(text) or trainers.summary_metrics(text))
        for name, value in trained:
            self._sample(name, value, line, found)
        if trained:
            self._healthy()  # a trainer that reports its steps is alive
            if self.phase in ("starting", "loading"):
                self._set_phase("running")
        if line.source in self._bench:
            for name, value in bench.row(text):
                self._sample(name, value, line, found, self.blocks)
                if name in ("completed", "failed"):
                    self.requests = self.requests or [0.0, 0.0]
                    self.requests[name == "failed"] += value
        result = bench.result_line(text)
        if result is not None:
            for name, value in result[0]:
                self._sample(name, value, line, found)
            self._healthy()  # the tool measured: it is alive
            self._set_phase(result[1])
        mark = sglang.load_mark(text)
        if mark is not None:
            self._load_time(mark, line, found)
        if PROTOCOL in text:
            samples = protocol_metrics(text)
            for name, value in samples:
                self._sample(name, value, line, found)
            if samples:
                self._healthy()  # the job is alive and reporting

    def _load_time(self, mark: str, line: Line, found: list[Metric]) -> None:
        """A weight load's length from the times of its begin and end lines (SGLang before 0.5.23)."""
        if mark == "begin":
            self._load_begin = line.stamp
            return
        begin, end = stamp_seconds(self._load_begin), stamp_seconds(line.stamp)
        self._load_begin = None
        if begin is not None and end is not None:
            self._sample("load_weight_s", (end - begin) % 86400, line, found)

    def _sample(self, name: str, value: float, line: Line, found: list[Metric], repeat: int | None = None) -> None:
        self.metrics[name] = value
        found.append(Metric(name, value, self.lines, line.stamp, repeat))
