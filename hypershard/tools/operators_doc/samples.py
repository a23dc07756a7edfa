"""Every call the document probes, per op: traced OpInfo samples, the hand table's traced code and
its written-out calls."""

from __future__ import annotations

import warnings
from typing import Iterable

from .calls import Call, meta_outputs, resolve
from .hand_table import extra_calls, manual_calls
from .tracing import Recorder, fast_samples, saved_rng, trace_opinfo


def collect_samples(rules: Iterable[str]) -> dict:
    """{op name: [Call, ...]} for the ops in `rules` that a traced sample (or a written-out call)
    reaches, best first."""
    wanted = set(rules)
    recorder = Recorder(wanted)
    with fast_samples(), saved_rng(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trace_opinfo(recorder)
        for source, fn in extra_calls():
            recorder.trace(source, fn)
    samples = recorder.result()
    for key, bound in manual_calls():
        op = resolve(key)
        if op is not None and key in wanted:
            samples.setdefault(key, []).append(Call(op, bound, meta_outputs(op, bound), "written out"))
    return samples
