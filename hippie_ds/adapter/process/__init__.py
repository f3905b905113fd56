"""Process safety: a handler that raises ends the job now (``failure``), and gloo idle before the interpreter finalizes
(``clean_exit``, ``hippie_ds.shutdown``)."""
