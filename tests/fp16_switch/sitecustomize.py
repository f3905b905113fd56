"""Applies the tests' fp16 switch (fp16_switch.py beside it) in a process the suite started, when
the suite set it (``HIPPIE_TEST_FP16_ON_CPU=1``). Python imports ``sitecustomize`` at start-up from
the path; the suite puts this folder first on PYTHONPATH only when the switch is on."""

import os

if os.environ.get("HIPPIE_TEST_FP16_ON_CPU") == "1":
    import fp16_switch

    fp16_switch.apply()
