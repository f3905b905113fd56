"""The user examples: two training scripts (``train_gpt.py``, ``train_vgg.py``, run by path under
the ``deepspeed`` launcher), their models (``gpt``, ``vgg``), their shared training harness
(``harness``) and a Megatron-style learning-rate schedule (``lr_schedule``). Imported as
``from tools.examples import gpt`` from the repository root."""
