"""What the command-line tests share: run the CLI in-process, and the one-line error contract."""

from click.testing import CliRunner

from speccompile.cli import main


def invoke(*args, check: bool = False):
    """``speccompile ARGS`` in this process; ``check``: the command must succeed."""
    result = CliRunner().invoke(main, [str(a) for a in args])
    if check:
        assert result.exit_code == 0, result.output
    return result


def assert_one_line_error(result, *needles, exit_code: int | None = None) -> str:
    """Bad input: a non-zero exit (``exit_code`` when given), no traceback, and one ``error:`` line
    holding every needle; returns that line."""
    assert result.exit_code != 0 if exit_code is None else result.exit_code == exit_code, result.output
    assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit), result.exception
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]
