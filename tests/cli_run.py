"""How the CLI tests run ``hippie-ds``: in-process, through ``hippie_ds.cli.main``."""

from hippie_ds.cli import main


def run(capsys, *argv):
    """``hippie-ds ARGV...`` (each argument as ``str``): (exit code, stdout, stderr)."""
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err
