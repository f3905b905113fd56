"""Start-up: the config and the plan read once, and every check ``hippie_ds.initialize`` makes,
in one order, before any process group."""
