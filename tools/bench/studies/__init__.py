"""The bench's studies: one module per ``python -m tools.bench NAME`` subcommand (tools/bench/commands.py
maps NAME to its module, and lists them all), each with ``main(argv) -> int`` and its own ``--help``;
helpers beside them (``link_calibration``: the all-reduce efficiency the scaling table's
predictions use; ``cut_sweep_report``: the cut sweep's figures, measured against predicted ranking). Archived studies
are in docs/archive.md, not here.
"""
