"""The artifact contract is written twice on purpose (analysis never imports the harness): the two
copies must stay the same strings, so a rename on one side fails here instead of in a report."""

from __future__ import annotations

import dataclasses

from analysis import keys as A
from harness import metrics as M
from harness.artifacts import Summary


def test_metric_keys_agree():
    assert M.ALL_KEYS == A.METRIC_KEYS
    assert (M.STEP, M.TOKENS) == (A.STEP, A.TOKENS)
    assert A.NUMERICS_PREFIX == M.NUMERICS + "/"


def test_summary_fields_agree():
    assert tuple(f.name for f in dataclasses.fields(Summary)) == A.SUMMARY_FIELDS


def test_statuses_the_harness_writes_are_known_to_analysis():
    import inspect

    from harness import train

    source = inspect.getsource(train)
    for status in (A.COMPLETED, A.DIVERGED, A.FAILED, A.PREEMPTED):
        assert f'"{status}"' in source
