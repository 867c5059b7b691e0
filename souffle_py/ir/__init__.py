"""The IR core every stage shares: the TE program (program.py), the sweeps over its TE graph (graph.py),
index and expression helpers (exprs.py), the marks passes leave for later passes and schedules (marks.py),
and the analyses (analysis/: tensor level, islpy element level, reuse).

It sits below everything else: te_passes/, souffle_py/passes, the schedules and the backends import it,
and it imports none of them (tests/test_import_cycles.py checks the layering)."""
