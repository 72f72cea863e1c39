"""``openk3 eval`` progress: one tqdm bar per suite on stderr, counting answered requests; the table
is the same with and without it."""

from __future__ import annotations

import re

from openk3.eval import OracleModel, run_eval, suite_items
from openk3.datasets.sft_data import EVAL_SUITES

N = 3


class _Reporting(OracleModel):
    def chat(self, requests, progress=None):
        out = []
        for r in requests:
            out += super().chat([r])
            if progress is not None:
                progress(1)
        return out


def test_progress_bar_per_suite_on_stderr(capsys):
    model = _Reporting([it for s in EVAL_SUITES for it in suite_items(s, 0, N)])
    quiet = run_eval(model, n=N, suites=EVAL_SUITES)
    assert capsys.readouterr().err == ""
    shown = run_eval(model, n=N, suites=EVAL_SUITES, progress=True)
    assert shown == quiet
    err = capsys.readouterr().err
    for suite in EVAL_SUITES:
        done = re.findall(rf"eval {suite}: 100%\|[^|]*\| (\d+)/(\d+) \[", err)
        assert done and done[-1][0] == done[-1][1], (suite, err)
    # a model without progress reporting (the OracleModel itself) still runs, silently
    assert run_eval(OracleModel([it for s in EVAL_SUITES for it in suite_items(s, 0, N)]), n=N,
                    suites=EVAL_SUITES, progress=True) == quiet
    assert capsys.readouterr().err == ""
