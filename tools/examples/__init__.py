"""The example models and their shared training harness (``gpt``, ``vgg``, ``harness``), imported
as ``from examples import gpt`` by the scripts in tools/ (which run with tools/ on sys.path)."""
